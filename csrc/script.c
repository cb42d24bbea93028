/*
 * script.c - the rate-limit script's side of the wire: the EVALSHA command of one
 * decision, its replay form, and the decoding of the script's reply.
 *
 * GIL contract: nothing here touches a Python object or does I/O. rl_script_format runs
 * while the caller still holds the GIL (it is pure C and quick); the decoding runs in the
 * protocol engine (proto.c), with or without the GIL.
 *
 * The replay form: after a connection broke mid-call the call is sent once more with the
 * script's replay marker (proto.c decides when). The member is generated client-side, so
 * the script can tell "already counted" and a request is never counted twice.
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

const char *
rl_script_load_text(size_t *len)
{
    *len = sizeof(rl_script_load_command) - 1;
    return rl_script_load_command;
}

const char *
rl_prepared_bytes(const rl_prepared *p, size_t *len)
{
    if (p->replay != NULL) {
        *len = p->replay_len;
        return p->replay;
    }
    *len = p->command != NULL ? (size_t)p->command_len : 0;
    return p->command;
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

    argv[argc] = "EVALSHA";
    argvlen[argc++] = 7;
    argv[argc] = rl_script_sha1_hex;
    argvlen[argc++] = sizeof(rl_script_sha1_hex) - 1;
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
    argv[argc] = member;
    argvlen[argc++] = RL_MEMBER_LEN;
    if (now_ms >= 0) {
        argvlen[argc] = (size_t)snprintf(now_text, sizeof(now_text), "%lld", now_ms);
        argv[argc++] = now_text;
    } else {
        argv[argc] = "";
        argvlen[argc++] = 0;
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

int
rl_reply_is_error(const redisReply *r, const char *prefix)
{
    size_t n = strlen(prefix);
    return r->type == REDIS_REPLY_ERROR && r->str != NULL && r->len >= n &&
           memcmp(r->str, prefix, n) == 0;
}

const char *
rl_reply_type_name(int type)
{
    switch (type) {
    case REDIS_REPLY_STRING:
        return "a bulk string";
    case REDIS_REPLY_ARRAY:
        return "an array";
    case REDIS_REPLY_INTEGER:
        return "an integer";
    case REDIS_REPLY_NIL:
        return "nil";
    case REDIS_REPLY_STATUS:
        return "a status";
    case REDIS_REPLY_ERROR:
        return "an error";
#ifdef REDIS_REPLY_DOUBLE
    case REDIS_REPLY_DOUBLE:
        return "a double";
#endif
#ifdef REDIS_REPLY_BOOL
    case REDIS_REPLY_BOOL:
        return "a boolean";
#endif
#ifdef REDIS_REPLY_MAP
    case REDIS_REPLY_MAP:
        return "a map";
#endif
#ifdef REDIS_REPLY_SET
    case REDIS_REPLY_SET:
        return "a set";
#endif
#ifdef REDIS_REPLY_ATTR
    case REDIS_REPLY_ATTR:
        return "an attribute";
#endif
#ifdef REDIS_REPLY_PUSH
    case REDIS_REPLY_PUSH:
        return "a push";
#endif
#ifdef REDIS_REPLY_BIGNUM
    case REDIS_REPLY_BIGNUM:
        return "a big number";
#endif
#ifdef REDIS_REPLY_VERB
    case REDIS_REPLY_VERB:
        return "a verbatim string";
#endif
    default:
        return "an unknown type";
    }
}

rl_status
rl_script_decode(const redisReply *reply, const rl_windows *w, rl_result *out, rl_error *err)
{
    int nwindows = w->count;
    if (reply->type == REDIS_REPLY_ERROR) {
        if (rl_reply_is_error(reply, "NOAUTH") || rl_reply_is_error(reply, "WRONGPASS"))
            return rl_error_set(err, RL_ERR_AUTH,
                                "the Redis server requires authentication: put the password "
                                "in the URL (%.120s)",
                                reply->str);
        if (rl_reply_is_error(reply, "OOM"))
            return rl_error_set(err, RL_ERR_SERVER,
                                "Redis is out of memory (used memory > maxmemory, noeviction): "
                                "it refused the request and nothing was written (%.200s)",
                                reply->str);
        return rl_error_set(err, RL_ERR_SERVER,
                            "Redis answered the rate-limit script with an "
                            "error: %.240s",
                            reply->str ? reply->str : "");
    }
    if (reply->type != REDIS_REPLY_ARRAY || reply->elements != 4)
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "unexpected reply to the rate-limit script: %s%s, expected an array "
                            "of 4 integers",
                            rl_reply_type_name(reply->type),
                            reply->type == REDIS_REPLY_ARRAY ? " of another length" : "");
    for (size_t i = 0; i < 4; i++) {
        if (reply->element[i] == NULL || reply->element[i]->type != REDIS_REPLY_INTEGER)
            return rl_error_set(
                err, RL_ERR_PROTOCOL,
                "unexpected reply to the rate-limit script: element %zu is %s, "
                "expected an integer",
                i + 1, reply->element[i] ? rl_reply_type_name(reply->element[i]->type) : "missing");
    }
    long long allowed = reply->element[0]->integer;
    long long remaining = reply->element[1]->integer;
    long long retry = reply->element[2]->integer;
    long long window = reply->element[3]->integer;
    if ((allowed != 0 && allowed != 1) || remaining < 0 || retry < 0 || window < 1 ||
        window > nwindows || (allowed == 1 && (retry != 0 || remaining >= w->limit[window - 1])) ||
        (allowed == 0 && (retry < 1 || remaining != 0)))
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "the rate-limit script answered values out of range "
                            "(%lld, %lld, %lld, %lld)",
                            allowed, remaining, retry, window);
    out->allowed = (int)allowed;
    out->remaining = remaining;
    out->retry_after_s = retry;
    out->window = (int)(window - 1);
    return RL_OK;
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
