/*
 * conn.c - connections to Redis and the pool that shares them between threads.
 *
 * TLS (rediss://) is OpenSSL on the same blocking socket: SSL_read/SSL_write honour the
 * socket timeouts, and a handshake failure names the certificate problem.
 *
 * GIL contract: nothing in this file touches a Python object, and every function but
 * rl_pool_init / rl_pool_after_fork is called with the GIL released. Errors are
 * reported as an rl_status plus an rl_error (native.h), never as Python exceptions.
 *
 * Lock contract: pool->mutex guards the pool's bookkeeping only; it is never held
 * across connect() or socket I/O, and it is taken only after the GIL was released.
 *
 * I/O: sockets are blocking with SO_SNDTIMEO/SO_RCVTIMEO, so one decision costs one
 * write() and (usually) one read(). A deadline bounds the whole call: after a partial
 * read the receive timeout is re-armed with what is left of it. hiredis is used for what
 * it is best at, RESP parsing (redisReader); we own the socket so that deadlines are
 * exact and the same code serves every hiredis version. Any error makes a connection
 * unusable: it is closed, never read again, and the next call opens a new one.
 */
#include "native.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/x509v3.h>

static rl_status arm_timeouts(rl_conn *conn, double seconds, rl_error *err);

rl_status
rl_error_set(rl_error *err, rl_status kind, int saved_errno, const char *fmt, ...)
{
    va_list ap;
    err->kind = kind;
    err->saved_errno = saved_errno;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
    return kind;
}

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
rl_config_init(rl_config *cfg, const char *host, int port, const char *unix_path,
               long long db, const char *username, const char *password,
               double connect_timeout, double socket_timeout)
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
        memset(cfg->password, 0, strlen(cfg->password));
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
        return rl_error_set(err, RL_ERR_NOMEM, ENOMEM, "cannot create a TLS context: %s",
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
            return rl_error_set(err, RL_ERR_CONNECT, 0, "cannot load CA certificates from %s: %s",
                                ca_file ? ca_file : "the system's default locations",
                                ssl_error_text(detail, sizeof(detail)));
        }
    } else {
        SSL_CTX_set_verify(ctx, SSL_VERIFY_NONE, NULL);
    }
    if (cert_file != NULL &&
        SSL_CTX_use_certificate_chain_file(ctx, cert_file) != 1) {
        SSL_CTX_free(ctx);
        return rl_error_set(err, RL_ERR_CONNECT, 0, "cannot load the client certificate %s: %s",
                            cert_file, ssl_error_text(detail, sizeof(detail)));
    }
    if (key_file != NULL || cert_file != NULL) {
        const char *key = key_file != NULL ? key_file : cert_file;
        if (SSL_CTX_use_PrivateKey_file(ctx, key, SSL_FILETYPE_PEM) != 1 ||
            SSL_CTX_check_private_key(ctx) != 1) {
            SSL_CTX_free(ctx);
            return rl_error_set(err, RL_ERR_CONNECT, 0, "cannot load the client key %s: %s", key,
                                ssl_error_text(detail, sizeof(detail)));
        }
    }
    cfg->tls = 1;
    cfg->tls_verify = verify;
    cfg->ssl_ctx = ctx;
    return RL_OK;
}

/* ------------------------------------------------------------------- clock */

double
rl_monotonic(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
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

/* ----------------------------------------------------------------- reader */

/* The reply functions of our readers: hiredis's defaults (reached through the reader's
   privdata), except for two kinds of reply that they refuse (return NULL: the reader
   fails, and the connection is dropped):
   - an array longer than any reply we expect. Without this, a hostile "*1000000000"
     header makes hiredis 0.14 calloc and later walk a billion element slots.
   - any RESP3 type (double, boolean, null, map, set, attribute, push, big number,
     verbatim string). We never send HELLO 3, so a Redis server speaks RESP2 to us: a
     RESP3 reply comes from something else. hiredis 0.14 calls RESP3's type bytes a
     protocol error; hiredis 1.x parses them. Refused here, the same bytes meet the same
     fate on every hiredis version, and no code outside this section ever sees a RESP3
     reply: the decision, handshake and script code know the RESP2 types only (and
     hiredis 1.0's own functions abort on a nil, double or boolean inside a push).
   Every function of hiredis's table is ours: for a missing one, hiredis 1.x hands out
   the reply's type number cast to a pointer (a double becomes the "reply" 0x7), and the
   first read of it kills the process. The table is constant: no global mutable state. */
#define RL_MAX_REPLY_ELEMENTS 64

#if HIREDIS_MAJOR >= 1
typedef size_t rl_elements_t;
#define RL_REPLY_FUNCTIONS 7 /* + createDouble, createBool */
#else
typedef int rl_elements_t;
#define RL_REPLY_FUNCTIONS 5 /* createString, createArray, createInteger, createNil, freeObject */
#endif
/* A hiredis with more reply functions than we fill must not compile (see above). */
_Static_assert(sizeof(redisReplyObjectFunctions) == RL_REPLY_FUNCTIONS * sizeof(void (*)(void)),
               "this hiredis has reply functions that bounded_functions does not fill");

static const redisReplyObjectFunctions *
defaults_of(const redisReadTask *task)
{
    return (const redisReplyObjectFunctions *)task->privdata;
}

/* The task's type is the type byte's: a RESP2 bulk string, status or error is delegated;
   a verbatim string ('=') or big number ('(') is RESP3. */
static void *
bounded_string(const redisReadTask *task, char *str, size_t len)
{
    if (task->type != REDIS_REPLY_STRING && task->type != REDIS_REPLY_STATUS &&
        task->type != REDIS_REPLY_ERROR)
        return NULL;
    return defaults_of(task)->createString(task, str, len);
}

/* Only a RESP2 array ('*'): a map ('%', whose elements hiredis counts twice), set ('~'),
   push ('>') or attribute ('|') is RESP3. */
static void *
bounded_array(const redisReadTask *task, rl_elements_t elements)
{
    if (task->type != REDIS_REPLY_ARRAY || (size_t)elements > RL_MAX_REPLY_ELEMENTS)
        return NULL;
    return defaults_of(task)->createArray(task, elements);
}

static void *
bounded_integer(const redisReadTask *task, long long value)
{
    return defaults_of(task)->createInteger(task, value);
}

/* RESP2's nils are a bulk string or array of length -1 ("$-1", "*-1"): the task has that
   type. RESP3's null ('_') has the type NIL, and "%-1", "~-1", ">-1" the aggregate's. */
static void *
bounded_nil(const redisReadTask *task)
{
    if (task->type != REDIS_REPLY_STRING && task->type != REDIS_REPLY_ARRAY)
        return NULL;
    return defaults_of(task)->createNil(task);
}

#if HIREDIS_MAJOR >= 1
/* RESP3 only (',' and '#'): always refused. */
static void *
bounded_double(const redisReadTask *task, double value, char *str, size_t len)
{
    (void)task, (void)value, (void)str, (void)len;
    return NULL;
}

static void *
bounded_bool(const redisReadTask *task, int value)
{
    (void)task, (void)value;
    return NULL;
}
#endif

static const redisReplyObjectFunctions bounded_functions = {
    .createString = bounded_string,
    .createArray = bounded_array,
    .createInteger = bounded_integer,
#if HIREDIS_MAJOR >= 1
    .createDouble = bounded_double,
    .createBool = bounded_bool,
#endif
    .createNil = bounded_nil,
    .freeObject = freeReplyObject,
};

redisReader *
rl_reader_create(void)
{
    redisReader *reader = redisReaderCreate();
    if (reader == NULL)
        return NULL;
    reader->privdata = (void *)reader->fn; /* hiredis's own (static) default functions */
    reader->fn = (redisReplyObjectFunctions *)&bounded_functions;
    return reader;
}

const char *
rl_reader_error(const redisReader *reader)
{
    /* A refusal by our reply functions makes the reader say "Out of memory", and the
       reader keeps nothing that tells which refusal it was: name both. */
    if (reader->err == REDIS_ERR_OOM)
        return "an array of over 64 elements or a RESP3 type (this client speaks RESP2), "
               "or memory ran out";
    return reader->errstr;
}

int
rl_reader_idle(const redisReader *reader)
{
    return reader->pos >= reader->len;
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
    if (conn->reader != NULL)
        redisReaderFree(conn->reader);
    free(conn);
}

/* Connects fd (non-blocking) to addr within the deadline; leaves it blocking. */
static rl_status
connect_fd(int fd, const struct sockaddr *addr, socklen_t addrlen, double deadline,
           const char *where, rl_error *err)
{
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)
        return rl_error_set(err, RL_ERR_CONNECT, errno, "cannot configure a socket: %s",
                            strerror(errno));
    if (connect(fd, addr, addrlen) < 0) {
        if (errno != EINPROGRESS)
            return rl_error_set(err, RL_ERR_CONNECT, errno, "cannot connect to Redis at %s: %s",
                                where, strerror(errno));
        for (;;) {
            struct pollfd pfd = {.fd = fd, .events = POLLOUT};
            double left = deadline - rl_monotonic();
            if (left <= 0)
                return rl_error_set(err, RL_ERR_TIMEOUT, ETIMEDOUT,
                                    "timed out connecting to Redis at %s", where);
            int rc = poll(&pfd, 1, (int)(left * 1000.0) + 1);
            if (rc < 0 && errno == EINTR)
                continue;
            if (rc < 0)
                return rl_error_set(err, RL_ERR_CONNECT, errno, "cannot connect to Redis at %s: %s",
                                    where, strerror(errno));
            if (rc == 0)
                continue; /* the deadline check above ends the loop */
            int soerr = 0;
            socklen_t len = sizeof(soerr);
            if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) < 0)
                soerr = errno;
            if (soerr != 0)
                return rl_error_set(err, RL_ERR_CONNECT, soerr, "cannot connect to Redis at %s: %s",
                                    where, strerror(soerr));
            break;
        }
    }
    if (fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) < 0)
        return rl_error_set(err, RL_ERR_CONNECT, errno, "cannot configure a socket: %s",
                            strerror(errno));
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
            return rl_error_set(err, RL_ERR_CONNECT, ENAMETOOLONG,
                                "the unix socket path is too long (%zu bytes, at most %zu)",
                                strlen(cfg->unix_path), sizeof(sa.sun_path) - 1);
        memset(&sa, 0, sizeof(sa));
        sa.sun_family = AF_UNIX;
        memcpy(sa.sun_path, cfg->unix_path, strlen(cfg->unix_path) + 1);
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0)
            return rl_error_set(err, RL_ERR_CONNECT, errno, "cannot create a socket: %s",
                                strerror(errno));
        rl_status st = connect_fd(fd, (struct sockaddr *)&sa, sizeof(sa), deadline, where, err);
        if (st != RL_OK) {
            close(fd);
            return st;
        }
        *out_fd = fd;
        return RL_OK;
    }

    char port[16];
    struct addrinfo hints, *list = NULL;
    snprintf(where, sizeof(where), strchr(cfg->host, ':') ? "[%s]:%d" : "%s:%d", cfg->host,
             cfg->port);
    snprintf(port, sizeof(port), "%d", cfg->port);
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int gai = getaddrinfo(cfg->host, port, &hints, &list);
    if (gai != 0)
        return rl_error_set(err, RL_ERR_CONNECT, gai == EAI_SYSTEM ? errno : 0,
                            "cannot resolve Redis host %s: %s", where, gai_strerror(gai));
    rl_status st = rl_error_set(err, RL_ERR_CONNECT, 0, "no address for Redis host %s", where);
    for (struct addrinfo *ai = list; ai != NULL; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            st = rl_error_set(err, RL_ERR_CONNECT, errno, "cannot create a socket: %s",
                              strerror(errno));
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

static int
reply_is_error(const redisReply *r)
{
    return r != NULL && r->type == REDIS_REPLY_ERROR;
}

static int
starts_with(const redisReply *r, const char *prefix)
{
    size_t n = strlen(prefix);
    return r->str != NULL && r->len >= n && memcmp(r->str, prefix, n) == 0;
}

/* AUTH and SELECT, pipelined in one write. */
static rl_status
handshake(rl_conn *conn, const rl_config *cfg, double deadline, rl_error *err)
{
    const char *argv[3];
    size_t argvlen[3];
    char *commands[2] = {NULL, NULL};
    long long lengths[2] = {0, 0};
    int n = 0, is_auth[2] = {0, 0};
    char dbtext[24];
    rl_status st = RL_OK;
    redisReply *replies[2] = {NULL, NULL};
    char *buf = NULL;

    if (cfg->password != NULL) {
        int argc = 0;
        argv[argc] = "AUTH"; argvlen[argc++] = 4;
        if (cfg->username != NULL) {
            argv[argc] = cfg->username; argvlen[argc++] = strlen(cfg->username);
        }
        argv[argc] = cfg->password; argvlen[argc++] = strlen(cfg->password);
        lengths[n] = redisFormatCommandArgv(&commands[n], argc, argv, argvlen);
        is_auth[n++] = 1;
    }
    if (cfg->db != 0) {
        snprintf(dbtext, sizeof(dbtext), "%lld", cfg->db);
        argv[0] = "SELECT"; argvlen[0] = 6;
        argv[1] = dbtext; argvlen[1] = strlen(dbtext);
        lengths[n] = redisFormatCommandArgv(&commands[n], 2, argv, argvlen);
        n++;
    }
    if (n == 0 && cfg->tls) {
        /* A TLS 1.3 server sends its session tickets after the handshake; one round trip
           now reads them, so an idle pooled connection never looks readable (stale). */
        argv[0] = "PING"; argvlen[0] = 4;
        lengths[n++] = redisFormatCommandArgv(&commands[0], 1, argv, argvlen);
    }
    if (n == 0)
        return RL_OK;
    for (int i = 0; i < n; i++) {
        if (lengths[i] < 0 || commands[i] == NULL) {
            st = rl_error_set(err, RL_ERR_NOMEM, ENOMEM, "out of memory formatting a command");
            goto done;
        }
    }
    size_t total = (size_t)lengths[0] + (n > 1 ? (size_t)lengths[1] : 0);
    buf = malloc(total);
    if (buf == NULL) {
        st = rl_error_set(err, RL_ERR_NOMEM, ENOMEM, "out of memory formatting a command");
        goto done;
    }
    memcpy(buf, commands[0], (size_t)lengths[0]);
    if (n > 1)
        memcpy(buf + lengths[0], commands[1], (size_t)lengths[1]);

    st = rl_conn_roundtrip(conn, buf, total, n, replies, deadline - rl_monotonic(), err);
    if (st != RL_OK)
        goto done;
    for (int i = 0; i < n; i++) {
        redisReply *r = replies[i];
        if (!reply_is_error(r))
            continue;
        if (is_auth[i] || starts_with(r, "NOAUTH") || starts_with(r, "WRONGPASS")) {
            /* The server's text names the user at most, never the password. */
            st = rl_error_set(err, RL_ERR_AUTH, 0,
                              "Redis authentication failed%s: %.200s",
                              cfg->username ? " for the given user" : "", r->str);
        } else {
            st = rl_error_set(err, RL_ERR_SERVER, 0, "Redis refused SELECT %lld: %.200s",
                              cfg->db, r->str);
        }
        goto done;
    }

done:
    for (int i = 0; i < 2; i++) {
        if (replies[i] != NULL)
            freeReplyObject(replies[i]);
        if (commands[i] != NULL)
            redisFreeCommand(commands[i]);
    }
    if (buf != NULL) {
        memset(buf, 0, total); /* it held the password */
        free(buf);
    }
    return st;
}

static rl_status
tls_handshake(rl_conn *conn, const rl_config *cfg, double deadline, rl_error *err)
{
    char detail[200];
    unsigned char ip[sizeof(struct in6_addr)];
    int is_ip = inet_pton(AF_INET, cfg->host, ip) == 1 || inet_pton(AF_INET6, cfg->host, ip) == 1;
    rl_status st = arm_timeouts(conn, deadline - rl_monotonic(), err);
    if (st != RL_OK)
        return st;
    ERR_clear_error();
    conn->ssl = SSL_new(cfg->ssl_ctx);
    if (conn->ssl == NULL || SSL_set_fd(conn->ssl, conn->fd) != 1)
        return rl_error_set(err, RL_ERR_NOMEM, ENOMEM, "cannot start TLS: %s",
                            ssl_error_text(detail, sizeof(detail)));
    if (!is_ip)
        (void)SSL_set_tlsext_host_name(conn->ssl, cfg->host); /* SNI */
    if (cfg->tls_verify) {
        int named = is_ip ? X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(conn->ssl), cfg->host)
                          : SSL_set1_host(conn->ssl, cfg->host);
        if (named != 1)
            return rl_error_set(err, RL_ERR_CONNECT, 0, "cannot set the TLS peer name %s: %s",
                                cfg->host, ssl_error_text(detail, sizeof(detail)));
    }
    int rc = SSL_connect(conn->ssl);
    if (rc == 1)
        return RL_OK;
    int saved = errno, code = SSL_get_error(conn->ssl, rc);
    long verify = SSL_get_verify_result(conn->ssl);
    if (code == SSL_ERROR_WANT_READ || code == SSL_ERROR_WANT_WRITE ||
        (code == SSL_ERROR_SYSCALL && (saved == EAGAIN || saved == EWOULDBLOCK)))
        return rl_error_set(err, RL_ERR_TIMEOUT, ETIMEDOUT,
                            "timed out in the TLS handshake with Redis at %s:%d", cfg->host, cfg->port);
    if (verify != X509_V_OK)
        return rl_error_set(err, RL_ERR_CONNECT, 0,
                            "TLS handshake with Redis at %s:%d failed: certificate verify failed "
                            "(%s)", cfg->host, cfg->port, X509_verify_cert_error_string(verify));
    if (code == SSL_ERROR_SYSCALL && ERR_peek_error() == 0)
        return rl_error_set(err, RL_ERR_CONNECT, saved,
                            "TLS handshake with Redis at %s:%d failed: %s", cfg->host, cfg->port,
                            saved ? strerror(saved) : "the server closed the connection "
                            "(is it a TLS port?)");
    return rl_error_set(err, RL_ERR_CONNECT, 0, "TLS handshake with Redis at %s:%d failed: %s",
                        cfg->host, cfg->port, ssl_error_text(detail, sizeof(detail)));
}

static rl_status
conn_open(const rl_config *cfg, rl_conn **out, rl_error *err)
{
    double deadline = rl_monotonic() + cfg->connect_timeout;
    rl_status st;
    rl_conn *conn = calloc(1, sizeof(*conn));
    *out = NULL;
    if (conn == NULL)
        return rl_error_set(err, RL_ERR_NOMEM, ENOMEM, "out of memory opening a connection");
    conn->fd = -1;
    conn->reader = rl_reader_create();
    if (conn->reader == NULL) {
        st = rl_error_set(err, RL_ERR_NOMEM, ENOMEM, "out of memory opening a connection");
        goto error;
    }
    st = open_socket(cfg, deadline, &conn->fd, err);
    if (st != RL_OK)
        goto error;
    if (cfg->tls && (st = tls_handshake(conn, cfg, deadline, err)) != RL_OK)
        goto error;
    st = handshake(conn, cfg, deadline, err);
    if (st != RL_OK)
        goto error;
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
    struct pollfd pfd = {.fd = conn->fd, .events = POLLIN};
    if (conn->ssl != NULL && SSL_pending(conn->ssl) > 0)
        return 1; /* decrypted bytes nobody asked for */
    int rc = poll(&pfd, 1, 0);
    return rc != 0; /* readable, hung up, or poll failed: do not trust it */
}

static rl_status
io_error(rl_status kind, int saved, const char *what, rl_error *err)
{
    if (saved == EAGAIN || saved == EWOULDBLOCK || saved == ETIMEDOUT)
        return rl_error_set(err, RL_ERR_TIMEOUT, saved, "timed out %s Redis", what);
    return rl_error_set(err, kind, saved, "connection to Redis lost while %s it: %s", what,
                        strerror(saved));
}

/* Arms the socket's send and receive timeouts, skipping the syscalls when they already
   hold this value (the usual case: every call of a pool uses the same socket_timeout). */
static rl_status
arm_timeouts(rl_conn *conn, double seconds, rl_error *err)
{
    if (conn->armed_timeout == seconds)
        return RL_OK;
    if (set_io_timeout(conn->fd, SO_SNDTIMEO, seconds) < 0 ||
        set_io_timeout(conn->fd, SO_RCVTIMEO, seconds) < 0)
        return io_error(RL_ERR_IO, errno, "configuring the socket for", err);
    conn->armed_timeout = seconds;
    return RL_OK;
}

/* After a failed SSL_read/SSL_write: 0 for a clean or abrupt EOF, else -1 with errno
   (EAGAIN when the socket timeout expired, EPROTO for a TLS failure). */
static ssize_t
ssl_failure(rl_conn *conn, int rc)
{
    int saved = errno;
    switch (SSL_get_error(conn->ssl, rc)) {
    case SSL_ERROR_ZERO_RETURN:
        return 0;
    case SSL_ERROR_WANT_READ:
    case SSL_ERROR_WANT_WRITE:
        errno = EAGAIN;
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
        return send(conn->fd, buf, len, MSG_NOSIGNAL);
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

rl_status
rl_conn_roundtrip(rl_conn *conn, const char *buf, size_t len, int nreplies,
                  redisReply **replies, double timeout, rl_error *err)
{
    double deadline = rl_monotonic() + timeout;
    size_t fed = 0;
    int got = 0, first_recv = 1;
    char chunk[16384];
    rl_status st;

    if (timeout <= 0)
        return rl_error_set(err, RL_ERR_TIMEOUT, ETIMEDOUT, "timed out before writing to Redis");
    if ((st = arm_timeouts(conn, timeout, err)) != RL_OK)
        return st;

    while (len > 0) {
        ssize_t n = conn_write(conn, buf, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return io_error(RL_ERR_IO, errno, "writing to", err);
        }
        buf += n;
        len -= (size_t)n;
        if (len > 0) {
            /* A partial write (a big command, a full buffer): bound the rest by the deadline. */
            double left = deadline - rl_monotonic();
            if (left <= 0)
                return rl_error_set(err, RL_ERR_TIMEOUT, ETIMEDOUT, "timed out writing to Redis");
            if (set_io_timeout(conn->fd, SO_SNDTIMEO, left) < 0)
                return io_error(RL_ERR_IO, errno, "configuring the socket for", err);
            conn->armed_timeout = -1;
        }
    }

    while (got < nreplies) {
        void *reply = NULL;
        if (redisReaderGetReply(conn->reader, &reply) != REDIS_OK)
            return rl_error_set(err, RL_ERR_PROTOCOL, 0, "Redis sent a malformed reply: %s",
                                rl_reader_error(conn->reader));
        if (reply != NULL) {
            replies[got++] = reply;
            continue;
        }
        if (!first_recv) {
            /* The reply came in pieces: what is left of the deadline bounds the next read. */
            double left = deadline - rl_monotonic();
            if (left <= 0)
                return rl_error_set(err, RL_ERR_TIMEOUT, ETIMEDOUT, "timed out reading from Redis");
            if (set_io_timeout(conn->fd, SO_RCVTIMEO, left) < 0)
                return io_error(RL_ERR_IO, errno, "configuring the socket for", err);
            conn->armed_timeout = -1;
        }
        first_recv = 0;
        ssize_t n = conn_read(conn, chunk, sizeof(chunk));
        if (n < 0) {
            if (errno == EINTR) {
                first_recv = 1; /* same read again; the deadline check above still holds */
                continue;
            }
            return io_error(RL_ERR_IO, errno, "reading from", err);
        }
        if (n == 0)
            return rl_error_set(err, RL_ERR_IO, 0, "Redis closed the connection before replying");
        fed += (size_t)n;
        if (fed > RL_MAX_REPLY_BYTES)
            return rl_error_set(err, RL_ERR_PROTOCOL, 0,
                                "Redis sent more than %d bytes for one call: not a reply "
                                "this client expects", RL_MAX_REPLY_BYTES);
        if (redisReaderFeed(conn->reader, chunk, (size_t)n) != REDIS_OK)
            return rl_error_set(err, RL_ERR_NOMEM, ENOMEM, "out of memory reading a reply");
    }
    return RL_OK;
}

/* -------------------------------------------------------------------- pool */

int
rl_pool_init(rl_pool *pool, int max_open, pid_t pid)
{
    pthread_condattr_t attr;
    int rc;
    pool->idle = NULL;
    pool->open = 0;
    pool->max_open = max_open;
    pool->closed = 0;
    pool->pid = pid;
    if ((rc = pthread_mutex_init(&pool->mutex, NULL)) != 0)
        goto fail;
    if ((rc = pthread_condattr_init(&attr)) != 0) {
        pthread_mutex_destroy(&pool->mutex);
        goto fail;
    }
    (void)pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    rc = pthread_cond_init(&pool->available, &attr);
    pthread_condattr_destroy(&attr);
    if (rc != 0) {
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
rl_pool_after_fork(rl_pool *pool, pid_t pid)
{
    if (!pool->initialized)
        return;
    free_idle(pool->idle);
    pool->idle = NULL;
    pool->open = 0;
    pool->pid = pid;
    (void)pthread_mutex_init(&pool->mutex, NULL);
    pthread_condattr_t attr;
    if (pthread_condattr_init(&attr) == 0) {
        (void)pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
        (void)pthread_cond_init(&pool->available, &attr);
        pthread_condattr_destroy(&attr);
    }
}

rl_status
rl_pool_acquire(rl_pool *pool, rl_conn **out, rl_error *err)
{
    double deadline = 0;
    *out = NULL;
    pthread_mutex_lock(&pool->mutex);
    for (;;) {
        if (pool->closed) {
            pthread_mutex_unlock(&pool->mutex);
            return rl_error_set(err, RL_ERR_CLOSED, 0, "the rate limiter is closed");
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
            rl_status st = conn_open(&pool->config, out, err);
            if (st != RL_OK)
                rl_pool_release(pool, NULL, 0);
            return st;
        }
        if (pool->open < pool->max_open) {
            pool->open++;
            pthread_mutex_unlock(&pool->mutex);
            rl_status st = conn_open(&pool->config, out, err);
            if (st != RL_OK)
                rl_pool_release(pool, NULL, 0);
            return st;
        }
        /* Every connection is busy: wait for one, but never past the socket timeout. */
        if (deadline == 0)
            deadline = rl_monotonic() + pool->config.socket_timeout;
        double left = deadline - rl_monotonic();
        if (left <= 0) {
            int max_open = pool->max_open;
            pthread_mutex_unlock(&pool->mutex);
            return rl_error_set(err, RL_ERR_TIMEOUT, ETIMEDOUT,
                                "timed out waiting for a free connection (all %d are busy; "
                                "raise max_connections)", max_open);
        }
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        long long ns = (long long)until.tv_nsec + (long long)(left * 1e9);
        until.tv_sec += (time_t)(ns / 1000000000LL);
        until.tv_nsec = (long)(ns % 1000000000LL);
        (void)pthread_cond_timedwait(&pool->available, &pool->mutex, &until);
    }
}

/* Returns a connection (or, with conn NULL, a slot whose connection failed or died).
   A connection that is not reusable is closed and its slot freed. */
void
rl_pool_release(rl_pool *pool, rl_conn *conn, int reusable)
{
    rl_conn *discard = NULL;
    pthread_mutex_lock(&pool->mutex);
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
rl_pool_open_count(rl_pool *pool)
{
    int n;
    pthread_mutex_lock(&pool->mutex);
    n = pool->open;
    pthread_mutex_unlock(&pool->mutex);
    return n;
}
