/*
 * base.c - the ground floor: errors, the wipe of secrets and the clocks, used by every
 * other room of the extension and calling none of them (it includes base.h only).
 *
 * GIL contract: no Python object is touched here; any thread may call any of these with
 * or without the GIL.
 */
#include "base.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

rl_status
rl_error_set(rl_error *err, rl_status kind, const char *fmt, ...)
{
    va_list ap;
    err->kind = kind;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
    return kind;
}

void
rl_wipe(void *buf, size_t len)
{
    if (buf != NULL && len > 0)
        explicit_bzero(buf, len);
}

#ifdef RL_DEBUG_HOOKS
void
rl_check_wiped(const void *buf, size_t len, const char *what)
{
    if (buf != NULL && memmem(buf, len, RL_WIPE_CANARY, sizeof(RL_WIPE_CANARY) - 1) != NULL) {
        fprintf(stderr,
                "genai_ratelimit: %s that held a password was freed without being wiped "
                "(the wipe canary is still in it)\n",
                what);
        abort();
    }
}
#endif

long long
rl_clock_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000LL + (long long)(ts.tv_nsec / 1000000L);
}

double
rl_monotonic(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}
