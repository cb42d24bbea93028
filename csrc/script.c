/*
 * script.c - one rate-limit decision on Redis: the EVALSHA command, the NOSCRIPT
 * fallback and the decoding of the script's reply.
 *
 * GIL contract: nothing here touches a Python object. rl_script_format runs while the
 * caller still holds the GIL (it is pure C and quick); rl_script_run does socket I/O and
 * is called with the GIL released.
 *
 * Retry rule: after an explicit NOSCRIPT reply (which proves the script did not run) the
 * script is loaded and the call sent again. After a connection that broke mid-call, the
 * call is replayed once on a fresh connection with the script's replay marker: the member
 * is generated here, client-side, so the script can tell "already counted" and a request
 * is never counted twice. Nothing else is replayed (not timeouts: that would exceed them).
 */
#include "native.h"
#include "script_source.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char rl_script_sha1_hex[] = RL_SCRIPT_SHA1;

const char *
rl_script_source_text(size_t *len)
{
    *len = sizeof(rl_script_source) - 1;
    return rl_script_source;
}

#define RL_NUMBER_TEXT 24 /* room for any long long in decimal, with sign and NUL */
#define RL_STACK_ARENA 2048

/* Formats "EVALSHA sha N key... member now (window_ms limit)..." with hiredis.
   Returns the command's length and sets *out (free with redisFreeCommand), or -1 when
   out of memory. now_ms < 0 passes "" so the script reads the server's clock. */
long long
rl_script_format(const char *prefix, size_t prefix_len, const char *user, size_t user_len,
                 const rl_windows *w, const char *member, long long now_ms, char **out)
{
    const char *argv[5 + 3 * RL_MAX_WINDOWS];
    size_t argvlen[5 + 3 * RL_MAX_WINDOWS];
    char stack_arena[RL_STACK_ARENA];
    char *arena = stack_arena, *cursor;
    char numkeys[RL_NUMBER_TEXT], now_text[RL_NUMBER_TEXT];
    size_t key_room = prefix_len + 1 + user_len + 1 + RL_NUMBER_TEXT;
    size_t need = (size_t)w->count * (key_room + 2 * RL_NUMBER_TEXT);
    int argc = 0;
    long long len;

    *out = NULL;
    if (need > sizeof(stack_arena)) {
        arena = malloc(need);
        if (arena == NULL)
            return -1;
    }
    cursor = arena;

    argv[argc] = "EVALSHA"; argvlen[argc++] = 7;
    argv[argc] = rl_script_sha1_hex; argvlen[argc++] = sizeof(rl_script_sha1_hex) - 1;
    argvlen[argc] = (size_t)snprintf(numkeys, sizeof(numkeys), "%d", w->count);
    argv[argc++] = numkeys;
    for (int i = 0; i < w->count; i++) {
        /* "{prefix}:{user_id}:{window_seconds}": the window is the last ':' field and the
           prefix is fixed, so distinct user ids can never share a key. */
        char *key = cursor;
        memcpy(cursor, prefix, prefix_len);
        cursor += prefix_len;
        *cursor++ = ':';
        memcpy(cursor, user, user_len);
        cursor += user_len;
        cursor += snprintf(cursor, RL_NUMBER_TEXT, ":%lld", w->seconds[i]);
        argv[argc] = key;
        argvlen[argc++] = (size_t)(cursor - key);
    }
    argv[argc] = member; argvlen[argc++] = RL_MEMBER_LEN;
    if (now_ms >= 0) {
        argvlen[argc] = (size_t)snprintf(now_text, sizeof(now_text), "%lld", now_ms);
        argv[argc++] = now_text;
    } else {
        argv[argc] = ""; argvlen[argc++] = 0;
    }
    for (int i = 0; i < w->count; i++) {
        char *text = cursor;
        cursor += snprintf(cursor, RL_NUMBER_TEXT, "%lld", w->seconds[i] * 1000LL);
        argv[argc] = text;
        argvlen[argc++] = (size_t)(cursor - text);
        text = cursor;
        cursor += snprintf(cursor, RL_NUMBER_TEXT, "%lld", w->limit[i]);
        argv[argc] = text;
        argvlen[argc++] = (size_t)(cursor - text);
    }
    len = redisFormatCommandArgv(out, argc, argv, argvlen);
    if (arena != stack_arena)
        free(arena);
    if (len < 0 || *out == NULL) {
        *out = NULL;
        return -1;
    }
    return len;
}

static int
error_starts_with(const redisReply *r, const char *prefix)
{
    size_t n = strlen(prefix);
    return r->type == REDIS_REPLY_ERROR && r->str != NULL && r->len >= n &&
           memcmp(r->str, prefix, n) == 0;
}

static const char *
reply_type_name(int type)
{
    switch (type) {
    case REDIS_REPLY_STRING: return "a bulk string";
    case REDIS_REPLY_ARRAY: return "an array";
    case REDIS_REPLY_INTEGER: return "an integer";
    case REDIS_REPLY_NIL: return "nil";
    case REDIS_REPLY_STATUS: return "a status";
    case REDIS_REPLY_ERROR: return "an error";
    default: return "an unknown type";
    }
}

rl_status
rl_script_decode(const redisReply *reply, const rl_windows *w, rl_result *out, rl_error *err)
{
    int nwindows = w->count;
    if (reply->type == REDIS_REPLY_ERROR) {
        if (error_starts_with(reply, "NOAUTH") || error_starts_with(reply, "WRONGPASS"))
            return rl_error_set(err, RL_ERR_AUTH, 0,
                                "the Redis server requires authentication: put the password "
                                "in the URL (%.120s)", reply->str);
        return rl_error_set(err, RL_ERR_SERVER, 0, "Redis answered the rate-limit script with an "
                            "error: %.240s", reply->str ? reply->str : "");
    }
    if (reply->type != REDIS_REPLY_ARRAY || reply->elements != 4)
        return rl_error_set(err, RL_ERR_PROTOCOL, 0,
                            "unexpected reply to the rate-limit script: %s%s, expected an array "
                            "of 4 integers", reply_type_name(reply->type),
                            reply->type == REDIS_REPLY_ARRAY ? " of another length" : "");
    for (size_t i = 0; i < 4; i++) {
        if (reply->element[i] == NULL || reply->element[i]->type != REDIS_REPLY_INTEGER)
            return rl_error_set(err, RL_ERR_PROTOCOL, 0,
                                "unexpected reply to the rate-limit script: element %zu is %s, "
                                "expected an integer", i + 1,
                                reply->element[i] ? reply_type_name(reply->element[i]->type) : "missing");
    }
    long long allowed = reply->element[0]->integer;
    long long remaining = reply->element[1]->integer;
    long long retry = reply->element[2]->integer;
    long long window = reply->element[3]->integer;
    if ((allowed != 0 && allowed != 1) || remaining < 0 || retry < 0 || window < 1 ||
        window > nwindows ||
        (allowed == 1 && (retry != 0 || remaining >= w->limit[window - 1])) ||
        (allowed == 0 && (retry < 1 || remaining != 0)))
        return rl_error_set(err, RL_ERR_PROTOCOL, 0,
                            "the rate-limit script answered values out of range "
                            "(%lld, %lld, %lld, %lld)", allowed, remaining, retry, window);
    out->allowed = (int)allowed;
    out->remaining = remaining;
    out->retry_after_s = retry;
    out->window = (int)(window - 1);
    return RL_OK;
}

static int
is_noscript(const redisReply *r)
{
    return error_starts_with(r, "NOSCRIPT");
}

/* After a NOSCRIPT: SCRIPT LOAD and the same EVALSHA again, in one write. */
static rl_status
load_and_retry(rl_conn *conn, const char *command, size_t command_len, double timeout,
               redisReply **reply, rl_error *err)
{
    size_t load_len = sizeof(rl_script_load_command) - 1;
    redisReply *replies[2] = {NULL, NULL};
    rl_status st;
    char *buf = malloc(load_len + command_len);
    if (buf == NULL)
        return rl_error_set(err, RL_ERR_NOMEM, ENOMEM, "out of memory loading the script");
    memcpy(buf, rl_script_load_command, load_len);
    memcpy(buf + load_len, command, command_len);
    st = rl_conn_roundtrip(conn, buf, load_len + command_len, 2, replies, timeout, err);
    free(buf);
    if (st != RL_OK)
        goto done;
    if (replies[0]->type == REDIS_REPLY_ERROR) {
        st = error_starts_with(replies[0], "NOAUTH")
                 ? rl_error_set(err, RL_ERR_AUTH, 0, "the Redis server requires authentication")
                 : rl_error_set(err, RL_ERR_SERVER, 0, "Redis refused to load the rate-limit "
                                "script: %.240s", replies[0]->str ? replies[0]->str : "");
        goto done;
    }
    if (replies[0]->type != REDIS_REPLY_STRING || replies[0]->len != sizeof(RL_SCRIPT_SHA1) - 1 ||
        memcmp(replies[0]->str, RL_SCRIPT_SHA1, replies[0]->len) != 0) {
        st = rl_error_set(err, RL_ERR_PROTOCOL, 0,
                          "unexpected reply to SCRIPT LOAD: %s, expected the script's SHA1",
                          reply_type_name(replies[0]->type));
        goto done;
    }
    *reply = replies[1];
    replies[1] = NULL;
done:
    if (replies[0] != NULL)
        freeReplyObject(replies[0]);
    if (replies[1] != NULL)
        freeReplyObject(replies[1]);
    return st;
}

/* One attempt on one pooled connection: EVALSHA, and SCRIPT LOAD + EVALSHA on NOSCRIPT. */
static rl_status
attempt(rl_pool *pool, const char *command, size_t command_len, const rl_windows *w,
        rl_result *out, rl_error *err)
{
    rl_conn *conn = NULL;
    redisReply *reply = NULL;
    double timeout = pool->config.socket_timeout;
    int reusable = 0;
    rl_status st = rl_pool_acquire(pool, &conn, err);
    if (st != RL_OK)
        return st;

    st = rl_conn_roundtrip(conn, command, command_len, 1, &reply, timeout, err);
    if (st == RL_OK && is_noscript(reply)) {
        /* The script cache is empty (SCRIPT FLUSH, restart, failover): nothing ran. */
        freeReplyObject(reply);
        reply = NULL;
        st = load_and_retry(conn, command, command_len, timeout, &reply, err);
    }
    if (st == RL_OK) {
        st = rl_script_decode(reply, w, out, err);
        /* An error reply leaves the connection in step; garbage does not. */
        reusable = st == RL_OK || st == RL_ERR_SERVER;
    } else if (st == RL_ERR_SERVER) {
        reusable = 1;
    }
    /* Bytes after our reply were never asked for: the connection is out of step. */
    if (reusable && !rl_reader_idle(conn->reader))
        reusable = 0;
    if (reply != NULL)
        freeReplyObject(reply);
    rl_pool_release(pool, conn, reusable);
    if (st == RL_ERR_IO)
        rl_pool_drop_idle(pool); /* a server restart broke them all: reconnect afresh */
    return st;
}

/* The same command with the script's trailing replay marker ("1"): "*N\r\n..." becomes
   "*N+1\r\n...$1\r\n1\r\n". Returns a malloc'd buffer, or NULL. */
char *
rl_script_replay_command(const char *command, size_t command_len, size_t *out_len)
{
    char *end = NULL, *buf;
    long argc;
    char header[32];
    if (command_len < 4 || command[0] != '*')
        return NULL;
    argc = strtol(command + 1, &end, 10);
    if (end == NULL || end[0] != '\r' || end[1] != '\n' || argc < 1)
        return NULL;
    size_t rest = command_len - (size_t)(end + 2 - command);
    int header_len = snprintf(header, sizeof(header), "*%ld\r\n", argc + 1);
    *out_len = (size_t)header_len + rest + 7;
    buf = malloc(*out_len);
    if (buf == NULL)
        return NULL;
    memcpy(buf, header, (size_t)header_len);
    memcpy(buf + header_len, end + 2, rest);
    memcpy(buf + header_len + rest, "$1\r\n1\r\n", 7);
    return buf;
}

rl_status
rl_script_run(rl_pool *pool, const char *command, size_t command_len, const rl_windows *w,
              rl_result *out, rl_error *err)
{
    rl_status st = attempt(pool, command, command_len, w, out, err);
    if (st != RL_ERR_IO)
        return st;
    /* The connection broke mid-call: the script may or may not have run. Replay once on a
       fresh connection, marked, with the same member: if the first attempt logged the
       request the script answers "already counted", so a request is never counted twice.
       Timeouts are not replayed: that would stretch the call past socket_timeout. */
    size_t replay_len = 0;
    char *replay = rl_script_replay_command(command, command_len, &replay_len);
    if (replay == NULL)
        return st;
    st = attempt(pool, replay, replay_len, w, out, err);
    free(replay);
    return st;
}
