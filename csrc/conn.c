/*
 * conn.c - connections to Redis and the pool that shares them between threads.
 *
 * TLS (rediss://) is OpenSSL on the same blocking socket: SSL_read/SSL_write honour the
 * socket timeouts, and a handshake failure names the certificate problem. The handshake
 * alone runs non-blocking, SSL_connect resumed on poll() until the connection's deadline
 * (tls_connect_until: a signal resumes it, a trickling server cannot stretch it).
 *
 * GIL contract: nothing in this file touches a Python object, and every function but
 * rl_pool_init / rl_pool_after_fork is called with the GIL released. Errors are
 * reported as an rl_status plus an rl_error (native.h), never as Python exceptions.
 *
 * Lock contract: pool->mutex guards the pool's bookkeeping only; it is never held
 * across connect() or socket I/O, and it is taken only after the GIL was released.
 *
 * This file is the blocking driver of the protocol engine (proto.c): it only moves bytes.
 * What to send, how to judge a reply, NOSCRIPT and the replay rule live in the engine,
 * shared with the asyncio path.
 *
 * I/O: sockets are blocking with SO_SNDTIMEO/SO_RCVTIMEO, so one decision costs one
 * write() and (usually) one read(). A deadline bounds the whole call: before every
 * syscall the armed timeouts are lowered to what is left of it when they would overshoot
 * it (no syscall in the usual case), and a timeout that fires early just loops. A signal
 * (EINTR) ends the syscall with RL_ERR_INTERRUPTED: the caller runs Python's signal
 * handlers with the GIL (PEP 475) and resumes the same call, or abandons it. Any other
 * error makes a connection unusable: it is closed, never read again, and the next call
 * opens a new one.
 */
#include "native.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/x509v3.h>

/* ------------------------------------------------------------------ config */

static int
dup_or_null(char **dst, const char *src)
{
    *dst = NULL;
    if (src == NULL)
        return 0;
    *dst = strdup(src);
    return *dst == NULL ? -1 : 0;
}

int
rl_config_init(rl_config *cfg, const char *host, int port, const char *unix_path, long long db,
               const char *username, const char *password, double connect_timeout,
               double socket_timeout)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->port = port;
    cfg->db = db;
    cfg->connect_timeout = connect_timeout;
    cfg->socket_timeout = socket_timeout;
    if (dup_or_null(&cfg->host, host) < 0 || dup_or_null(&cfg->unix_path, unix_path) < 0 ||
        dup_or_null(&cfg->username, username) < 0 || dup_or_null(&cfg->password, password) < 0) {
        rl_config_clear(cfg);
        return -1;
    }
    return 0;
}

void
rl_config_clear(rl_config *cfg)
{
    free(cfg->host);
    free(cfg->unix_path);
    free(cfg->username);
    if (cfg->ssl_ctx != NULL)
        SSL_CTX_free(cfg->ssl_ctx);
    if (cfg->password != NULL) {
        /* Do not leave the secret lying in freed memory. */
        size_t len = strlen(cfg->password);
        rl_wipe(cfg->password, len);
        rl_check_wiped(cfg->password, len, "a copy of the password");
        free(cfg->password);
    }
    memset(cfg, 0, sizeof(*cfg));
}

/* The newest OpenSSL error as text, and the queue cleared. */
static const char *
ssl_error_text(char *buf, size_t len)
{
    unsigned long code = ERR_get_error();
    if (code == 0)
        snprintf(buf, len, "no detail from OpenSSL");
    else
        ERR_error_string_n(code, buf, len);
    ERR_clear_error();
    return buf;
}

rl_status
rl_config_tls(rl_config *cfg, int verify, const char *ca_file, const char *cert_file,
              const char *key_file, rl_error *err)
{
    char detail[200];
    SSL_CTX *ctx = SSL_CTX_new(TLS_client_method());
    if (ctx == NULL)
        return rl_error_set(err, RL_ERR_NOMEM, "cannot create a TLS context: %s",
                            ssl_error_text(detail, sizeof(detail)));
    SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
    /* Our sockets block with timeouts: let OpenSSL retry internal renegotiation reads. */
    SSL_CTX_set_mode(ctx, SSL_MODE_AUTO_RETRY);
    if (verify) {
        SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
        int loaded = ca_file != NULL ? SSL_CTX_load_verify_locations(ctx, ca_file, NULL)
                                     : SSL_CTX_set_default_verify_paths(ctx);
        if (loaded != 1) {
            SSL_CTX_free(ctx);
            return rl_error_set(err, RL_ERR_CONNECT, "cannot load CA certificates from %s: %s",
                                ca_file ? ca_file : "the system's default locations",
                                ssl_error_text(detail, sizeof(detail)));
        }
    } else {
        SSL_CTX_set_verify(ctx, SSL_VERIFY_NONE, NULL);
    }
    if (cert_file != NULL && SSL_CTX_use_certificate_chain_file(ctx, cert_file) != 1) {
        SSL_CTX_free(ctx);
        return rl_error_set(err, RL_ERR_CONNECT, "cannot load the client certificate %s: %s",
                            cert_file, ssl_error_text(detail, sizeof(detail)));
    }
    if (key_file != NULL || cert_file != NULL) {
        const char *key = key_file != NULL ? key_file : cert_file;
        if (SSL_CTX_use_PrivateKey_file(ctx, key, SSL_FILETYPE_PEM) != 1 ||
            SSL_CTX_check_private_key(ctx) != 1) {
            SSL_CTX_free(ctx);
            return rl_error_set(err, RL_ERR_CONNECT, "cannot load the client key %s: %s", key,
                                ssl_error_text(detail, sizeof(detail)));
        }
    }
    cfg->tls = 1;
    cfg->tls_verify = verify;
    cfg->ssl_ctx = ctx;
    return RL_OK;
}

static struct timeval
timeval_from(double seconds)
{
    struct timeval tv;
    if (seconds < 0.001)
        seconds = 0.001; /* 0 would mean "no timeout" to the kernel */
    tv.tv_sec = (time_t)seconds;
    tv.tv_usec = (suseconds_t)((seconds - (double)tv.tv_sec) * 1e6);
    return tv;
}

static int
set_io_timeout(int fd, int option, double seconds)
{
    struct timeval tv = timeval_from(seconds);
    return setsockopt(fd, SOL_SOCKET, option, &tv, sizeof(tv));
}

/* ---------------------------------------------------------------- resolver */

/* getaddrinfo() has no timeout: a resolver that does not answer would hold a call for
   (timeout x attempts) of resolv.conf, far past connect_timeout. A name that is not a
   numeric address is resolved on a short-lived thread of its own while the caller waits
   no longer than the deadline; a lookup that outlives it finishes on its thread, which
   frees what it found (the last of the two to let go frees the lookup). */
typedef struct {
    pthread_mutex_t mutex;
    pthread_cond_t done_cond;
    int refs;              /* 2 while both the caller and the thread hold it */
    int done;              /* the lookup finished: rc, list */
    int rc;                /* getaddrinfo's result */
    int saved_errno;       /* errno after it, for EAI_SYSTEM */
    struct addrinfo *list; /* its addresses, until the caller takes them */
    char port[16];
    char host[]; /* NUL-terminated */
} rl_lookup;

static const struct addrinfo rl_hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};

static void
lookup_release(rl_lookup *lookup)
{
    pthread_mutex_lock(&lookup->mutex);
    int last = --lookup->refs == 0;
    pthread_mutex_unlock(&lookup->mutex);
    if (!last)
        return;
    if (lookup->list != NULL)
        freeaddrinfo(lookup->list);
    pthread_cond_destroy(&lookup->done_cond);
    pthread_mutex_destroy(&lookup->mutex);
    free(lookup);
}

static void *
lookup_main(void *arg)
{
    rl_lookup *lookup = arg;
    struct addrinfo *list = NULL;
    int rc = getaddrinfo(lookup->host, lookup->port, &rl_hints, &list);
    int saved = errno;
    pthread_mutex_lock(&lookup->mutex);
    lookup->rc = rc;
    lookup->saved_errno = saved;
    lookup->list = list;
    lookup->done = 1;
    pthread_cond_signal(&lookup->done_cond);
    pthread_mutex_unlock(&lookup->mutex);
    lookup_release(lookup);
    return NULL;
}

static rl_status
resolve(const char *host, int port, double deadline, struct addrinfo **out, const char *where,
        rl_error *err)
{
    struct addrinfo numeric = rl_hints;
    char port_text[16];
    int rc;
    *out = NULL;
    snprintf(port_text, sizeof(port_text), "%d", port);
    numeric.ai_flags = AI_NUMERICHOST;
    rc = getaddrinfo(host, port_text, &numeric, out); /* an address: no lookup at all */
    if (rc == 0)
        return RL_OK;

    size_t host_len = strlen(host);
    rl_lookup *lookup = calloc(1, sizeof(*lookup) + host_len + 1);
    pthread_attr_t thread_attr;
    pthread_t thread;
    if (lookup == NULL)
        return rl_error_set(err, RL_ERR_NOMEM, "out of memory resolving %s", where);
    memcpy(lookup->host, host, host_len + 1);
    memcpy(lookup->port, port_text, sizeof(port_text));
    lookup->refs = 2;
    pthread_mutex_init(&lookup->mutex, NULL);
    (void)rl_cond_init(&lookup->done_cond);
    pthread_attr_init(&thread_attr);
    pthread_attr_setdetachstate(&thread_attr, PTHREAD_CREATE_DETACHED);
    rc = pthread_create(&thread, &thread_attr, lookup_main, lookup);
    pthread_attr_destroy(&thread_attr);
    if (rc != 0) {
        lookup->refs = 1;
        lookup_release(lookup);
        return rl_error_set(err, RL_ERR_CONNECT, "cannot start resolving %s: %s", where,
                            strerror(rc));
    }

    pthread_mutex_lock(&lookup->mutex);
    while (!lookup->done) {
        double left = deadline - rl_monotonic();
        if (left <= 0)
            break;
        struct timespec until;
        rl_cond_deadline(&until, left);
        (void)pthread_cond_timedwait(&lookup->done_cond, &lookup->mutex, &until);
    }
    int done = lookup->done;
    rc = lookup->rc;
    int saved = lookup->saved_errno;
    if (done) {
        *out = lookup->list; /* ours now */
        lookup->list = NULL;
    }
    pthread_mutex_unlock(&lookup->mutex);
    lookup_release(lookup);
    if (!done)
        return rl_error_set(err, RL_ERR_TIMEOUT, "timed out resolving the Redis host %s", where);
    if (rc != 0)
        return rl_error_set(err, RL_ERR_CONNECT, "cannot resolve Redis host %s: %s", where,
                            rc == EAI_SYSTEM ? strerror(saved) : gai_strerror(rc));
    return RL_OK;
}

/* ------------------------------------------------------------- connection */

static void
conn_free(rl_conn *conn)
{
    if (conn == NULL)
        return;
    if (conn->ssl != NULL)
        SSL_free(conn->ssl); /* no close_notify: the socket may be broken or a parent's */
    if (conn->fd >= 0)
        close(conn->fd);
    rl_proto_clear(&conn->proto);
    free(conn);
}

static rl_status
connect_fd(int fd, const struct sockaddr *addr, socklen_t addrlen, double deadline,
           const char *where, rl_error *err)
{
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)
        return rl_error_set(err, RL_ERR_CONNECT, "cannot configure a socket: %s", strerror(errno));
    if (connect(fd, addr, addrlen) < 0) {
        if (errno != EINPROGRESS)
            return rl_error_set(err, RL_ERR_CONNECT, "cannot connect to Redis at %s: %s", where,
                                strerror(errno));
        for (;;) {
            struct pollfd pfd = {.fd = fd, .events = POLLOUT};
            double left = deadline - rl_monotonic();
            if (left <= 0)
                return rl_error_set(err, RL_ERR_TIMEOUT, "timed out connecting to Redis at %s",
                                    where);
            int rc = poll(&pfd, 1, (int)(left * 1000.0) + 1);
            if (rc < 0 && errno == EINTR)
                continue;
            if (rc < 0)
                return rl_error_set(err, RL_ERR_CONNECT, "cannot connect to Redis at %s: %s", where,
                                    strerror(errno));
            if (rc == 0)
                continue; /* the deadline check above ends the loop */
            int soerr = 0;
            socklen_t len = sizeof(soerr);
            if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) < 0)
                soerr = errno;
            if (soerr != 0)
                return rl_error_set(err, RL_ERR_CONNECT, "cannot connect to Redis at %s: %s", where,
                                    strerror(soerr));
            break;
        }
    }
    if (fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) < 0)
        return rl_error_set(err, RL_ERR_CONNECT, "cannot configure a socket: %s", strerror(errno));
    return RL_OK;
}

static rl_status
open_socket(const rl_config *cfg, double deadline, int *out_fd, rl_error *err)
{
    char where[300];
    *out_fd = -1;
    if (cfg->unix_path != NULL) {
        struct sockaddr_un sa;
        snprintf(where, sizeof(where), "unix:%s", cfg->unix_path);
        if (strlen(cfg->unix_path) >= sizeof(sa.sun_path))
            return rl_error_set(err, RL_ERR_CONNECT,
                                "the unix socket path is too long (%zu bytes, at most %zu)",
                                strlen(cfg->unix_path), sizeof(sa.sun_path) - 1);
        memset(&sa, 0, sizeof(sa));
        sa.sun_family = AF_UNIX;
        memcpy(sa.sun_path, cfg->unix_path, strlen(cfg->unix_path) + 1);
        int fd = rl_socket(AF_UNIX, SOCK_STREAM, 0);
        if (fd < 0)
            return rl_error_set(err, RL_ERR_CONNECT, "cannot create a socket: %s", strerror(errno));
        rl_status st = connect_fd(fd, (struct sockaddr *)&sa, sizeof(sa), deadline, where, err);
        if (st != RL_OK) {
            close(fd);
            return st;
        }
        *out_fd = fd;
        return RL_OK;
    }

    struct addrinfo *list = NULL;
    snprintf(where, sizeof(where), strchr(cfg->host, ':') ? "[%s]:%d" : "%s:%d", cfg->host,
             cfg->port);
    rl_status st = resolve(cfg->host, cfg->port, deadline, &list, where, err);
    if (st != RL_OK)
        return st;
    st = rl_error_set(err, RL_ERR_CONNECT, "no address for Redis host %s", where);
    for (struct addrinfo *ai = list; ai != NULL; ai = ai->ai_next) {
        int fd = rl_socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
        if (fd < 0) {
            st = rl_error_set(err, RL_ERR_CONNECT, "cannot create a socket: %s", strerror(errno));
            continue;
        }
        st = connect_fd(fd, ai->ai_addr, ai->ai_addrlen, deadline, where, err);
        if (st == RL_OK) {
            int one = 1;
            /* A decision is one small write and one small read: never wait for Nagle. */
            (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
            (void)setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
            *out_fd = fd;
            break;
        }
        close(fd);
        if (st == RL_ERR_TIMEOUT)
            break;
    }
    freeaddrinfo(list);
    return st;
}

/* Sockets time out a syscall after SO_SNDTIMEO/SO_RCVTIMEO. They stay armed from one call
   to the next; they are re-armed only when what is armed and what is left of the deadline
   differ by more than this (a slow or interrupted call, or the first call after one). */
#define RL_TIMEOUT_SLACK 0.002

static rl_status
io_error(int saved, const char *what, rl_error *err)
{
    if (saved == EAGAIN || saved == EWOULDBLOCK || saved == ETIMEDOUT)
        return rl_error_set(err, RL_ERR_TIMEOUT, "timed out %s Redis", what);
    return rl_error_set(err, RL_ERR_IO, "connection to Redis lost while %s it: %s", what,
                        strerror(saved));
}

/* Arms the socket's timeouts to what is left of the deadline, unless they already hold
   about that. RL_ERR_TIMEOUT when the deadline has passed. */
static rl_status
arm_for(rl_conn *conn, double deadline, const char *what, rl_error *err)
{
    double left = deadline - rl_monotonic();
    if (left <= 0)
        return rl_error_set(err, RL_ERR_TIMEOUT, "timed out %s Redis", what);
    if (conn->armed_timeout > 0 && conn->armed_timeout - left <= RL_TIMEOUT_SLACK &&
        left - conn->armed_timeout <= RL_TIMEOUT_SLACK)
        return RL_OK;
    if (set_io_timeout(conn->fd, SO_SNDTIMEO, left) < 0 ||
        set_io_timeout(conn->fd, SO_RCVTIMEO, left) < 0) {
        conn->armed_timeout = 0;
        return io_error(errno, "configuring the socket for", err);
    }
    conn->armed_timeout = left;
    return RL_OK;
}

/* After a failed SSL_read/SSL_write: 0 for a clean or abrupt EOF, else -1 with errno
   (EAGAIN when the socket timeout expired, EINTR for a signal, EPROTO for a TLS failure).
   A call resumed after EINTR retries SSL_read/SSL_write with the same bytes, as OpenSSL
   asks: the engine's output is consumed only by what a write reported written. */
static ssize_t
ssl_failure(rl_conn *conn, int rc)
{
    int saved = errno;
    switch (SSL_get_error(conn->ssl, rc)) {
    case SSL_ERROR_ZERO_RETURN:
        return 0;
    case SSL_ERROR_WANT_READ:
    case SSL_ERROR_WANT_WRITE:
        /* The socket BIO retries on EINTR as on EAGAIN: a signal stays a signal here, so
           that the caller runs Python's handlers (PEP 475) as it does over TCP. */
        errno = saved == EINTR ? EINTR : EAGAIN;
        return -1;
    case SSL_ERROR_SYSCALL:
        ERR_clear_error();
        if (saved == 0)
            return 0;
        errno = saved;
        return -1;
    default:
        ERR_clear_error();
        errno = EPROTO;
        return -1;
    }
}

static ssize_t
conn_write(rl_conn *conn, const char *buf, size_t len)
{
    if (conn->ssl == NULL)
        return send(conn->fd, buf, len, RL_SEND_FLAGS);
    ERR_clear_error();
    int n = SSL_write(conn->ssl, buf, len > 1048576 ? 1048576 : (int)len);
    return n > 0 ? n : ssl_failure(conn, n);
}

static ssize_t
conn_read(rl_conn *conn, char *buf, size_t len)
{
    if (conn->ssl == NULL)
        return recv(conn->fd, buf, len, 0);
    ERR_clear_error();
    int n = SSL_read(conn->ssl, buf, (int)len);
    return n > 0 ? n : ssl_failure(conn, n);
}

/* A failed send/recv: keep going (a socket timeout that fired before the deadline, after
   a re-arm), RL_ERR_INTERRUPTED (a signal), or the error. Returns RL_OK to keep going. */
static rl_status
syscall_failed(rl_conn *conn, double deadline, const char *what, rl_error *err)
{
    int saved = errno;
    if (saved == EINTR)
        return rl_error_set(err, RL_ERR_INTERRUPTED, "interrupted %s Redis", what);
    if ((saved == EAGAIN || saved == EWOULDBLOCK) && rl_monotonic() < deadline) {
        conn->armed_timeout = 0; /* woke early: arm what is left */
        return RL_OK;
    }
    return io_error(saved, what, err);
}

/* Moves bytes until the request `token` completes: writes what the engine queued, reads
   and feeds what arrives, all before the deadline. RL_OK with *ev filled (the request's
   own status is in ev); RL_ERR_INTERRUPTED when a signal interrupted a syscall (call
   again to resume: nothing is lost); any other status leaves the connection out of step:
   discard it. */
static rl_status
conn_exchange(rl_conn *conn, const void *token, const void *also, double deadline, rl_event *ev,
              rl_error *err)
{
    char chunk[16384];
    rl_status st;
    for (;;) {
        size_t len;
        const char *out = rl_proto_output(&conn->proto, &len);
        while (len > 0) {
            if ((st = arm_for(conn, deadline, "writing to", err)) != RL_OK)
                return st;
            ssize_t n = conn_write(conn, out, len);
            if (n < 0) {
                if ((st = syscall_failed(conn, deadline, "writing to", err)) != RL_OK)
                    return st;
                continue;
            }
            rl_proto_consume(&conn->proto, (size_t)n);
            out = rl_proto_output(&conn->proto, &len);
        }
        int got = rl_proto_next(&conn->proto, ev, err);
        if (got < 0)
            return err->kind;
        if (got > 0) {
            if (ev->entry.token == token || (also != NULL && ev->entry.token == also))
                return RL_OK;
            if (ev->fatal) {
                /* A handshake step before the last failed: the connection is done. */
                *err = ev->error;
                return ev->status;
            }
            if (ev->entry.token == NULL && ev->entry.step == RL_STEP_COMMAND) {
                /* A prefix nobody waits for (ASKING before a decision): a refusal shows in
                   the reply of the command it prefixed. */
                if (ev->reply != NULL)
                    freeReplyObject(ev->reply);
                continue;
            }
            /* One request at a time per blocking connection: this cannot be ours. */
            if (ev->reply != NULL)
                freeReplyObject(ev->reply);
            return rl_error_set(err, RL_ERR_PROTOCOL, "Redis answered a request of another call");
        }
        (void)rl_proto_output(&conn->proto, &len);
        if (len > 0)
            continue; /* the engine queued more (a NOSCRIPT reload): write it first */
        if ((st = arm_for(conn, deadline, "reading from", err)) != RL_OK)
            return st;
        ssize_t n = conn_read(conn, chunk, sizeof(chunk));
        if (n < 0) {
            if ((st = syscall_failed(conn, deadline, "reading from", err)) != RL_OK)
                return st;
            continue;
        }
        if (n == 0)
            return rl_error_set(err, RL_ERR_IO, "Redis closed the connection before replying");
        if ((st = rl_proto_feed(&conn->proto, chunk, (size_t)n, err)) != RL_OK)
            return st;
    }
}

/* poll()'s timeout for what is left of a deadline: rounded up (a wake-up just before the
   deadline would only poll again), capped far below INT_MAX milliseconds. */
static int
poll_ms(double left)
{
    if (left >= 1e6)
        return 1000000000;
    return (int)(left * 1000.0) + 1;
}

/* The error of a TLS handshake that SSL_connect ended (code: SSL_get_error's, saved: errno
   after SSL_connect). */
static rl_status
tls_handshake_failed(rl_conn *conn, const rl_config *cfg, int code, int saved, rl_error *err)
{
    char detail[200];
    long verify = SSL_get_verify_result(conn->ssl);
    if (verify != X509_V_OK)
        return rl_error_set(err, RL_ERR_CONNECT,
                            "TLS handshake with Redis at %s:%d failed: certificate verify failed "
                            "(%s)",
                            cfg->host, cfg->port, X509_verify_cert_error_string(verify));
    if (code == SSL_ERROR_SYSCALL && ERR_peek_error() == 0)
        return rl_error_set(err, RL_ERR_CONNECT, "TLS handshake with Redis at %s:%d failed: %s",
                            cfg->host, cfg->port,
                            saved ? strerror(saved)
                                  : "the server closed the connection "
                                    "(is it a TLS port?)");
    return rl_error_set(err, RL_ERR_CONNECT, "TLS handshake with Redis at %s:%d failed: %s",
                        cfg->host, cfg->port, ssl_error_text(detail, sizeof(detail)));
}

/* SSL_connect on the socket made non-blocking for it, resumed each time the socket is
   ready in the direction OpenSSL asked for (WANT_READ: readable, WANT_WRITE: writable),
   until the deadline. A blocking SSL_connect would give each of its reads a whole socket
   timeout (a server that trickles its records stretches the handshake far past the
   deadline), and would end at a signal: the socket BIO takes the EINTR of a read for "try
   again", so SSL_connect said WANT_READ and a signal read as a timeout. Here a signal only
   resumes the handshake, as it resumes the rest of the connection's set-up (conn_open).
   No bytes can wait inside OpenSSL while it asks for more: without read-ahead it reads a
   record's header, then that record's body, and asks only when what it holds is short. */
static rl_status
tls_connect_until(rl_conn *conn, const rl_config *cfg, double deadline, rl_error *err)
{
    for (;;) {
        ERR_clear_error();
        errno = 0;
        int rc = SSL_connect(conn->ssl);
        if (rc == 1)
            return RL_OK;
        int saved = errno, code = SSL_get_error(conn->ssl, rc);
        struct pollfd pfd = {.fd = conn->fd};
        if (code == SSL_ERROR_WANT_READ)
            pfd.events = POLLIN;
        else if (code == SSL_ERROR_WANT_WRITE)
            pfd.events = POLLOUT;
        else
            return tls_handshake_failed(conn, cfg, code, saved, err);
        for (;;) {
            double left = deadline - rl_monotonic();
            if (left <= 0)
                return rl_error_set(err, RL_ERR_TIMEOUT,
                                    "timed out in the TLS handshake with Redis at %s:%d", cfg->host,
                                    cfg->port);
            int ready = poll(&pfd, 1, poll_ms(left));
            if (ready > 0)
                break; /* readable, writable, hung up or failed: SSL_connect finds out which */
            if (ready < 0 && errno != EINTR)
                return rl_error_set(err, RL_ERR_CONNECT,
                                    "TLS handshake with Redis at %s:%d failed: %s", cfg->host,
                                    cfg->port, strerror(errno));
            /* a signal, or the time ran out: the deadline check above decides */
        }
    }
}

static rl_status
tls_handshake(rl_conn *conn, const rl_config *cfg, double deadline, rl_error *err)
{
    char detail[200];
    unsigned char ip[sizeof(struct in6_addr)];
    int is_ip = inet_pton(AF_INET, cfg->host, ip) == 1 || inet_pton(AF_INET6, cfg->host, ip) == 1;
    ERR_clear_error();
    conn->ssl = SSL_new(cfg->ssl_ctx);
    if (conn->ssl == NULL || SSL_set_fd(conn->ssl, conn->fd) != 1)
        return rl_error_set(err, RL_ERR_NOMEM, "cannot start TLS: %s",
                            ssl_error_text(detail, sizeof(detail)));
    if (!is_ip)
        (void)SSL_set_tlsext_host_name(conn->ssl, cfg->host); /* SNI */
    if (cfg->tls_verify) {
        int named = is_ip ? X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(conn->ssl), cfg->host)
                          : SSL_set1_host(conn->ssl, cfg->host);
        if (named != 1)
            return rl_error_set(err, RL_ERR_CONNECT, "cannot set the TLS peer name %s: %s",
                                cfg->host, ssl_error_text(detail, sizeof(detail)));
    }
    /* Non-blocking for the handshake only: every later call blocks with socket timeouts. */
    int flags = fcntl(conn->fd, F_GETFL);
    if (flags < 0 || fcntl(conn->fd, F_SETFL, flags | O_NONBLOCK) < 0)
        return rl_error_set(err, RL_ERR_CONNECT, "cannot configure a socket: %s", strerror(errno));
    rl_status st = tls_connect_until(conn, cfg, deadline, err);
    if (fcntl(conn->fd, F_SETFL, flags & ~O_NONBLOCK) < 0 && st == RL_OK)
        st = rl_error_set(err, RL_ERR_CONNECT, "cannot configure a socket: %s", strerror(errno));
    return st;
}

/* Opens a connection and runs the engine's handshake on it, within connect_timeout. */
static rl_status
conn_open(const rl_config *cfg, rl_conn **out, rl_error *err)
{
    double deadline = rl_monotonic() + cfg->connect_timeout;
    rl_handshake h = {cfg->username, cfg->password, cfg->db, cfg->tls};
    rl_event ev;
    rl_status st;
    rl_conn *conn = calloc(1, sizeof(*conn));
    *out = NULL;
    if (conn == NULL)
        return rl_error_set(err, RL_ERR_NOMEM, "out of memory opening a connection");
    conn->fd = -1;
    if (rl_proto_init(&conn->proto) < 0) {
        st = rl_error_set(err, RL_ERR_NOMEM, "out of memory opening a connection");
        goto error;
    }
    st = open_socket(cfg, deadline, &conn->fd, err);
    if (st != RL_OK)
        goto error;
    if (cfg->tls && (st = tls_handshake(conn, cfg, deadline, err)) != RL_OK)
        goto error;
    int steps = rl_proto_handshake(&conn->proto, &h, deadline, conn, err);
    if (steps < 0) {
        st = err->kind;
        goto error;
    }
    if (steps > 0) {
        /* A signal here just resumes: connect_timeout still bounds the handshake. */
        do
            st = conn_exchange(conn, conn, NULL, deadline, &ev, err);
        while (st == RL_ERR_INTERRUPTED);
        if (st == RL_OK && ev.status != RL_OK) {
            *err = ev.error;
            st = ev.status;
        }
        if (st != RL_OK)
            goto error;
    }
    *out = conn;
    return RL_OK;

error:
    conn_free(conn);
    return st;
}

/* A pooled connection that the server closed (restart, idle timeout, kill), or on which
   bytes arrived that nobody asked for, shows up as readable while idle. One poll() per
   call (about a microsecond) keeps such bytes from ever being read as our reply. */
static int
conn_is_stale(const rl_conn *conn)
{
    if (conn->ssl != NULL && SSL_pending(conn->ssl) > 0)
        return 1; /* decrypted bytes nobody asked for */
    return rl_proto_idle_is_stale(&conn->proto, conn->fd);
}

/* ------------------------------------------------------------------- calls */

void
rl_call_init(rl_call *call, rl_pool *pool, rl_prepared *decision)
{
    memset(call, 0, sizeof(*call));
    call->pool = pool;
    call->decision = decision;
    /* One deadline for the whole call: the wait for a pooled connection, the round trip,
       a NOSCRIPT reload, a replay and any signal all draw on it. Opening a connection has
       a budget of its own (connect_timeout), added to it when one had to be opened. */
    call->deadline = rl_monotonic() + pool->config.socket_timeout;
}

/* The decisions that admit a request (and log it) when they allow. */
static int
is_admission(rl_shape shape)
{
    return shape == RL_SHAPE_CHECK || shape == RL_SHAPE_WINDOWS || shape == RL_SHAPE_DETAILED ||
           shape == RL_SHAPE_RESERVE || shape == RL_SHAPE_ACQUIRE || shape == RL_SHAPE_GCRA ||
           shape == RL_SHAPE_BUDGET_HOLD;
}

/* min_replicas: queues the engine's WAIT on conn (rl_proto_push_wait) behind the decision
   queued first, so both go out in one write: no round trip of its own. */
static rl_status
queue_wait(rl_conn *conn, const rl_config *cfg, double deadline, const void *token, rl_error *err)
{
    return rl_proto_push_wait(&conn->proto, cfg->min_replicas, cfg->replica_timeout_ms, deadline,
                              (void *)token, err);
}

/* Reads the reply of the WAIT queued with token: the engine's judgement of it, or of its
   absence (rl_proto_wait_failed), or the exchange's error. *in_step: the connection can be
   reused. */
static rl_status
read_wait(rl_conn *conn, const rl_config *cfg, const void *token, double deadline, int *in_step,
          rl_error *err)
{
    rl_event ev;
    rl_status st;
    *in_step = 0;
    deadline += (double)cfg->replica_timeout_ms / 1000.0; /* WAIT's own time on top */
    do
        st = conn_exchange(conn, token, NULL, deadline, &ev, err);
    while (st == RL_ERR_INTERRUPTED); /* the deadline still bounds it */
    if (st != RL_OK)
        return rl_proto_wait_failed(st, err);
    *in_step = !ev.fatal;
    if (ev.status != RL_OK)
        *err = ev.error;
    return ev.status;
}

/* min_replicas, when no WAIT went out with the decision (the engine sent the decision
   again after NOSCRIPT, behind it): one WAIT now, its own round trip. */
static rl_status
wait_for_replicas(rl_conn *conn, const rl_config *cfg, double deadline, int *in_step, rl_error *err)
{
    char token = 0; /* its address tells the reply apart */
    *in_step = 0;
    rl_status st = queue_wait(conn, cfg, deadline, &token, err);
    return st != RL_OK ? st : read_wait(conn, cfg, &token, deadline, in_step, err);
}

rl_status
rl_call_run(rl_call *call, rl_error *err)
{
    rl_pool *pool = call->pool;
    for (;;) {
        rl_event ev;
        rl_status st;
        if (call->conn == NULL) {
            double connecting;
            st = rl_pool_acquire(pool, &call->conn, call->deadline, &connecting, err);
            call->deadline += connecting;
            if (st != RL_OK) {
                if (pool->metrics != NULL && st != RL_ERR_CLOSED && st != RL_ERR_NOMEM)
                    rl_metrics_count(&pool->metrics->connection_errors);
                return st;
            }
            call->conn->proto.metrics = pool->metrics;
            st = RL_OK;
            if (call->asking) {
                /* ASK: this connection may serve the migrating slot for the next command. */
                const char *asking = "ASKING";
                const size_t asking_len = 6;
                st = rl_proto_push_command(&call->conn->proto, 1, &asking, &asking_len,
                                           call->deadline, NULL, err);
            }
            if (st == RL_OK)
                st = rl_proto_push_decision(&call->conn->proto, call->decision, call->deadline,
                                            call, NULL, err);
            call->waiting = 0;
            if (st == RL_OK && pool->config.min_replicas > 0 &&
                is_admission(call->decision->shape)) {
                st = queue_wait(call->conn, &pool->config, call->deadline, &call->wait_token, err);
                call->waiting = st == RL_OK;
            }
            if (st != RL_OK) {
                /* Reused only when nothing was queued on it (ASKING may have been). */
                rl_pool_release(pool, call->conn, rl_proto_pending(&call->conn->proto) == 0);
                call->conn = NULL;
                return st;
            }
        }
        /* With a WAIT queued, its time on top: after NOSCRIPT the decision comes behind it. */
        st = conn_exchange(call->conn, call, call->waiting ? &call->wait_token : NULL,
                           call->waiting
                               ? call->deadline + (double)pool->config.replica_timeout_ms / 1000.0
                               : call->deadline,
                           &ev, err);
        if (st == RL_ERR_INTERRUPTED)
            return st; /* the connection stays with the call */
        if (st == RL_OK && ev.entry.token == &call->wait_token) {
            /* The WAIT answered first: NOSCRIPT made the engine send the decision again,
               behind it, so it covers nothing of ours (wait_for_replicas follows). */
            if (ev.reply != NULL)
                freeReplyObject(ev.reply);
            call->waiting = 0;
            continue;
        }
        rl_conn *conn = call->conn;
        int waiting = call->waiting, reusable = 1;
        call->conn = NULL;
        call->waiting = 0;
        if (st == RL_OK && ev.status == RL_OK && ev.result.allowed &&
            pool->config.min_replicas > 0 && is_admission(call->decision->shape)) {
            int in_step;
            st = waiting ? read_wait(conn, &pool->config, &call->wait_token, call->deadline,
                                     &in_step, err)
                         : wait_for_replicas(conn, &pool->config, call->deadline, &in_step, err);
            rl_pool_release(pool, conn, in_step);
            if (st == RL_OK)
                call->result = ev.result;
            return st;
        }
        if (st == RL_OK && waiting) {
            /* A refusal or an error reply: the WAIT's reply is still due. Read (and drop)
               it, so the connection stays in step; a refusal's WAIT has no write of its own
               to wait for, it answers at once unless an earlier admission on this connection
               is still unacknowledged. */
            rl_error ignored;
            int in_step;
            (void)read_wait(conn, &pool->config, &call->wait_token, call->deadline, &in_step,
                            &ignored);
            reusable = in_step;
        }
        if (st == RL_OK) {
            /* Bytes after our reply were never asked for: the connection is out of step. */
            rl_pool_release(pool, conn,
                            reusable && !ev.fatal && !rl_proto_idle_is_stale(&conn->proto, -1));
            if (ev.status != RL_OK) {
                *err = ev.error;
                return ev.status;
            }
            call->result = ev.result;
            return RL_OK;
        }
        rl_pool_release(pool, conn, 0);
        if (pool->metrics != NULL)
            rl_metrics_count(&pool->metrics->connection_errors);
        if (st == RL_ERR_IO)
            rl_pool_drop_idle(pool); /* a server restart broke them all: reconnect afresh */
        int replay = rl_proto_replay(st, call->decision);
        if (replay < 0)
            return rl_error_set(err, RL_ERR_NOMEM, "out of memory replaying a call");
        if (replay == 0)
            return st;
        if (pool->metrics != NULL)
            rl_metrics_count(&pool->metrics->replays);
        /* The connection broke mid-call: the script may or may not have run. Once more on
           a fresh connection, marked, with the same member (proto.c, rl_proto_replay). */
    }
}

rl_status
rl_pool_command(rl_pool *pool, int argc, const char **argv, const size_t *argvlen, double deadline,
                redisReply **reply, rl_error *err)
{
    rl_conn *conn = NULL;
    double connecting;
    rl_event ev;
    char token; /* its address tells our reply apart */
    *reply = NULL;
    rl_status st = rl_pool_acquire(pool, &conn, deadline, &connecting, err);
    if (st != RL_OK)
        return st;
    deadline += connecting;
    st = rl_proto_push_command(&conn->proto, argc, argv, argvlen, deadline, &token, err);
    if (st != RL_OK) {
        rl_pool_release(pool, conn, 1); /* nothing was queued on it */
        return st;
    }
    do
        st = conn_exchange(conn, &token, NULL, deadline, &ev, err);
    while (st == RL_ERR_INTERRUPTED); /* the deadline still bounds it */
    if (st != RL_OK) {
        rl_pool_release(pool, conn, 0);
        return st;
    }
    rl_pool_release(pool, conn, !ev.fatal && !rl_proto_idle_is_stale(&conn->proto, -1));
    if (ev.status != RL_OK) {
        *err = ev.error;
        return ev.status;
    }
    *reply = ev.reply;
    return RL_OK;
}

void
rl_call_abandon(rl_call *call)
{
    if (call->conn != NULL) {
        rl_pool_release(call->pool, call->conn, 0); /* out of step: a reply may be on its way */
        call->conn = NULL;
    }
}

/* -------------------------------------------------------------------- pool */

int
rl_pool_init(rl_pool *pool, int max_open)
{
    int rc;
    pool->warning_state = 0;
    pool->warning[0] = '\0';
    pool->idle = NULL;
    pool->open = 0;
    pool->max_open = max_open;
    pool->closed = 0;
    if ((rc = pthread_mutex_init(&pool->mutex, NULL)) != 0)
        goto fail;
    if ((rc = rl_cond_init(&pool->available)) != 0) {
        pthread_mutex_destroy(&pool->mutex);
        goto fail;
    }
    pool->initialized = 1;
    return 0;
fail:
    errno = rc;
    return -1;
}

static void
free_idle(rl_conn *list)
{
    while (list != NULL) {
        rl_conn *next = list->next;
        conn_free(list);
        list = next;
    }
}

void
rl_pool_close(rl_pool *pool)
{
    if (!pool->initialized)
        return;
    pthread_mutex_lock(&pool->mutex);
    pool->closed = 1;
    pthread_mutex_unlock(&pool->mutex);
    rl_pool_drop_idle(pool);
}

void
rl_pool_destroy(rl_pool *pool)
{
    if (!pool->initialized)
        return;
    /* Only called from dealloc: no call can be in flight (it would hold a reference). */
    free_idle(pool->idle);
    pool->idle = NULL;
    pthread_cond_destroy(&pool->available);
    pthread_mutex_destroy(&pool->mutex);
    pool->initialized = 0;
}

/* Called with the GIL held, in a fork child, before the pool is used. The child has one
   thread; the mutex may have been copied in a locked state, so it is made anew, and the
   parent's sockets are closed here (closing our copy of the fd does not disturb the
   parent). Connections that other parent threads had checked out are simply forgotten. */
void
rl_pool_after_fork(rl_pool *pool)
{
    if (!pool->initialized)
        return;
    free_idle(pool->idle);
    pool->idle = NULL;
    pool->open = 0;
    (void)pthread_mutex_init(&pool->mutex, NULL);
    (void)rl_cond_init(&pool->available);
}

rl_status
rl_pool_acquire(rl_pool *pool, rl_conn **out, double deadline, double *connecting, rl_error *err)
{
    *out = NULL;
    *connecting = 0;
    pthread_mutex_lock(&pool->mutex);
    for (;;) {
        if (pool->closed) {
            pthread_mutex_unlock(&pool->mutex);
            return rl_error_set(err, RL_ERR_CLOSED, "the rate limiter is closed");
        }
        if (pool->idle != NULL) {
            rl_conn *conn = pool->idle;
            pool->idle = conn->next;
            conn->next = NULL;
            pthread_mutex_unlock(&pool->mutex);
            if (!conn_is_stale(conn)) {
                *out = conn;
                return RL_OK;
            }
            /* Replace it in its slot: nothing was sent on it, so nothing is replayed. */
            conn_free(conn);
            double started = rl_monotonic();
            rl_status st = conn_open(&pool->config, out, err);
            *connecting = rl_monotonic() - started;
            if (st != RL_OK)
                rl_pool_release(pool, NULL, 0);
            return st;
        }
        if (pool->open < pool->max_open) {
            pool->open++;
            pthread_mutex_unlock(&pool->mutex);
            double started = rl_monotonic();
            rl_status st = conn_open(&pool->config, out, err);
            *connecting = rl_monotonic() - started;
            if (st != RL_OK)
                rl_pool_release(pool, NULL, 0);
            return st;
        }
        /* Every connection is busy: wait for one, but never past the call's deadline. */
        double left = deadline - rl_monotonic();
        if (left <= 0) {
            int max_open = pool->max_open;
            pthread_mutex_unlock(&pool->mutex);
            return rl_error_set(err, RL_ERR_TIMEOUT,
                                "timed out waiting for a free connection (all %d are busy; "
                                "raise max_connections)",
                                max_open);
        }
        struct timespec until;
        rl_cond_deadline(&until, left);
        (void)pthread_cond_timedwait(&pool->available, &pool->mutex, &until);
    }
}

/* Returns a connection (or, with conn NULL, a slot whose connection failed or died).
   A connection that is not reusable is closed and its slot freed. */
void
rl_pool_release(rl_pool *pool, rl_conn *conn, int reusable)
{
    rl_conn *discard = NULL;
    char warning[RL_WARNING_LEN] = "";
    if (conn != NULL && conn->proto.eviction_policy[0] != '\0' &&
        __atomic_load_n(&pool->warning_state, __ATOMIC_RELAXED) == 0)
        rl_proto_eviction_warning(&conn->proto, warning, sizeof(warning));
    pthread_mutex_lock(&pool->mutex);
    if (warning[0] != '\0' && pool->warning_state == 0) {
        memcpy(pool->warning, warning, sizeof(warning));
        __atomic_store_n(&pool->warning_state, 1, __ATOMIC_RELEASE);
    }
    if (conn != NULL && reusable && !pool->closed) {
        conn->next = pool->idle;
        pool->idle = conn;
    } else {
        discard = conn;
        pool->open--;
    }
    pthread_cond_signal(&pool->available);
    pthread_mutex_unlock(&pool->mutex);
    conn_free(discard);
}

void
rl_pool_drop_idle(rl_pool *pool)
{
    rl_conn *idle;
    pthread_mutex_lock(&pool->mutex);
    idle = pool->idle;
    pool->idle = NULL;
    for (rl_conn *c = idle; c != NULL; c = c->next)
        pool->open--;
    pthread_cond_broadcast(&pool->available);
    pthread_mutex_unlock(&pool->mutex);
    free_idle(idle);
}

int
rl_pool_take_warning(rl_pool *pool, char *buf)
{
    int taken = 0;
    if (__atomic_load_n(&pool->warning_state, __ATOMIC_ACQUIRE) != 1)
        return 0;
    pthread_mutex_lock(&pool->mutex);
    if (pool->warning_state == 1) {
        memcpy(buf, pool->warning, RL_WARNING_LEN);
        pool->warning_state = 2;
        taken = 1;
    }
    pthread_mutex_unlock(&pool->mutex);
    return taken;
}

int
rl_pool_is_closed(rl_pool *pool)
{
    int closed;
    pthread_mutex_lock(&pool->mutex);
    closed = pool->closed;
    pthread_mutex_unlock(&pool->mutex);
    return closed;
}

int
rl_pool_open_count(rl_pool *pool)
{
    int n;
    pthread_mutex_lock(&pool->mutex);
    n = pool->open;
    pthread_mutex_unlock(&pool->mutex);
    return n;
}
