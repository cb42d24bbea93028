/*
 * base.c - the ground floor: errors, the wipe of secrets, the clocks and what differs
 * between Linux and macOS, used by every other room of the extension and calling none of them (it includes base.h only).
 *
 * GIL contract: no Python object is touched here; any thread may call any of these with
 * or without the GIL.
 */
#include "base.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

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
    if (buf == NULL || len == 0)
        return;
#ifdef __APPLE__
    /* No explicit_bzero: memset through a volatile pointer, which the optimiser must keep. */
    void *(*volatile keep)(void *, int, size_t) = memset;
    keep(buf, 0, len);
#else
    explicit_bzero(buf, len);
#endif
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

/* ------------------------------------------------------------- portability */

int
rl_socket(int domain, int type, int protocol)
{
#ifdef SOCK_CLOEXEC
    return socket(domain, type | SOCK_CLOEXEC, protocol);
#else
    int fd = socket(domain, type, protocol);
    if (fd < 0)
        return -1;
    int failed = fcntl(fd, F_SETFD, FD_CLOEXEC) != 0;
#ifdef SO_NOSIGPIPE
    int one = 1;
    failed = failed || setsockopt(fd, SOL_SOCKET, SO_NOSIGPIPE, &one, sizeof(one)) != 0;
#endif
    if (failed) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
#endif
}

#if defined(__APPLE__)
#define RL_COND_CLOCK CLOCK_REALTIME /* no pthread_condattr_setclock */
#else
#define RL_COND_CLOCK CLOCK_MONOTONIC
#endif

int
rl_cond_init(pthread_cond_t *cond)
{
#if defined(__APPLE__)
    return pthread_cond_init(cond, NULL);
#else
    pthread_condattr_t attr;
    int rc = pthread_condattr_init(&attr);
    if (rc != 0)
        return rc;
    (void)pthread_condattr_setclock(&attr, RL_COND_CLOCK);
    rc = pthread_cond_init(cond, &attr);
    pthread_condattr_destroy(&attr);
    return rc;
#endif
}

void
rl_cond_deadline(struct timespec *until, double seconds)
{
    clock_gettime(RL_COND_CLOCK, until);
    long long ns = (long long)until->tv_nsec + (long long)(seconds * 1e9);
    until->tv_sec += (time_t)(ns / 1000000000LL);
    until->tv_nsec = (long)(ns % 1000000000LL);
}
