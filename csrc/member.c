/*
 * member.c - the sorted-set member of a request (a fresh UUID4 in canonical text) and the
 * millisecond clock used with clock="client". Pure C, no Python objects.
 *
 * libuuid's uuid_generate_random() costs about 2 us and six syscalls per id here, more
 * than everything else a check does on the client. So ids come from a page of kernel
 * randomness (getrandom) refilled every 255 ids, with the version and variant bits set
 * as RFC 4122 says, and libuuid formats them. The page is marked MADV_WIPEONFORK: a fork
 * child finds it zeroed and refills, so it never repeats its parent's ids. Where the
 * kernel lacks that flag, the page remembers its pid and a changed pid forces a refill.
 *
 * GIL contract: the page is module state, used only with the GIL held (args.c).
 */
#include "native.h"

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>
#include <uuid.h>

#define RL_RANDOM_PAGE 4096

struct rl_random {
    int filled;                  /* 0 after a fork (wiped) or before the first fill */
    int wipes_on_fork;           /* MADV_WIPEONFORK took effect */
    pid_t pid;                   /* filler's pid, checked when wipes_on_fork is 0 */
    unsigned int used;           /* bytes of `bytes` handed out */
    unsigned char bytes[RL_RANDOM_PAGE - 4 * sizeof(int)];
};

rl_random *
rl_random_new(void)
{
    rl_random *page = mmap(NULL, RL_RANDOM_PAGE, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (page == MAP_FAILED)
        return NULL;
#ifdef MADV_WIPEONFORK
    page->wipes_on_fork = madvise(page, RL_RANDOM_PAGE, MADV_WIPEONFORK) == 0;
#else
    page->wipes_on_fork = 0;
#endif
    return page;
}

void
rl_random_free(rl_random *page)
{
    if (page != NULL)
        munmap(page, RL_RANDOM_PAGE);
}

static int
refill(rl_random *page)
{
    size_t got = 0;
    int wipes = page->wipes_on_fork;
    while (got < sizeof(page->bytes)) {
        ssize_t n = getrandom(page->bytes + got, sizeof(page->bytes) - got, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        got += (size_t)n;
    }
    page->wipes_on_fork = wipes; /* a wiped page lost it; it did wipe, so keep it */
    page->pid = getpid();
    page->used = 0;
    page->filled = 1;
    return 0;
}

int
rl_member_uuid4(rl_random *page, char out[RL_MEMBER_LEN + 1])
{
    unsigned char id[16];
    if (!page->filled || page->used + 16 > sizeof(page->bytes) ||
        (!page->wipes_on_fork && page->pid != getpid())) {
        if (refill(page) < 0)
            return -1;
    }
    memcpy(id, page->bytes + page->used, 16);
    memset(page->bytes + page->used, 0, 16); /* an id is handed out once */
    page->used += 16;
    id[6] = (unsigned char)((id[6] & 0x0f) | 0x40); /* version 4 */
    id[8] = (unsigned char)((id[8] & 0x3f) | 0x80); /* RFC 4122 variant */
    uuid_unparse_lower(id, out);
    return 0;
}

long long
rl_clock_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000LL + (long long)(ts.tv_nsec / 1000000L);
}
