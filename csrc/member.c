/*
 * member.c - the sorted-set member of a request (a fresh UUID4 in canonical text) and the
 * millisecond clock used with clock="client". Pure C, no Python objects, no GIL needed.
 */
#include "native.h"

#include <time.h>
#include <uuid.h>

void
rl_member_uuid4(char out[RL_MEMBER_LEN + 1])
{
    uuid_t id;
    /* libuuid reads the kernel's CSPRNG (getrandom) for version 4 ids. */
    uuid_generate_random(id);
    uuid_unparse_lower(id, out);
}

long long
rl_clock_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000LL + (long long)(ts.tv_nsec / 1000000L);
}
