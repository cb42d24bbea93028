/*
 * native.h - the one private header of genai_ratelimit._native.
 *
 * Two error conventions that never mix:
 *   - code that runs without the GIL (conn.c, the I/O half of script.c) returns an
 *     rl_status and fills an rl_error; it never touches a Python object;
 *   - code that holds the GIL (module.c, the argument half of script.c) raises Python
 *     exceptions, and turns an rl_error into one in exactly one place, rl_raise().
 *
 * Lock order: release the GIL, then take a pool mutex. No thread ever waits for a pool
 * mutex while holding the GIL, and no pool mutex is held across socket I/O.
 */
#ifndef GENAI_RATELIMIT_NATIVE_H
#define GENAI_RATELIMIT_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stddef.h>
#include <sys/types.h>

#include <hiredis.h>
#include <openssl/ssl.h>

#define RL_MAX_WINDOWS 32            /* windows decided by one check */
#define RL_MEMBER_LEN 36             /* canonical UUID text, without the NUL */
#define RL_MAX_REPLY_BYTES 65536     /* a decision's reply is tiny: more is garbage */
#define RL_MAX_LIMIT 9007199254740991LL       /* 2^53 - 1: exact in Lua's doubles */
#define RL_MAX_WINDOW_SECONDS 3153600000LL    /* 100 years of 365 days */

/* ------------------------------------------------------------------ errors */

typedef enum {
    RL_OK = 0,
    RL_ERR_CONNECT,      /* no connection could be opened */
    RL_ERR_TIMEOUT,      /* a deadline passed before the server answered */
    RL_ERR_IO,           /* the connection broke in the middle of a call */
    RL_ERR_PROTOCOL,     /* the server sent something that is not a decision */
    RL_ERR_SERVER,       /* the server answered with an error reply */
    RL_ERR_AUTH,         /* authentication failed, or the server wants a password */
    RL_ERR_CLOSED,       /* the limiter was closed */
    RL_ERR_NOMEM,        /* malloc failed */
} rl_status;

typedef struct {
    rl_status kind;      /* what went wrong (RL_OK when nothing did) */
    int saved_errno;     /* errno right after the failing call, or 0 */
    char message[320];   /* for people; never contains a password */
} rl_error;

/* Fills err and returns kind. printf-style message. */
rl_status rl_error_set(rl_error *err, rl_status kind, int saved_errno, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* ------------------------------------------------------------- connections */

typedef struct {
    char *host;                  /* TCP host, or NULL for a unix socket */
    int port;                    /* TCP port */
    char *unix_path;             /* unix socket path, or NULL */
    long long db;                /* SELECT db when not 0 */
    char *username;              /* ACL user, or NULL */
    char *password;              /* AUTH password, or NULL; never printed */
    double connect_timeout;      /* seconds, for connect + AUTH + SELECT */
    double socket_timeout;       /* seconds, for one decision's round trip */
    int tls;                     /* rediss://: TLS on the TCP connection */
    int tls_verify;              /* verify the server's certificate and name */
    SSL_CTX *ssl_ctx;            /* shared by every connection of the pool, or NULL */
} rl_config;

typedef struct rl_conn {
    int fd;                      /* blocking socket with SO_RCVTIMEO/SO_SNDTIMEO set */
    SSL *ssl;                    /* TLS session on fd, or NULL for plain TCP/unix */
    redisReader *reader;         /* hiredis RESP parser fed with what we read */
    double armed_timeout;        /* SO_SNDTIMEO/SO_RCVTIMEO now set, -1 when mixed */
    struct rl_conn *next;        /* next idle connection in the pool */
} rl_conn;

typedef struct {
    pthread_mutex_t mutex;       /* guards every field below but config */
    pthread_cond_t available;    /* signalled when a connection is returned */
    rl_conn *idle;               /* stack of idle connections */
    int open;                    /* connections that exist (idle or in use) */
    int max_open;                /* bound on open */
    int closed;                  /* set by close(): no new connections */
    pid_t pid;                   /* process that owns these sockets */
    int initialized;             /* mutex and cond are initialised */
    rl_config config;            /* immutable after init */
} rl_pool;

int rl_config_init(rl_config *cfg, const char *host, int port, const char *unix_path,
                   long long db, const char *username, const char *password,
                   double connect_timeout, double socket_timeout);  /* 0 or -1 (ENOMEM) */
void rl_config_clear(rl_config *cfg);
/* Sets up TLS for the config: a client SSL_CTX with the CA file (or the system's CAs), an
   optional client certificate and key, and verification unless verify is 0. Returns
   RL_OK, or an error naming the file or the problem. */
rl_status rl_config_tls(rl_config *cfg, int verify, const char *ca_file, const char *cert_file,
                        const char *key_file, rl_error *err);

/* Pool; all of these run without the GIL, except rl_pool_init/rl_pool_after_fork. */
int rl_pool_init(rl_pool *pool, int max_open, pid_t pid);   /* 0, or -1 with errno */
void rl_pool_destroy(rl_pool *pool);
void rl_pool_close(rl_pool *pool);
void rl_pool_after_fork(rl_pool *pool, pid_t pid);
rl_status rl_pool_acquire(rl_pool *pool, rl_conn **out, rl_error *err);
void rl_pool_release(rl_pool *pool, rl_conn *conn, int reusable);
/* Closes every idle connection: after one broke, its siblings likely did too. */
void rl_pool_drop_idle(rl_pool *pool);
int rl_pool_open_count(rl_pool *pool);

/* A hiredis reader that refuses arrays longer than any reply we expect. NULL: no memory. */
redisReader *rl_reader_create(void);
const char *rl_reader_error(const redisReader *reader);   /* the reader's error, for people */
int rl_reader_idle(const redisReader *reader);            /* no unread bytes buffered */

/* Writes len bytes of commands and reads nreplies replies (each owned by the caller,
   freeReplyObject) before the deadline. On error the connection is out of step: discard it. */
rl_status rl_conn_roundtrip(rl_conn *conn, const char *buf, size_t len, int nreplies,
                            redisReply **replies, double timeout, rl_error *err);

/* ------------------------------------------------------------------ script */

typedef struct {
    int count;                              /* number of windows */
    long long limit[RL_MAX_WINDOWS];        /* shortest window first */
    long long seconds[RL_MAX_WINDOWS];
} rl_windows;

typedef struct {
    int allowed;                 /* 1 allow, 0 reject */
    long long remaining;
    long long retry_after_s;
    int window;                  /* 0-based index into rl_windows of the deciding window */
} rl_result;

/* Formats EVALSHA for one decision; returns its length and sets *out (redisFreeCommand),
   or -1 when out of memory. now_ms < 0 lets the script read the server's clock. */
long long rl_script_format(const char *prefix, size_t prefix_len, const char *user,
                           size_t user_len, const rl_windows *w, const char *member,
                           long long now_ms, char **out);

/* The command with the script's replay marker appended (malloc'd; NULL when out of memory
   or not a formatted command). A replay never counts a request its first attempt logged. */
char *rl_script_replay_command(const char *command, size_t command_len, size_t *out_len);

/* Runs one decision: EVALSHA, and on NOSCRIPT, SCRIPT LOAD + EVALSHA once more.
   No GIL needed; command is a formatted EVALSHA. */
rl_status rl_script_run(rl_pool *pool, const char *command, size_t command_len,
                        const rl_windows *w, rl_result *out, rl_error *err);

/* Decodes a script reply into a result, checked against the request's windows (an allow
   has 0 <= remaining < that window's limit and no retry; a reject has remaining 0 and a
   retry >= 1); PROTOCOL/SERVER errors otherwise. No GIL needed. */
rl_status rl_script_decode(const redisReply *reply, const rl_windows *w, rl_result *out,
                           rl_error *err);

/* The script's SHA1 hex and source, embedded from lua/sliding_window.lua at build time. */
extern const char rl_script_sha1_hex[];
const char *rl_script_source_text(size_t *len);

/* ----------------------------------------------------------- member, clock */

typedef struct rl_random rl_random;                  /* a page of kernel randomness */
rl_random *rl_random_new(void);                      /* NULL with errno on failure */
void rl_random_free(rl_random *page);
/* Bumped once per fork this process descends from (starts at 1). GIL held. */
unsigned long rl_fork_generation(rl_random *r);
/* Canonical lowercase UUID4 text. 0, or -1 with errno when getrandom failed. GIL held. */
int rl_member_uuid4(rl_random *page, char out[RL_MEMBER_LEN + 1]);
long long rl_clock_ms(void);                         /* unix time in milliseconds */
double rl_monotonic(void);                           /* seconds, for deadlines */

/* -------------------------------------------------------- module (GIL held) */

typedef struct {
    PyTypeObject *LimiterType;
    PyTypeObject *CodecType;
    PyTypeObject *RequestType;
    PyTypeObject *PipelineType;
    PyObject *Error;             /* RateLimiterError */
    PyObject *Unavailable;       /* RateLimiterUnavailable */
    PyObject *Timeout;           /* RateLimiterTimeout */
    PyObject *AuthError;         /* RateLimiterAuthError */
    int kill_switch_warned;      /* the kill-switch warning was logged */
    rl_random *random;           /* UUID4 randomness, wiped in a fork child */
    PyObject *str_done;          /* interned method names for resolving futures */
    PyObject *str_set_result;
    PyObject *str_set_exception;
} rl_module_state;

/* Raises the Python exception for err. Always returns NULL. */
PyObject *rl_raise(rl_module_state *state, const rl_error *err);
/* The exception instance for err (a new reference), or NULL with an exception set. */
PyObject *rl_exception(rl_module_state *state, const rl_error *err);

/* One decision, prepared with the GIL held (args.c). */
typedef struct {
    rl_windows windows;          /* validated, shortest first */
    int disabled;                /* the kill switch answered: result is final, no I/O */
    rl_result result;            /* the kill switch's answer when disabled */
    char *command;               /* formatted EVALSHA (redisFreeCommand), NULL when disabled */
    long long command_len;
} rl_prepared;

int rl_windows_from_pair(rl_windows *w, PyObject *limit, PyObject *seconds);   /* 0 / -1 */
int rl_windows_from_sequence(rl_windows *w, PyObject *windows);               /* 0 / -1 */
/* Borrowed UTF-8 of a non-empty str user id, or NULL with an exception. */
const char *rl_user_id_utf8(PyObject *user_id, Py_ssize_t *len);
/* Validates user_id, applies the kill switch, makes the member, formats the command.
   out->windows must be filled first. Returns 0, or -1 with an exception set. */
int rl_prepare(rl_module_state *state, const char *prefix, size_t prefix_len, int client_clock,
               PyObject *user_id, rl_prepared *out);
void rl_prepared_clear(rl_prepared *p);
/* (allowed, remaining, retry_after_s[, window_seconds]). Returns a new reference. */
PyObject *rl_result_tuple(const rl_windows *w, const rl_result *r, int with_window);
/* Vectorcall argument matching; out[] receives borrowed references. 0 / -1. */
int rl_parse_args(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                  const char *const *names, int n, PyObject **out);

#endif
