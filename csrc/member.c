/*
 * member.c - the sorted-set member of a request: a fresh UUID4 in canonical text, from a
 * page of kernel randomness that also tells a fork child apart. Pure C, no Python objects.
 *
 * libuuid's uuid_generate_random() costs about 2 us and six syscalls per id here, more
 * than everything else a check does on the client. So ids come from a page of kernel
 * randomness (getrandom) refilled every 255 ids, with the version and variant bits set
 * as RFC 4122 says, and libuuid formats them. The page is marked MADV_WIPEONFORK: a fork
 * child finds it zeroed and refills, so it never repeats its parent's ids. Where the
 * kernel lacks that flag, the page remembers its pid and a changed pid forces a refill.
 *
 * The same wiped page tells the limiters that a fork happened (rl_fork_generation), so
 * they drop their parent's sockets without a getpid() syscall on every call.
 *
 * Portability: Linux has getrandom(2) and libuuid (util-linux, found by setup.py with
 * pkg-config); macOS has getentropy(2), at most 256 bytes a call, and the uuid functions in
 * its C library (<uuid/uuid.h>), which setup.py selects with RL_SYSTEM_UUID.
 *
 * GIL contract: the page is module state, used only with the GIL held (py_request.c).
 */
#include "native.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>
#ifdef RL_SYSTEM_UUID
#include <uuid/uuid.h> /* the C library's (macOS) */
#else
#include <uuid.h> /* libuuid's */
#endif

#define RL_RANDOM_PAGE 4096

/* The page itself: zeroed by the kernel in a fork child when MADV_WIPEONFORK took. */
typedef struct {
    int alive;         /* 1 in the process that set it; 0 in a fork child */
    int filled;        /* 0 after a fork (wiped) or before the first fill */
    pid_t pid;         /* filler's pid, checked when the page is not wiped */
    unsigned int used; /* bytes of `bytes` handed out */
    unsigned char bytes[RL_RANDOM_PAGE - 4 * sizeof(int)];
} rl_random_page;

struct rl_random {
    rl_random_page *page;     /* mmap'd, MADV_WIPEONFORK when the kernel has it */
    int wipes_on_fork;        /* the madvise took effect */
    pid_t last_pid;           /* for the getpid() fallback when it did not */
    unsigned long generation; /* bumped once per fork seen; starts at 1 */
};

rl_random *
rl_random_new(void)
{
    rl_random *r = malloc(sizeof(*r));
    if (r == NULL)
        return NULL;
    r->page =
        mmap(NULL, RL_RANDOM_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (r->page == MAP_FAILED) {
        int saved = errno;
        free(r);
        errno = saved;
        return NULL;
    }
#ifdef MADV_WIPEONFORK
    r->wipes_on_fork = madvise(r->page, RL_RANDOM_PAGE, MADV_WIPEONFORK) == 0;
#else
    r->wipes_on_fork = 0;
#endif
    r->page->alive = 1;
    r->last_pid = getpid();
    r->generation = 1;
    return r;
}

void
rl_random_free(rl_random *r)
{
    if (r == NULL)
        return;
    munmap(r->page, RL_RANDOM_PAGE);
    free(r);
}

unsigned long
rl_fork_generation(rl_random *r)
{
    if (r->wipes_on_fork) {
        /* A wiped page means: this process is a fork child that has not looked yet. No
           syscall on the usual path, and a fork() made from C is seen too. */
        if (!r->page->alive) {
            r->page->alive = 1;
            r->generation++;
        }
    } else {
        pid_t pid = getpid();
        if (pid != r->last_pid) {
            r->last_pid = pid;
            r->generation++;
        }
    }
    return r->generation;
}

/* Fills buf with kernel randomness. 0, or -1 with errno. */
static int
kernel_random(unsigned char *buf, size_t len)
{
    size_t got = 0;
    while (got < len) {
#ifdef __APPLE__
        size_t n = len - got < 256 ? len - got : 256; /* getentropy's most per call */
        if (getentropy(buf + got, n) < 0)
            return -1;
#else
        ssize_t n = getrandom(buf + got, len - got, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
#endif
        got += (size_t)n;
    }
    return 0;
}

static int
refill(rl_random_page *page)
{
    if (kernel_random(page->bytes, sizeof(page->bytes)) < 0)
        return -1;
    page->pid = getpid();
    page->used = 0;
    page->filled = 1;
    return 0;
}

int
rl_member_uuid4(rl_random *r, char out[RL_MEMBER_LEN + 1])
{
    rl_random_page *page = r->page;
    unsigned char id[16];
    if (!page->filled || page->used + 16 > sizeof(page->bytes) ||
        (!r->wipes_on_fork && page->pid != getpid())) {
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
