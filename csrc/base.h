/*
 * base.h - the ground floor of genai_ratelimit._native: what every other room uses and
 * nothing it needs from them. Errors (rl_status, rl_error), the wipe of secrets, the
 * clocks, and the few calls whose spelling differs between Linux and macOS (portability). base.c includes this header only, so it cannot call up a floor; native.h
 * includes it for everyone else.
 *
 * GIL contract: nothing here touches a Python object; every function may run with or
 * without the GIL, from any thread.
 */
#ifndef GENAI_RATELIMIT_BASE_H
#define GENAI_RATELIMIT_BASE_H

#include <pthread.h>
#include <stddef.h>
#include <time.h>

/* ------------------------------------------------------------------ errors */

typedef enum {
    RL_OK = 0,
    RL_ERR_CONNECT,     /* no connection could be opened */
    RL_ERR_TIMEOUT,     /* a deadline passed before the server answered */
    RL_ERR_IO,          /* the connection broke in the middle of a call */
    RL_ERR_PROTOCOL,    /* the server sent something that is not a decision */
    RL_ERR_SERVER,      /* the server answered with an error reply */
    RL_ERR_AUTH,        /* authentication failed, or the server wants a password */
    RL_ERR_CLOSED,      /* the limiter was closed */
    RL_ERR_NOMEM,       /* malloc failed */
    RL_ERR_INTERRUPTED, /* a signal interrupted blocking I/O: check signals, then resume */
    RL_ERR_REDIRECT,    /* a cluster answer: MOVED, ASK, TRYAGAIN or CLUSTERDOWN; the
                           message is the server's text (nothing ran) */
} rl_status;

typedef struct {
    rl_status kind;    /* what went wrong (RL_OK when nothing did) */
    char message[320]; /* for people; never contains a password */
} rl_error;

/* Fills err and returns kind. printf-style message. */
rl_status rl_error_set(rl_error *err, rl_status kind, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ------------------------------------------------------------------ secrets */

/* Wipes memory that held a secret, in a way the optimiser keeps (explicit_bzero). */
void rl_wipe(void *buf, size_t len);

/* Called right before a buffer that may have held a secret is freed, with the extent of
   it ever written. Debug and sanitized builds (RL_DEBUG_HOOKS) abort, naming `what`, when
   RL_WIPE_CANARY is still in it: a password holding the canary (the tests' own) shows
   every wipe that was left out. Release builds: nothing. */
#ifdef RL_DEBUG_HOOKS
#define RL_WIPE_CANARY "genai-ratelimit-wipe-canary"
void rl_check_wiped(const void *buf, size_t len, const char *what);
#else
#define rl_check_wiped(buf, len, what) ((void)0)
#endif

/* ------------------------------------------------------------------- clocks */

long long rl_clock_ms(void); /* unix time in milliseconds */
double rl_monotonic(void);   /* seconds, for deadlines */

/* ------------------------------------------------------------- portability */

/* Linux spells these in one call; macOS (no SOCK_CLOEXEC, MSG_NOSIGNAL or
   pthread_condattr_setclock) needs a second one. Nothing else in the extension names them. */

/* A socket closed on exec that never raises SIGPIPE (a peer that went away is an EPIPE the
   caller sees): -1 with errno on failure. */
int rl_socket(int domain, int type, int protocol);

/* The flags of send() on such a socket: MSG_NOSIGNAL where it exists, 0 where the socket
   itself says so (SO_NOSIGPIPE). */
#ifdef MSG_NOSIGNAL
#define RL_SEND_FLAGS MSG_NOSIGNAL
#else
#define RL_SEND_FLAGS 0
#endif

/* pthread_cond_init of a condition variable that pthread_cond_timedwait times on the clock
   rl_cond_deadline reads: the monotonic clock where the platform lets one choose, the
   real-time clock otherwise. 0, or the pthread error. */
int rl_cond_init(pthread_cond_t *cond);

/* The absolute time, on that clock, `seconds` from now, for pthread_cond_timedwait. */
void rl_cond_deadline(struct timespec *until, double seconds);

#endif
