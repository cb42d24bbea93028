/*
 * proto.c - the protocol engine of one Redis connection, with no I/O in it.
 *
 * Both limiters drive it: the blocking loop in conn.c (sockets, deadlines, the GIL
 * released) and the asyncio Protocol in aio.py through py_codec.c's Pipeline. The engine
 * owns what must behave the same on both paths, once:
 *   - the handshake steps (AUTH [user] password, SELECT db, PING on TLS) and how their
 *     replies are judged (a refused password is an auth error, anything else that is not
 *     the expected status drops the connection);
 *   - the FIFO of requests whose replies are due, and the bytes waiting to be written;
 *   - the NOSCRIPT reload: SCRIPT LOAD, its reply checked against the script's SHA1, and
 *     the same command once more;
 *   - the classification of every reply into a result or one rl_error kind, and of what
 *     makes the connection unusable (garbage, a reply nobody asked for, an oversized one);
 *   - the replay rule after a broken connection (rl_proto_replay);
 *   - min_replicas: the WAIT after an admission and how its reply, or its absence, is
 *     judged (rl_proto_push_wait, rl_proto_wait_failed).
 * Drivers only move bytes: they write rl_proto_output(), feed what they read, and take
 * completed requests from rl_proto_next().
 *
 * GIL contract: nothing here touches a Python object; every function may run with the
 * GIL released. An rl_proto belongs to one connection and is used by one thread at a time.
 * Memory: malloc/free (the blocking driver runs without the GIL).
 */
#include "native.h"

#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

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
/* A CLUSTER command's reply (the slot map) may list every slot: CLUSTER SHARDS has a
   shard's ranges as one array of up to 2 x 16,384 numbers, CLUSTER SLOTS up to 16,384
   ranges of ~100 bytes. Only a request queued as such gets these bounds. */
#define RL_MAX_MAP_ELEMENTS (2 * RL_CLUSTER_SLOTS)
#define RL_MAX_MAP_BYTES (4 * 1024 * 1024)

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
    return ((const rl_reader_limits *)task->privdata)->defaults;
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
    if (task->type != REDIS_REPLY_ARRAY ||
        (size_t)elements > ((const rl_reader_limits *)task->privdata)->max_elements)
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
rl_reader_create(rl_reader_limits *limits)
{
    redisReader *reader = redisReaderCreate();
    if (reader == NULL)
        return NULL;
    limits->defaults = reader->fn; /* hiredis's own (static) default functions */
    limits->max_elements = RL_MAX_REPLY_ELEMENTS;
    reader->privdata = limits;
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

/* ------------------------------------------------------------------ engine */

/* Frees the output buffer, wiped first while it holds a password. */
static void
free_output(rl_proto *p)
{
    if (p->out == NULL)
        return;
    if (p->sensitive)
        rl_wipe(p->out, p->out_len);
    rl_check_wiped(p->out, p->out_touched, "the output buffer");
    free(p->out);
    p->out = NULL;
    p->out_start = p->out_len = p->out_capacity = p->out_touched = 0;
}

int
rl_proto_init(rl_proto *p)
{
    memset(p, 0, sizeof(*p));
    p->reader = rl_reader_create(&p->limits);
    return p->reader == NULL ? -1 : 0;
}

void
rl_proto_clear(rl_proto *p)
{
    if (p->reader != NULL)
        redisReaderFree(p->reader);
    free_output(p);
    free(p->ring);
    memset(p, 0, sizeof(*p));
}

/* 1 when the allocation about to be made must fail: in debug and sanitized builds
   (RL_DEBUG_HOOKS), the n-th from when a test set p->fail_allocation to n (Pipeline.
   _debug_fail_allocation), so that every out-of-memory path can be driven; else never. */
static int
allocation_fails(rl_proto *p)
{
#ifdef RL_DEBUG_HOOKS
    if (p->fail_allocation > 0 && --p->fail_allocation == 0)
        return 1;
#else
    (void)p;
#endif
    return 0;
}

/* Makes room for n more entries. 0, or -1 when out of memory (nothing changed). */
static int
reserve_entries(rl_proto *p, size_t n)
{
    if (p->count + n <= p->capacity)
        return 0;
    size_t cap = p->capacity ? p->capacity * 2 : 16;
    while (cap < p->count + n)
        cap *= 2;
    rl_entry *ring = allocation_fails(p) ? NULL : malloc(cap * sizeof(rl_entry));
    if (ring == NULL)
        return -1;
    for (size_t i = 0; i < p->count; i++)
        ring[i] = p->ring[(p->head + i) % p->capacity];
    free(p->ring);
    p->ring = ring;
    p->capacity = cap;
    p->head = 0;
    return 0;
}

/* Makes room for len more output bytes. 0, or -1 when out of memory (nothing changed). A
   new buffer takes only the bytes still to be written; the old one is wiped and freed. */
static int
reserve_output(rl_proto *p, size_t len)
{
    if (p->out_len + len <= p->out_capacity)
        return 0;
    size_t live = p->out_len - p->out_start;
    size_t cap = p->out_capacity ? p->out_capacity : 1024;
    while (cap < live + len)
        cap *= 2;
    char *grown = allocation_fails(p) ? NULL : malloc(cap);
    if (grown == NULL)
        return -1;
    if (live > 0)
        memcpy(grown, p->out + p->out_start, live);
    free_output(p);
    p->out = grown;
    p->out_len = p->out_touched = live;
    p->out_capacity = cap;
    return 0;
}

/* Queues bytes and their entry together, or nothing at all. */
static rl_status
queue(rl_proto *p, const char *bytes, size_t len, const rl_entry *e, rl_error *err)
{
    if (p->failed)
        return rl_error_set(err, RL_ERR_IO, "the connection to Redis failed already");
    if (reserve_entries(p, 1) < 0 || reserve_output(p, len) < 0)
        return rl_error_set(err, RL_ERR_NOMEM, "out of memory queueing a command");
    memcpy(p->out + p->out_len, bytes, len);
    p->out_len += len;
    if (p->out_len > p->out_touched)
        p->out_touched = p->out_len;
    p->ring[(p->head + p->count) % p->capacity] = *e;
    p->count++;
    p->unsent++;
    return RL_OK;
}

/* Formats argv as a RESP command into *out (hiredis's allocation): its length, or -1 when
   out of memory (*out NULL). */
static long long
format_words(rl_proto *p, int argc, const char **argv, const size_t *argvlen, char **out)
{
    *out = NULL;
    long long len = allocation_fails(p) ? -1 : redisFormatCommandArgv(out, argc, argv, argvlen);
    if (len < 0 || *out == NULL) {
        if (*out != NULL)
            redisFreeCommand(*out);
        *out = NULL;
        return -1;
    }
    return len;
}

/* Frees a formatted command, wiped first: it may be AUTH's, holding the password. */
static void
drop_formatted(char *command, long long len)
{
    if (command == NULL)
        return;
    rl_wipe(command, (size_t)len);
    rl_check_wiped(command, (size_t)len, "a formatted command");
    redisFreeCommand(command);
}

/* Formats argv and queues it, or nothing. */
static rl_status
queue_words(rl_proto *p, int argc, const char **argv, const size_t *argvlen, const rl_entry *e,
            rl_error *err)
{
    char *command;
    long long len = format_words(p, argc, argv, argvlen, &command);
    if (len < 0)
        return rl_error_set(err, RL_ERR_NOMEM, "out of memory formatting a command");
    rl_status st = queue(p, command, (size_t)len, e, err);
    drop_formatted(command, len);
    return st;
}

int
rl_proto_handshake(rl_proto *p, const rl_handshake *h, double deadline, void *token, rl_error *err)
{
    /* At most AUTH, SELECT, INFO memory, PING. All are formatted and given room first, then
       queued together: either every step is queued or none is, so a failure never leaves
       a step (and the token of the last) behind. */
    enum { MAX_STEPS = 4 };
    char *command[MAX_STEPS] = {NULL, NULL, NULL, NULL};
    long long len[MAX_STEPS] = {0, 0, 0, 0};
    rl_entry entry[MAX_STEPS];
    const char *argv[3];
    size_t argvlen[3];
    char dbtext[24];
    int n = 0, waited = 0, last = -1, rc = -1;
    size_t total = 0;

    if (p->failed) {
        rl_error_set(err, RL_ERR_IO, "the connection to Redis failed already");
        return -1;
    }
    if (h->password != NULL) {
        int argc = 0;
        argv[argc] = "AUTH";
        argvlen[argc++] = 4;
        if (h->username != NULL) {
            argv[argc] = h->username;
            argvlen[argc++] = strlen(h->username);
        }
        argv[argc] = h->password;
        argvlen[argc++] = strlen(h->password);
        entry[n] = (rl_entry){.step = RL_STEP_AUTH, .deadline = deadline};
        if ((len[n] = format_words(p, argc, argv, argvlen, &command[n])) < 0)
            goto nomem;
        n++;
    }
    if (h->db != 0) {
        argv[0] = "SELECT";
        argvlen[0] = 6;
        argv[1] = dbtext;
        argvlen[1] = (size_t)snprintf(dbtext, sizeof(dbtext), "%lld", h->db);
        entry[n] = (rl_entry){.step = RL_STEP_SELECT, .deadline = deadline};
        if ((len[n] = format_words(p, 2, argv, argvlen, &command[n])) < 0)
            goto nomem;
        n++;
    }
    /* Not a step anyone waits for: no round trip is added. A server that refuses INFO (an
       ACL without +info) only goes without the eviction warning. */
    argv[0] = "INFO";
    argvlen[0] = 4;
    argv[1] = "memory";
    argvlen[1] = 6;
    entry[n] = (rl_entry){.step = RL_STEP_INFO, .deadline = deadline};
    if ((len[n] = format_words(p, 2, argv, argvlen, &command[n])) < 0)
        goto nomem;
    n++;
    if (h->password == NULL && h->db == 0 && h->ping) {
        /* A TLS 1.3 server sends its session tickets after the handshake; one round trip
           now reads them, so an idle pooled connection never looks readable (stale). */
        argv[0] = "PING";
        argvlen[0] = 4;
        entry[n] = (rl_entry){.step = RL_STEP_PING, .deadline = deadline};
        if ((len[n] = format_words(p, 1, argv, argvlen, &command[n])) < 0)
            goto nomem;
        n++;
    }
    /* Only the last step waited for carries the token: it completes the handshake. A step
       before it that fails reports a fatal event without a token; the driver then fails
       what is left, the last step included. */
    for (int i = 0; i < n; i++) {
        total += (size_t)len[i];
        if (entry[i].step != RL_STEP_INFO) {
            waited++;
            last = i;
        }
    }
    if (last >= 0) {
        entry[last].last = 1;
        entry[last].token = token;
    }
    if (reserve_entries(p, (size_t)n) < 0 || reserve_output(p, total) < 0)
        goto nomem;
    if (h->password != NULL)
        p->sensitive = 1; /* set before the bytes go in: every later wipe sees it */
    p->db = h->db;
    for (int i = 0; i < n; i++) {
        rl_status st = queue(p, command[i], (size_t)len[i], &entry[i], err);
        (void)st; /* the room is there: queue cannot fail now */
    }
    rc = waited;
    goto done;
nomem:
    rl_error_set(err, RL_ERR_NOMEM, "out of memory queueing the connection's handshake");
done:
    for (int i = 0; i < MAX_STEPS; i++)
        drop_formatted(command[i], len[i]);
    return rc;
}

rl_status
rl_proto_push_decision(rl_proto *p, rl_prepared *d, double deadline, void *token, void *holder,
                       rl_error *err)
{
    size_t len;
    const char *bytes = rl_prepared_bytes(d, &len);
    rl_entry e = {.step = RL_STEP_DECISION,
                  .deadline = deadline,
                  .token = token,
                  .holder = holder,
                  .decision = d,
                  .sent = p->metrics != NULL ? rl_monotonic() : 0,
                  .op = rl_metrics_op(d->shape)};
    if (bytes == NULL)
        return rl_error_set(err, RL_ERR_CLOSED, "the decision has no command (kill switch)");
    d->reloaded = 0; /* this sending's own (a replay is sent anew) */
    return queue(p, bytes, len, &e, err);
}

rl_status
rl_proto_push_command(rl_proto *p, int argc, const char **argv, const size_t *argvlen,
                      double deadline, void *token, rl_error *err)
{
    return rl_proto_push_held_command(p, argc, argv, argvlen, deadline, token, NULL, err);
}

rl_status
rl_proto_push_held_command(rl_proto *p, int argc, const char **argv, const size_t *argvlen,
                           double deadline, void *token, void *holder, rl_error *err)
{
    rl_entry e = {.step = RL_STEP_COMMAND,
                  .deadline = deadline,
                  .token = token,
                  .holder = holder,
                  .sent = p->metrics != NULL ? rl_monotonic() : 0,
                  .op = argc > 0 ? rl_metrics_command_op(argv[0], argvlen[0]) : RL_OP_COMMAND};
    e.large = argc > 0 && argvlen[0] == 7 && strncasecmp(argv[0], "CLUSTER", 7) == 0;
    return queue_words(p, argc, argv, argvlen, &e, err);
}

rl_status
rl_proto_push_wait(rl_proto *p, int replicas, long long timeout_ms, double deadline, void *token,
                   rl_error *err)
{
    char count[24], timeout[24];
    int cn = snprintf(count, sizeof(count), "%d", replicas);
    int tn = snprintf(timeout, sizeof(timeout), "%lld", timeout_ms);
    const char *argv[3] = {"WAIT", count, timeout};
    size_t argvlen[3] = {4, (size_t)cn, (size_t)tn};
    rl_entry e = {.step = RL_STEP_WAIT,
                  .deadline = deadline + (double)timeout_ms / 1000.0, /* WAIT's own time */
                  .token = token,
                  .replicas = replicas,
                  .wait_ms = timeout_ms,
                  .sent = p->metrics != NULL ? rl_monotonic() : 0,
                  .op = RL_OP_COMMAND};
    return queue_words(p, 3, argv, argvlen, &e, err);
}

rl_status
rl_proto_wait_failed(rl_status cause, rl_error *err)
{
    if (cause != RL_ERR_IO && cause != RL_ERR_PROTOCOL)
        return cause;
    char said[200];
    snprintf(said, sizeof(said), "%.199s", err->message);
    return rl_error_set(err, RL_ERR_SERVER,
                        "not replicated: the connection broke waiting for the replicas (%.200s)",
                        said);
}

const char *
rl_proto_output(const rl_proto *p, size_t *len)
{
    *len = p->out_len - p->out_start;
    return p->out != NULL ? p->out + p->out_start : NULL;
}

void
rl_proto_consume(rl_proto *p, size_t written)
{
    size_t left = p->out_len - p->out_start;
    p->out_start += written < left ? written : left;
    if (p->out_start < p->out_len)
        return; /* the rest goes out with the next write; nothing is moved */
    /* All written: the buffer is used again from its start. A password in it goes now. */
    if (p->sensitive)
        rl_wipe(p->out, p->out_len);
    p->sensitive = 0;
    p->out_start = p->out_len = 0;
    p->unsent = 0; /* every queued entry's bytes are on their way */
    if (p->out_capacity > 65536)
        free_output(p); /* a burst grew the buffer: give the memory back */
}

rl_status
rl_proto_feed(rl_proto *p, const char *data, size_t len, rl_error *err)
{
    if (p->failed || p->reader->err)
        return rl_error_set(err, RL_ERR_PROTOCOL, "the connection already failed: %s",
                            rl_reader_error(p->reader));
    if (redisReaderFeed(p->reader, data, len) != REDIS_OK)
        return rl_error_set(err, RL_ERR_NOMEM, "out of memory reading a reply");
    return RL_OK;
}

static rl_entry
pop_head(rl_proto *p)
{
    rl_entry e = p->ring[p->head];
    p->head = (p->head + 1) % p->capacity;
    p->count--;
    if (p->unsent > p->count)
        p->unsent = p->count;
    return e;
}

int
rl_proto_pop(rl_proto *p, rl_entry *out)
{
    if (p->count == 0)
        return 0;
    *out = pop_head(p);
    if (p->count == 0) {
        /* Nothing is waiting for the queued bytes any more. */
        if (p->sensitive)
            rl_wipe(p->out, p->out_len);
        p->sensitive = 0;
        p->out_start = p->out_len = 0;
        p->unsent = 0;
    }
    return 1;
}

size_t
rl_proto_pending(const rl_proto *p)
{
    return p->count;
}

const rl_entry *
rl_proto_entry(const rl_proto *p, size_t i)
{
    return i < p->count ? &p->ring[(p->head + i) % p->capacity] : NULL;
}

double
rl_proto_oldest_deadline(const rl_proto *p)
{
    return p->count ? p->ring[p->head].deadline : -1.0;
}

int
rl_proto_idle_is_stale(const rl_proto *p, int fd)
{
    if (p->count != 0)
        return 0; /* not idle: bytes on the socket are replies someone waits for */
    if (p->reader->pos < p->reader->len || p->failed)
        return 1;
    if (fd < 0)
        return 0;
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    return poll(&pfd, 1, 0) != 0; /* readable, hung up, or poll failed: do not trust it */
}

int
rl_proto_replay(rl_status cause, rl_prepared *d)
{
    if (cause != RL_ERR_IO || d == NULL || d->command == NULL || d->replay != NULL)
        return 0; /* a timeout or garbage is not replayed; a replay is not replayed again */
    d->replay = rl_script_replay_command(d->command, (size_t)d->command_len, &d->replay_len);
    return d->replay == NULL ? -1 : 1;
}

/* ----------------------------------------------------------- classification */

static int
status_is(const redisReply *r, const char *text)
{
    size_t n = strlen(text);
    return r->type == REDIS_REPLY_STATUS && r->len == n && memcmp(r->str, text, n) == 0;
}

static int
is_auth_refusal(const redisReply *r)
{
    return rl_reply_is_error(r, "NOAUTH") || rl_reply_is_error(r, "WRONGPASS");
}

/* Judges a handshake step's reply. RL_OK, or the error (always fatal for the connection). */
static rl_status
judge_handshake(const rl_proto *p, const rl_entry *e, const redisReply *r, rl_error *err)
{
    const char *expected = e->step == RL_STEP_PING ? "PONG" : "OK";
    const char *name = e->step == RL_STEP_AUTH     ? "AUTH"
                       : e->step == RL_STEP_SELECT ? "SELECT"
                                                   : "PING";
    if (status_is(r, expected))
        return RL_OK;
    if (r->type == REDIS_REPLY_ERROR) {
        /* The server's text names the user at most, never the password. */
        if (e->step == RL_STEP_AUTH || is_auth_refusal(r))
            return rl_error_set(err, RL_ERR_AUTH, "Redis authentication failed: %.200s", r->str);
        if (e->step == RL_STEP_SELECT)
            return rl_error_set(err, RL_ERR_SERVER, "Redis refused SELECT %lld: %.200s", p->db,
                                r->str);
        return rl_error_set(err, RL_ERR_SERVER, "Redis refused %s: %.200s", name, r->str);
    }
    return rl_error_set(err, RL_ERR_PROTOCOL, "unexpected reply to %s: %s, expected +%s", name,
                        rl_reply_type_name(r->type), expected);
}

/* The value of "name:" in an INFO reply, copied into out (at most size - 1 bytes), or "". */
static void
info_field(const redisReply *r, const char *name, char *out, size_t size)
{
    size_t n = strlen(name);
    out[0] = '\0';
    for (size_t i = 0; i + n < r->len; i++) {
        if ((i == 0 || r->str[i - 1] == '\n') && memcmp(r->str + i, name, n) == 0 &&
            r->str[i + n] == ':') {
            size_t start = i + n + 1, end = start;
            while (end < r->len && r->str[end] != '\r' && r->str[end] != '\n')
                end++;
            size_t len = end - start < size - 1 ? end - start : size - 1;
            memcpy(out, r->str + start, len);
            out[len] = '\0';
            return;
        }
    }
}

/* Reads maxmemory and maxmemory_policy from INFO memory's reply. Our keys all carry a TTL:
   every policy but noeviction may evict them once maxmemory is reached (volatile-* ones
   evict only keys with a TTL: ours first of all). An error reply (an ACL without +info) or
   anything else leaves eviction_policy empty. */
static void
note_memory_info(rl_proto *p, const redisReply *r)
{
    char maxmemory[32], policy[sizeof(p->eviction_policy)];
    p->info_answered = 1;
    if (r->type != REDIS_REPLY_STRING && r->type != REDIS_REPLY_STATUS)
        return;
    info_field(r, "maxmemory", maxmemory, sizeof(maxmemory));
    info_field(r, "maxmemory_policy", policy, sizeof(policy));
    p->maxmemory = strtoll(maxmemory, NULL, 10);
    if (p->maxmemory > 0 && policy[0] != '\0' && strcmp(policy, "noeviction") != 0)
        memcpy(p->eviction_policy, policy, sizeof(policy));
}

void
rl_proto_eviction_warning(const rl_proto *p, char *buf, size_t size)
{
    buf[0] = '\0';
    if (p->eviction_policy[0] == '\0')
        return;
    snprintf(buf, size,
             "Redis may evict the rate limiter's keys (maxmemory %lld bytes, maxmemory-policy "
             "%s): an evicted key forgets its user's requests, which silently lifts the limit for "
             "that user. Use maxmemory-policy noeviction on the limiter's Redis (see "
             "docs/production.md)",
             p->maxmemory, p->eviction_policy);
}

/* Judges WAIT's reply (rl_proto_push_wait): RL_OK when enough replicas acknowledged the
   admission. Anything but an integer counts as none. */
static rl_status
judge_wait(const rl_entry *e, const redisReply *r, rl_error *err)
{
    if (r->type == REDIS_REPLY_ERROR)
        return rl_error_set(err, is_auth_refusal(r) ? RL_ERR_AUTH : RL_ERR_SERVER,
                            "not replicated: Redis answered an error: %.240s", r->str);
    long long acked = r->type == REDIS_REPLY_INTEGER ? r->integer : 0;
    if (acked >= e->replicas)
        return RL_OK;
    return rl_error_set(err, RL_ERR_SERVER,
                        "not replicated: %lld of the %d replicas required acknowledged the "
                        "admission within %lld ms (min_replicas); it does not count as allowed",
                        acked < 0 ? 0 : acked, e->replicas, e->wait_ms);
}

/* Judges SCRIPT LOAD's reply: RL_OK, a refusal (kept for the decision that follows), or
   PROTOCOL (fatal). */
static rl_status
judge_script_load(rl_proto *p, const rl_entry *e, const redisReply *r, rl_error *err)
{
    const char *sha = rl_script_sha1(e->script);
    size_t sha_len = strlen(sha);
    if (r->type == REDIS_REPLY_ERROR) {
        p->load_failed = 1;
        if (rl_reply_is_error(r, "OOM"))
            rl_error_set(&p->load_error, RL_ERR_SERVER,
                         "Redis is out of memory (used memory > maxmemory, noeviction): it "
                         "refused to load the rate-limit script (%.160s)",
                         r->str);
        else if (is_auth_refusal(r))
            rl_error_set(&p->load_error, RL_ERR_AUTH,
                         "the Redis server requires authentication: "
                         "put the password in the URL (%.120s)",
                         r->str);
        else
            rl_error_set(&p->load_error, RL_ERR_SERVER,
                         "Redis refused to load the rate-limit "
                         "script: %.240s",
                         r->str);
        return RL_OK;
    }
    if (r->type != REDIS_REPLY_STRING || r->len != sha_len || memcmp(r->str, sha, sha_len) != 0)
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "unexpected reply to SCRIPT LOAD: %s, expected the script's SHA1",
                            rl_reply_type_name(r->type));
    p->load_failed = 0;
    return RL_OK;
}

/* After NOSCRIPT: SCRIPT LOAD and the same decision again, at the end of the FIFO.
   Takes e (already popped). RL_OK, or NOMEM (nothing queued). */
static rl_status
reload_and_resend(rl_proto *p, rl_entry e, rl_error *err)
{
    size_t load_len, len;
    const char *load = rl_script_load_text(e.decision->script, &load_len);
    const char *bytes = rl_prepared_bytes(e.decision, &len);
    rl_entry load_entry = {
        .step = RL_STEP_SCRIPT_LOAD, .script = e.decision->script, .deadline = e.deadline};
    /* Room for both first, so that either both are queued or neither is. */
    if (reserve_entries(p, 2) < 0 || reserve_output(p, load_len + len) < 0)
        return rl_error_set(err, RL_ERR_NOMEM, "out of memory loading the script");
    if (queue(p, load, load_len, &load_entry, err) != RL_OK)
        return err->kind;
    e.reloaded = 1;
    e.decision->reloaded = 1;
    return queue(p, bytes, len, &e, err);
}

int
rl_proto_next(rl_proto *p, rl_event *ev, rl_error *err)
{
    for (;;) {
        void *raw = NULL;
        if (p->failed) {
            rl_error_set(err, RL_ERR_PROTOCOL, "the connection already failed");
            return -1;
        }
        /* The bounds of the reply due now: the oldest request's. */
        int large = p->count > 0 && p->ring[p->head].large;
        size_t max_bytes = large ? RL_MAX_MAP_BYTES : RL_MAX_REPLY_BYTES;
        p->limits.max_elements = large ? RL_MAX_MAP_ELEMENTS : RL_MAX_REPLY_ELEMENTS;
        if (redisReaderGetReply(p->reader, &raw) != REDIS_OK) {
            p->failed = 1;
            rl_error_set(err, RL_ERR_PROTOCOL, "Redis sent a malformed reply: %s",
                         rl_reader_error(p->reader));
            return -1;
        }
        if (raw == NULL) {
            /* hiredis keeps a partial reply buffered: bound it. */
            if (p->reader->len - p->reader->pos > max_bytes) {
                p->failed = 1;
                rl_error_set(err, RL_ERR_PROTOCOL,
                             "Redis sent more than %zu bytes without "
                             "completing a reply: not a reply this client expects",
                             max_bytes);
                return -1;
            }
            return 0;
        }
        redisReply *reply = raw;
        if (p->count == p->unsent) {
            /* No request whose bytes went out is waiting: nobody asked for this reply. */
            freeReplyObject(reply);
            p->failed = 1;
            rl_error_set(err, RL_ERR_PROTOCOL, "Redis sent a reply nobody asked for");
            return -1;
        }
        rl_entry e = pop_head(p);
        rl_status st;
        memset(ev, 0, sizeof(*ev));
        ev->entry = e;
        switch (e.step) {
        case RL_STEP_AUTH:
        case RL_STEP_SELECT:
        case RL_STEP_PING:
            st = judge_handshake(p, &e, reply, &ev->error);
            freeReplyObject(reply);
            if (st == RL_OK && !e.last)
                continue; /* the next step's reply completes the handshake */
            ev->status = st;
            ev->fatal = st != RL_OK;
            break;
        case RL_STEP_INFO:
            note_memory_info(p, reply);
            freeReplyObject(reply);
            continue; /* informational: never an event, never fatal */
        case RL_STEP_SCRIPT_LOAD:
            st = judge_script_load(p, &e, reply, err);
            freeReplyObject(reply);
            if (st != RL_OK) {
                p->failed = 1;
                return -1;
            }
            continue; /* the decision sent after it reports */
        case RL_STEP_DECISION:
            if (rl_reply_is_error(reply, "NOSCRIPT")) {
                freeReplyObject(reply);
                if (!e.reloaded) {
                    /* The script cache is empty (SCRIPT FLUSH, restart, failover): nothing
                       ran. Load it and send the same command once more. */
                    st = reload_and_resend(p, e, &ev->error);
                    if (st == RL_OK)
                        continue;
                } else if (p->load_failed) {
                    ev->error = p->load_error;
                    st = ev->error.kind;
                } else {
                    st = rl_error_set(&ev->error, RL_ERR_SERVER,
                                      "Redis answered NOSCRIPT "
                                      "again right after loading the rate-limit script");
                }
                ev->status = st;
                break;
            }
            if (rl_reply_is_cluster_redirect(reply)) {
                /* Nothing ran on this node: the cluster driver sends it where it belongs. */
                st = rl_error_set(&ev->error, RL_ERR_REDIRECT, "%.300s", reply->str);
                freeReplyObject(reply);
                ev->status = st;
                break;
            }
            st = rl_script_decode(reply, e.decision, &ev->result, &ev->error);
            freeReplyObject(reply);
            ev->status = st;
            if (p->metrics != NULL) {
                /* Counted here, the one path both drivers share: a decision's outcome
                   once it is answered, and the time since it was queued. */
                if (e.sent > 0)
                    rl_metrics_latency(p->metrics, e.op, rl_monotonic() - e.sent);
                if (st == RL_OK)
                    rl_metrics_decision(p->metrics, e.decision, &ev->result);
            }
            ev->fatal = st == RL_ERR_PROTOCOL; /* garbage: out of step; an error reply is not */
            break;
        case RL_STEP_WAIT:
            if (p->metrics != NULL && e.sent > 0)
                rl_metrics_latency(p->metrics, e.op, rl_monotonic() - e.sent);
            st = judge_wait(&e, reply, &ev->error);
            freeReplyObject(reply);
            ev->status = st;
            break;
        case RL_STEP_COMMAND:
        default:
            if (p->metrics != NULL && e.sent > 0) /* the command's round trip, by its op */
                rl_metrics_latency(p->metrics, e.op, rl_monotonic() - e.sent);
            if (reply->type == REDIS_REPLY_ERROR) {
                st = rl_error_set(&ev->error, is_auth_refusal(reply) ? RL_ERR_AUTH : RL_ERR_SERVER,
                                  "Redis answered an error: %.240s", reply->str);
                freeReplyObject(reply);
            } else {
                st = RL_OK;
                ev->reply = reply; /* the receiver frees it */
            }
            ev->status = st;
            break;
        }
        if (ev->fatal)
            p->failed = 1;
        return 1;
    }
}

/* ------------------------------------------------------------------ pub/sub */

/* A subscriber connection (the in-flight wait queue's wake-ups, docs/wait-queue.md) reads
   no replies to requests of its own but the server's pushes: "message" (a channel and its
   payload), the confirmations of SUBSCRIBE and UNSUBSCRIBE, and the status replies of its
   handshake (AUTH, PING). Here, with no I/O: the driver feeds what it read and takes the
   pushes; anything else (an error reply, garbage, an unexpected shape) makes the
   connection unusable. */

int
rl_push_reader_init(rl_push_reader *r)
{
    memset(r, 0, sizeof(*r));
    r->reader = rl_reader_create(&r->limits);
    return r->reader == NULL ? -1 : 0;
}

void
rl_push_reader_clear(rl_push_reader *r)
{
    if (r->reader != NULL)
        redisReaderFree(r->reader);
    memset(r, 0, sizeof(*r));
}

rl_status
rl_push_feed(rl_push_reader *r, const char *data, size_t len, rl_error *err)
{
    if (r->failed)
        return rl_error_set(err, RL_ERR_PROTOCOL, "the subscriber connection already failed");
    if (redisReaderFeed(r->reader, data, len) != REDIS_OK) {
        r->failed = 1;
        return rl_error_set(err, RL_ERR_NOMEM, "out of memory reading the subscriber connection");
    }
    return RL_OK;
}

/* The text of element i of an array reply when it is a bulk or status string. */
static int
push_text(const redisReply *r, size_t i, const char **text, size_t *len)
{
    const redisReply *e = r->element[i];
    if (e->type != REDIS_REPLY_STRING && e->type != REDIS_REPLY_STATUS)
        return -1;
    *text = e->str;
    *len = e->len;
    return 0;
}

int
rl_push_next(rl_push_reader *r, rl_push *out, rl_error *err)
{
    void *raw = NULL;
    memset(out, 0, sizeof(*out));
    if (r->failed) {
        rl_error_set(err, RL_ERR_PROTOCOL, "the subscriber connection already failed");
        return -1;
    }
    r->limits.max_elements = RL_MAX_REPLY_ELEMENTS;
    if (redisReaderGetReply(r->reader, &raw) != REDIS_OK) {
        r->failed = 1;
        rl_error_set(err, RL_ERR_PROTOCOL, "Redis sent a malformed push: %s",
                     rl_reader_error(r->reader));
        return -1;
    }
    if (raw == NULL) {
        if (r->reader->len - r->reader->pos > RL_MAX_REPLY_BYTES) {
            r->failed = 1;
            rl_error_set(err, RL_ERR_PROTOCOL,
                         "Redis sent more than %d bytes without completing a push",
                         (int)RL_MAX_REPLY_BYTES);
            return -1;
        }
        return 0;
    }
    redisReply *reply = raw;
    out->reply = reply;
    if (reply->type == REDIS_REPLY_STATUS) {
        out->kind = RL_PUSH_STATUS;
        out->payload = reply->str;
        out->payload_len = reply->len;
        return 1;
    }
    if (reply->type == REDIS_REPLY_ERROR) {
        r->failed = 1;
        /* A refused password names itself (NOAUTH, WRONGPASS, "invalid password") */
        int auth = reply->len >= 6 && (strncmp(reply->str, "NOAUTH", 6) == 0 ||
                                       strncmp(reply->str, "WRONGPASS", 9) == 0 ||
                                       strstr(reply->str, "password") != NULL);
        rl_error_set(err, auth ? RL_ERR_AUTH : RL_ERR_SERVER,
                     "Redis refused the subscriber connection's command: %.200s", reply->str);
        rl_push_done(out);
        return -1;
    }
    const char *kind = NULL;
    size_t kind_len = 0;
    if (reply->type == REDIS_REPLY_ARRAY && reply->elements == 3 &&
        push_text(reply, 0, &kind, &kind_len) == 0 &&
        push_text(reply, 1, &out->channel, &out->channel_len) == 0) {
        const redisReply *last = reply->element[2];
        if (kind_len == 7 && memcmp(kind, "message", 7) == 0 &&
            push_text(reply, 2, &out->payload, &out->payload_len) == 0) {
            out->kind = RL_PUSH_MESSAGE;
            return 1;
        }
        if (last->type == REDIS_REPLY_INTEGER &&
            ((kind_len == 9 && memcmp(kind, "subscribe", 9) == 0) ||
             (kind_len == 11 && memcmp(kind, "unsubscribe", 11) == 0))) {
            out->kind = kind_len == 9 ? RL_PUSH_SUBSCRIBE : RL_PUSH_UNSUBSCRIBE;
            return 1;
        }
    }
    r->failed = 1;
    rl_error_set(err, RL_ERR_PROTOCOL,
                 "Redis sent the subscriber connection a reply that is no push: %s",
                 rl_reply_type_name(reply->type));
    rl_push_done(out);
    return -1;
}

void
rl_push_done(rl_push *p)
{
    if (p->reply != NULL)
        freeReplyObject(p->reply);
    p->reply = NULL;
}

long long
rl_push_format(int argc, const char **argv, const size_t *argvlen, char **out)
{
    long long len = redisFormatCommandArgv(out, argc, argv, argvlen);
    if (len < 0 || *out == NULL) {
        *out = NULL;
        return -1;
    }
    return len;
}

void
rl_push_format_free(char *command)
{
    redisFreeCommand(command);
}
