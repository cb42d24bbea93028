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
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct {
    const char *sha1;
    const char *source;
    size_t source_len;
    const char *load;
    size_t load_len;
} scripts[RL_SCRIPT_COUNT] = {
    [RL_SCRIPT_WINDOW] = {RL_SCRIPT_SHA1, rl_script_source, sizeof(rl_script_source) - 1,
                          rl_script_load_command, sizeof(rl_script_load_command) - 1},
    [RL_SCRIPT_RECONCILE] = {RL_RECONCILE_SHA1, rl_reconcile_source,
                             sizeof(rl_reconcile_source) - 1, rl_reconcile_load_command,
                             sizeof(rl_reconcile_load_command) - 1},
    [RL_SCRIPT_PEEK] = {RL_PEEK_SHA1, rl_peek_source, sizeof(rl_peek_source) - 1,
                        rl_peek_load_command, sizeof(rl_peek_load_command) - 1},
    [RL_SCRIPT_RESET] = {RL_RESET_SHA1, rl_reset_source, sizeof(rl_reset_source) - 1,
                         rl_reset_load_command, sizeof(rl_reset_load_command) - 1},
    [RL_SCRIPT_LEASE] = {RL_LEASE_SHA1, rl_lease_source, sizeof(rl_lease_source) - 1,
                         rl_lease_load_command, sizeof(rl_lease_load_command) - 1},
    [RL_SCRIPT_COMPACT_WINDOW] = {RL_COMPACT_SHA1, rl_compact_source, sizeof(rl_compact_source) - 1,
                                  rl_compact_load_command, sizeof(rl_compact_load_command) - 1},
    [RL_SCRIPT_COMPACT_RECONCILE] = {RL_COMPACT_RECONCILE_SHA1, rl_compact_reconcile_source,
                                     sizeof(rl_compact_reconcile_source) - 1,
                                     rl_compact_reconcile_load_command,
                                     sizeof(rl_compact_reconcile_load_command) - 1},
    [RL_SCRIPT_COMPACT_PEEK] = {RL_COMPACT_PEEK_SHA1, rl_compact_peek_source,
                                sizeof(rl_compact_peek_source) - 1, rl_compact_peek_load_command,
                                sizeof(rl_compact_peek_load_command) - 1},
    [RL_SCRIPT_IN_FLIGHT] = {RL_IN_FLIGHT_SHA1, rl_in_flight_source,
                             sizeof(rl_in_flight_source) - 1, rl_in_flight_load_command,
                             sizeof(rl_in_flight_load_command) - 1},
    [RL_SCRIPT_RECONCILE_RELEASE] = {RL_RECONCILE_RELEASE_SHA1, rl_reconcile_release_source,
                                     sizeof(rl_reconcile_release_source) - 1,
                                     rl_reconcile_release_load_command,
                                     sizeof(rl_reconcile_release_load_command) - 1},
    [RL_SCRIPT_COMPACT_IN_FLIGHT] = {RL_COMPACT_IN_FLIGHT_SHA1, rl_compact_in_flight_source,
                                     sizeof(rl_compact_in_flight_source) - 1,
                                     rl_compact_in_flight_load_command,
                                     sizeof(rl_compact_in_flight_load_command) - 1},
    [RL_SCRIPT_COMPACT_RECONCILE_RELEASE] = {RL_COMPACT_RECONCILE_RELEASE_SHA1,
                                             rl_compact_reconcile_release_source,
                                             sizeof(rl_compact_reconcile_release_source) - 1,
                                             rl_compact_reconcile_release_load_command,
                                             sizeof(rl_compact_reconcile_release_load_command) - 1},
    [RL_SCRIPT_GCRA] = {RL_GCRA_SHA1, rl_gcra_source, sizeof(rl_gcra_source) - 1,
                        rl_gcra_load_command, sizeof(rl_gcra_load_command) - 1},
    [RL_SCRIPT_GCRA_WINDOWS] = {RL_GCRA_WINDOWS_SHA1, rl_gcra_windows_source,
                                sizeof(rl_gcra_windows_source) - 1, rl_gcra_windows_load_command,
                                sizeof(rl_gcra_windows_load_command) - 1},
    [RL_SCRIPT_COMPACT_GCRA_WINDOWS] = {RL_COMPACT_GCRA_WINDOWS_SHA1,
                                        rl_compact_gcra_windows_source,
                                        sizeof(rl_compact_gcra_windows_source) - 1,
                                        rl_compact_gcra_windows_load_command,
                                        sizeof(rl_compact_gcra_windows_load_command) - 1},
    [RL_SCRIPT_BUDGET_HOLD] = {RL_BUDGET_HOLD_SHA1, rl_budget_hold_source,
                               sizeof(rl_budget_hold_source) - 1, rl_budget_hold_load_command,
                               sizeof(rl_budget_hold_load_command) - 1},
    [RL_SCRIPT_BUDGET_SETTLE] = {RL_BUDGET_SETTLE_SHA1, rl_budget_settle_source,
                                 sizeof(rl_budget_settle_source) - 1, rl_budget_settle_load_command,
                                 sizeof(rl_budget_settle_load_command) - 1},
    [RL_SCRIPT_OBSERVE] = {RL_OBSERVE_SHA1, rl_observe_source, sizeof(rl_observe_source) - 1,
                           rl_observe_load_command, sizeof(rl_observe_load_command) - 1},
    [RL_SCRIPT_QUEUE] = {RL_QUEUE_SHA1, rl_queue_source, sizeof(rl_queue_source) - 1,
                         rl_queue_load_command, sizeof(rl_queue_load_command) - 1},
};

rl_script_id
rl_script_of(rl_script_id script, rl_storage storage)
{
    if (storage != RL_STORAGE_COMPACT)
        return script;
    switch (script) {
    case RL_SCRIPT_WINDOW:
        return RL_SCRIPT_COMPACT_WINDOW;
    case RL_SCRIPT_RECONCILE:
        return RL_SCRIPT_COMPACT_RECONCILE;
    case RL_SCRIPT_PEEK:
        return RL_SCRIPT_COMPACT_PEEK;
    case RL_SCRIPT_IN_FLIGHT:
        return RL_SCRIPT_COMPACT_IN_FLIGHT;
    case RL_SCRIPT_RECONCILE_RELEASE:
        return RL_SCRIPT_COMPACT_RECONCILE_RELEASE;
    case RL_SCRIPT_GCRA_WINDOWS:
        return RL_SCRIPT_COMPACT_GCRA_WINDOWS;
    default: /* reset reads either storage; leases are sorted sets in both */
        return script;
    }
}

int
rl_script_decides(rl_script_id script)
{
    return script == RL_SCRIPT_WINDOW || script == RL_SCRIPT_COMPACT_WINDOW ||
           script == RL_SCRIPT_IN_FLIGHT || script == RL_SCRIPT_COMPACT_IN_FLIGHT ||
           script == RL_SCRIPT_GCRA || rl_script_gcra_windows(script);
}

int
rl_script_gcra_windows(rl_script_id script)
{
    return script == RL_SCRIPT_GCRA_WINDOWS || script == RL_SCRIPT_COMPACT_GCRA_WINDOWS;
}

int
rl_script_peeks(rl_script_id script)
{
    return script == RL_SCRIPT_PEEK || script == RL_SCRIPT_COMPACT_PEEK;
}

int
rl_script_reconciles(rl_script_id script)
{
    return script == RL_SCRIPT_RECONCILE || script == RL_SCRIPT_COMPACT_RECONCILE ||
           script == RL_SCRIPT_RECONCILE_RELEASE || script == RL_SCRIPT_COMPACT_RECONCILE_RELEASE;
}

int
rl_script_holds_slot(rl_script_id script)
{
    return script == RL_SCRIPT_IN_FLIGHT || script == RL_SCRIPT_COMPACT_IN_FLIGHT ||
           script == RL_SCRIPT_RECONCILE_RELEASE || script == RL_SCRIPT_COMPACT_RECONCILE_RELEASE;
}

const char *
rl_script_sha1(rl_script_id id)
{
    return scripts[id].sha1;
}

const char *
rl_script_source_text(rl_script_id id, size_t *len)
{
    *len = scripts[id].source_len;
    return scripts[id].source;
}

const char *
rl_script_load_text(rl_script_id id, size_t *len)
{
    *len = scripts[id].load_len;
    return scripts[id].load;
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
#define RL_STACK_ARENA 4096
#define RL_KEY_SUFFIXES 12   /* ":tokens" + a companion's (":w", ":t") */
#define RL_SCOPE_SUFFIX 8    /* ":scope=" or ":shared" (the name is counted apart) */
#define RL_SCAN_COUNT "1000" /* reset.lua: keys one SCAN step looks at */

/* Writes text with SCAN's glob characters escaped, then "*". Returns its length. */
static size_t
glob_prefix(char *out, const char *text, size_t len)
{
    char *cursor = out;
    for (size_t i = 0; i < len; i++) {
        if (strchr("*?[]\\", text[i]) != NULL && text[i] != '\0')
            *cursor++ = '\\';
        *cursor++ = text[i];
    }
    *cursor++ = '*';
    return (size_t)(cursor - out);
}

/* Writes "{prefix}:{user_id}" at cursor and returns the end (on a Redis Cluster the user
   id in a hash tag, rl_key_user: "ratelimit:{user_8421}"): the one place that shapes the
   user's part of every key (the callers append ":{window_seconds}", ":leases", ...). A
   shared scope's name takes the user's place in its keys (window_key), through here too. */
static char *
write_user_key(char *cursor, const char *prefix, size_t prefix_len, const char *user,
               size_t user_len, int hash_tag)
{
    memcpy(cursor, prefix, prefix_len);
    cursor += prefix_len;
    *cursor++ = ':';
    return cursor + rl_key_user(cursor, user, user_len, hash_tag); /* "{user}" on a cluster */
}

/* Writes text at cursor with '%', '{' and '}' percent-encoded (upper-case hex), and ':' too
   when `colon`; returns the end. At most 3 bytes per byte of text. The one encoding of a
   user id in a hash tag (colon 0) and of a scope's or a budget's name (colon 1), which
   rl_key_unescape reads back. */
static char *
percent_encode(char *cursor, const char *text, size_t len, int colon)
{
    static const char hex[] = "0123456789ABCDEF";
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)text[i];
        if (c == '%' || c == '{' || c == '}' || (colon && c == ':')) {
            *cursor++ = '%';
            *cursor++ = hex[c >> 4];
            *cursor++ = hex[c & 15];
        } else {
            *cursor++ = (char)c;
        }
    }
    return cursor;
}

/* Writes the key of window i of d into out (room: see rl_script_format) and returns its
   length. The one place that names a window's sorted set:

     the user's own window    {prefix}:{user_id}:{window_seconds}[:tokens]
     a scope of the user      {prefix}:{user_id}:{window_seconds}[:tokens]:scope={name}
     a shared scope           {prefix}:{name}:{window_seconds}[:tokens]:shared

   with ":w" after any of them for its weights and ":t" for their running totals. A key
   reads from its end: the last field is "w" (weights), "t" (totals) or neither, then
   "shared", "scope=..." or neither, then "tokens" or not, then the window's digits; what
   is left after "{prefix}:" is the owner. In "scope=" the name's '%', ':', '{' and '}'
   are percent-encoded, so it holds no ':' and two names never meet. Every field the
   reading takes from the end differs between the kinds (digits, "tokens", "scope=...",
   "shared", "w", "t" are pairwise distinct), so no user id and no scope name can
   make one kind's key equal another's: a user "openai/gpt-4o" and the shared scope
   "openai/gpt-4o" differ by ":shared", a user's scope named "shared" is ":scope=shared". */
static size_t
window_key(char *out, const char *prefix, size_t prefix_len, const char *user, size_t user_len,
           const rl_prepared *d, int i)
{
    const rl_windows *w = &d->windows;
    const rl_scope *scope = w->scope[i] ? &d->scopes[w->scope[i] - 1] : NULL;
    const char *owner = user;
    size_t owner_len = user_len;
    char *cursor = out;
    if (scope != NULL && scope->shared) {
        owner = scope->name;
        owner_len = scope->name_len;
    }
    cursor = write_user_key(cursor, prefix, prefix_len, owner, owner_len, d->hash_tag);
    cursor += snprintf(cursor, RL_NUMBER_TEXT, ":%lld", w->seconds[i]);
    if (w->tokens[i]) {
        memcpy(cursor, ":tokens", 7);
        cursor += 7;
    }
    if (scope != NULL && scope->shared) {
        memcpy(cursor, ":shared", 7);
        cursor += 7;
    } else if (scope != NULL) {
        memcpy(cursor, ":scope=", 7);
        cursor += 7;
        cursor = percent_encode(cursor, scope->name, scope->name_len, 1);
    }
    return (size_t)(cursor - out);
}

static const char *const lease_ops[] = {
    [RL_SHAPE_ACQUIRE] = "acquire", [RL_SHAPE_RELEASE] = "release", [RL_SHAPE_RENEW] = "renew"};

/* Writes "{prefix}:{owner}{suffix}" at cursor, then that key followed by `companion` right
   after it; sets the two lengths and returns the end. Room: twice prefix_len + 1 +
   rl_key_user_room(owner_len) + strlen(suffix), + strlen(companion). The one writer of a key
   and its companion: a user's leases (":leases", ":stats", see lua/lib/lease.lua; last field
   "leases" or "stats": never a window's (a number), "tokens", "w", "t" or "c") and a shared
   scope's wait queue (":queue", ":h": lib/queue.lua's sorted set and hash; never a window's,
   a view's, nor a user's other keys). */
static char *
write_key_pair(char *cursor, const char *prefix, size_t prefix_len, const char *owner,
               size_t owner_len, int hash_tag, const char *suffix, const char *companion,
               size_t *first_len, size_t *second_len)
{
    const size_t suffix_len = strlen(suffix), companion_len = strlen(companion);
    char *first = cursor;
    cursor = write_user_key(cursor, prefix, prefix_len, owner, owner_len, hash_tag);
    memcpy(cursor, suffix, suffix_len);
    cursor += suffix_len;
    *first_len = (size_t)(cursor - first);
    memcpy(cursor, first, *first_len);
    cursor += *first_len;
    memcpy(cursor, companion, companion_len);
    *second_len = *first_len + companion_len;
    return cursor + companion_len;
}

/* The most keys, words and numbers of format_script_call's scripts. */
#define RL_CALL_KEYS 2
#define RL_CALL_WORDS 2
#define RL_CALL_NUMBERS 8
_Static_assert(RL_QUEUE_FIELDS <= RL_CALL_NUMBERS && RL_UPSTREAM_FIELDS <= RL_CALL_NUMBERS,
               "format_script_call's numbers");

/* Formats "EVALSHA sha nkeys keys... now words... numbers..." for the scripts whose
   arguments are keys, the time ("" when now_ms < 0: the server's clock), a few strings and
   a few integers in decimal (lua/gcra.lua, lua/wait_queue.lua, lua/observe_upstream.lua).
   The keys and words are borrowed. Returns the length and sets *out (the caller frees it),
   or -1 (out of memory, or more arguments than the RL_CALL_ bounds). */
static long long
format_script_call(rl_script_id script, int nkeys, const char *const keys[], const size_t keylens[],
                   long long now_ms, int nwords, const char *const words[], int nnumbers,
                   const long long numbers[], char **out)
{
    char nkeys_text[RL_NUMBER_TEXT], now_text[RL_NUMBER_TEXT];
    char texts[RL_CALL_NUMBERS][RL_NUMBER_TEXT];
    const char *argv[4 + RL_CALL_KEYS + RL_CALL_WORDS + RL_CALL_NUMBERS];
    size_t argvlen[4 + RL_CALL_KEYS + RL_CALL_WORDS + RL_CALL_NUMBERS];
    int argc = 0;
    long long len;

    *out = NULL;
    if (nkeys > RL_CALL_KEYS || nwords > RL_CALL_WORDS || nnumbers > RL_CALL_NUMBERS)
        return -1;
    argv[argc] = "EVALSHA";
    argvlen[argc++] = 7;
    argv[argc] = rl_script_sha1(script);
    argvlen[argc] = strlen(argv[argc]);
    argc++;
    argvlen[argc] = (size_t)snprintf(nkeys_text, sizeof(nkeys_text), "%d", nkeys);
    argv[argc++] = nkeys_text;
    for (int i = 0; i < nkeys; i++) {
        argv[argc] = keys[i];
        argvlen[argc++] = keylens[i];
    }
    argvlen[argc] = now_ms >= 0 ? (size_t)snprintf(now_text, sizeof(now_text), "%lld", now_ms) : 0;
    argv[argc++] = now_ms >= 0 ? now_text : "";
    for (int i = 0; i < nwords; i++) {
        argv[argc] = words[i];
        argvlen[argc++] = strlen(words[i]);
    }
    for (int i = 0; i < nnumbers; i++) {
        argvlen[argc] = (size_t)snprintf(texts[i], RL_NUMBER_TEXT, "%lld", numbers[i]);
        argv[argc++] = texts[i];
    }
    len = redisFormatCommandArgv(out, argc, argv, argvlen);
    if (len < 0 || *out == NULL) {
        *out = NULL;
        return -1;
    }
    return len;
}

/* Formats "EVALSHA sha 4 {prefix}:{user_id}:leases {prefix}:{user_id}:leases:stats
   {prefix}:{user_id}:leases:queue {prefix}:{user_id}:leases:queue:h op id now limit lease_ms
   [shares]" (see the header of lua/lease.lua: the last two keys are the in-flight cap's wait
   queue, lib/queue.lua's; shares: an acquire's reserved-shares spec, lua/lib/shares.lua).
   Returns the length and sets *out, or -1 (out of memory). */
static long long
format_lease(const char *prefix, size_t prefix_len, const char *user, size_t user_len,
             const rl_prepared *d, long long now_ms, char **out)
{
    char stack_key[RL_STACK_ARENA], *key = stack_key, *cursor;
    char now_text[RL_NUMBER_TEXT], limit_text[RL_NUMBER_TEXT], ms_text[RL_NUMBER_TEXT];
    size_t need = 4 * (prefix_len + 1 + rl_key_user_room(user_len) + 16);
    const char *argv[13];
    size_t argvlen[13];
    int argc = 12;
    long long len;

    *out = NULL;
    if (need > sizeof(stack_key) && (key = malloc(need)) == NULL)
        return -1;
    cursor = write_key_pair(key, prefix, prefix_len, user, user_len, d->hash_tag, ":leases",
                            ":stats", &argvlen[3], &argvlen[4]);
    write_key_pair(cursor, prefix, prefix_len, user, user_len, d->hash_tag, ":leases:queue", ":h",
                   &argvlen[5], &argvlen[6]);
    argv[0] = "EVALSHA";
    argvlen[0] = 7;
    argv[1] = rl_script_sha1(RL_SCRIPT_LEASE);
    argvlen[1] = strlen(argv[1]);
    argv[2] = "4";
    argvlen[2] = 1;
    argv[3] = key;
    argv[4] = key + argvlen[3];
    argv[5] = cursor;
    argv[6] = cursor + argvlen[5];
    argv[7] = lease_ops[d->shape];
    argvlen[7] = strlen(argv[7]);
    argv[8] = d->member;
    argvlen[8] = strlen(d->member);
    argvlen[9] = now_ms >= 0 ? (size_t)snprintf(now_text, sizeof(now_text), "%lld", now_ms) : 0;
    argv[9] = now_ms >= 0 ? now_text : "";
    argvlen[10] = (size_t)snprintf(limit_text, sizeof(limit_text), "%lld", d->lease_limit);
    argv[10] = limit_text;
    argvlen[11] = (size_t)snprintf(ms_text, sizeof(ms_text), "%lld", d->lease_ms);
    argv[11] = ms_text;
    if (d->shape == RL_SHAPE_ACQUIRE && d->shares_len > 0 && d->shares != NULL) {
        argv[argc] = d->shares;
        argvlen[argc++] = d->shares_len;
    }
    len = redisFormatCommandArgv(out, argc, argv, argvlen);
    if (key != stack_key)
        free(key);
    if (len < 0 || *out == NULL) {
        *out = NULL;
        return -1;
    }
    return len;
}

/* Formats "EVALSHA sha 1 {prefix}:{user_id}:{period_seconds}:gcra now interval scale burst
   cost" (see the header of lua/gcra.lua). The key's last field "gcra" is never a window's
   (digits, "tokens", "scope=...", "shared", "w", "t", "c") nor "leases", and reset.lua's
   SCAN leaves it alone. Returns the length and sets *out, or -1 (out of memory). */
static long long
format_gcra(const char *prefix, size_t prefix_len, const char *user, size_t user_len,
            const rl_prepared *d, long long now_ms, char **out)
{
    char stack_key[RL_STACK_ARENA], *key = stack_key, *end;
    const long long values[4] = {d->gcra_units, d->gcra_scale, d->windows.limit[0],
                                 d->windows.cost[0]};
    size_t need = prefix_len + 1 + rl_key_user_room(user_len) + RL_NUMBER_TEXT + 6;
    long long len;

    *out = NULL;
    if (need > sizeof(stack_key) && (key = malloc(need)) == NULL)
        return -1;
    end = write_user_key(key, prefix, prefix_len, user, user_len, d->hash_tag);
    end += snprintf(end, RL_NUMBER_TEXT, ":%lld", d->windows.seconds[0]);
    memcpy(end, ":gcra", 5);
    end += 5;
    const char *keys[1] = {key};
    const size_t keylens[1] = {(size_t)(end - key)};
    len = format_script_call(RL_SCRIPT_GCRA, 1, keys, keylens, now_ms, 0, NULL, 4, values, out);
    if (key != stack_key)
        free(key);
    return len;
}

/* Writes the key of budget b in the period starting at start_ms into out (room:
   budget_key_room) and returns its length. The one place that names a calendar budget's
   hash (lua/lib/budget.lua):

     {prefix}:{owner}:{period_start_ms}:budget={name}

   with the name's '%', ':', '{' and '}' percent-encoded as a scope's (window_key). Its last
   field starts with "budget=" and holds no ':', so it is never a window's (digits,
   "tokens", "scope=...", "shared", "w", "t", "c"), a GCRA bucket's ("gcra") nor a lease
   key's ("leases", "stats"): the key reader takes it for no window. */
static size_t
budget_key(char *out, const char *prefix, size_t prefix_len, const rl_budget *b, int hash_tag,
           long long start_ms)
{
    char *cursor = write_user_key(out, prefix, prefix_len, b->owner, b->owner_len, hash_tag);
    cursor += snprintf(cursor, RL_NUMBER_TEXT, ":%lld", start_ms);
    memcpy(cursor, ":budget=", 8);
    cursor += 8;
    cursor = percent_encode(cursor, b->name, b->name_len, 1);
    return (size_t)(cursor - out);
}

static size_t
budget_key_room(size_t prefix_len, const rl_budget *b)
{
    return prefix_len + 1 + rl_key_user_room(b->owner_len) + RL_NUMBER_TEXT + 8 + 3 * b->name_len;
}

#define RL_BUDGET_ARGV (7 + 10 * RL_MAX_BUDGETS)

/* Formats a hold, "EVALSHA sha 3n keys... id now hold_ms (limit amount previous start end
   next thresholds)..." (the header of lua/budget_hold.lua), or a settle, "EVALSHA sha n
   keys... id (actual limit thresholds)..." (lua/budget_settle.lua). Returns the length and sets *out, or -1 (out of
   memory). now_ms < 0 passes "" so the script reads the server's clock. */
static long long
format_budgets(const char *prefix, size_t prefix_len, const rl_prepared *d, long long now_ms,
               char **out)
{
    const int hold = d->script == RL_SCRIPT_BUDGET_HOLD, per_key = hold ? 3 : 1;
    const int n = d->nbudgets, nkeys = per_key * n;
    const char *argv[RL_BUDGET_ARGV];
    size_t argvlen[RL_BUDGET_ARGV];
    char numbers[3 + 7 * RL_MAX_BUDGETS][RL_NUMBER_TEXT];
    char *arena, *cursor;
    size_t need = 0;
    int argc = 0, used = 0;
    long long len;

    *out = NULL;
    for (int k = 0; k < n; k++)
        need += (size_t)per_key * budget_key_room(prefix_len, &d->budgets[k]);
    if ((arena = malloc(need)) == NULL)
        return -1;
    cursor = arena;
    argv[argc] = "EVALSHA";
    argvlen[argc++] = 7;
    argv[argc] = rl_script_sha1(d->script);
    argvlen[argc++] = strlen(argv[1]);
    argvlen[argc] = (size_t)snprintf(numbers[used], RL_NUMBER_TEXT, "%d", nkeys);
    argv[argc++] = numbers[used++];
    for (int k = 0; k < n; k++) {
        const rl_budget *b = &d->budgets[k];
        for (int j = 0; j < per_key; j++) {
            /* hold: the previous, current and next period (starts: bounds 0, 1, 2) */
            argvlen[argc] = budget_key(cursor, prefix, prefix_len, b, d->hash_tag, b->bounds[j]);
            argv[argc++] = cursor;
            cursor += argvlen[argc - 1];
        }
    }
    argv[argc] = d->member;
    argvlen[argc++] = strlen(d->member);
    if (hold) {
        argvlen[argc] =
            now_ms >= 0 ? (size_t)snprintf(numbers[used], RL_NUMBER_TEXT, "%lld", now_ms) : 0;
        argv[argc++] = now_ms >= 0 ? numbers[used++] : "";
        argvlen[argc] = (size_t)snprintf(numbers[used], RL_NUMBER_TEXT, "%lld", d->hold_ms);
        argv[argc++] = numbers[used++];
    }
    for (int k = 0; k < n; k++) {
        const rl_budget *b = &d->budgets[k];
        const long long hold_values[7] = {b->limit,     b->amount,    b->bounds[0], b->bounds[1],
                                          b->bounds[2], b->bounds[3], b->thresholds};
        const long long settle_values[3] = {b->amount, b->limit, b->thresholds};
        const long long *values = hold ? hold_values : settle_values;
        for (int j = 0; j < (hold ? 7 : 3); j++) {
            argvlen[argc] = (size_t)snprintf(numbers[used], RL_NUMBER_TEXT, "%lld", values[j]);
            argv[argc++] = numbers[used++];
        }
    }
    len = redisFormatCommandArgv(out, argc, argv, argvlen);
    free(arena);
    if (len < 0 || *out == NULL) {
        *out = NULL;
        return -1;
    }
    return len;
}

/* Writes a shared scope's upstream view key "{prefix}:{name}:upstream" at cursor (the
   name where a user's id would be, as its windows' keys have it: the same hash tag) and
   returns the end. Room: prefix_len + 1 + rl_key_user_room(name_len) + 9. Last field
   "upstream": never a window's (digits, "tokens", "scope=...", "shared"), nor "w", "t",
   "c", "leases", "stats" or "gcra". */
static char *
write_upstream_key(char *cursor, const char *prefix, size_t prefix_len, const char *name,
                   size_t name_len, int hash_tag)
{
    cursor = write_user_key(cursor, prefix, prefix_len, name, name_len, hash_tag);
    memcpy(cursor, ":upstream", 9);
    return cursor + 9;
}

/* Formats "EVALSHA sha 2 {prefix}:{name}:queue {prefix}:{name}:queue:h now ticket tenant
   wait_ms max_queue max_tenant weight class" (lua/wait_queue.lua); the upstream's name is the call's
   user. With d->queue_leases, the in-flight cap's queue: "{name}:leases:queue" (and ":h"). Returns the length and sets *out, or -1 (out of memory). */
static long long
format_queue(const char *prefix, size_t prefix_len, const char *user, size_t user_len,
             const rl_prepared *d, long long now_ms, char **out)
{
    char stack_key[RL_STACK_ARENA], *key = stack_key;
    size_t need = 2 * (prefix_len + 1 + rl_key_user_room(user_len) + 16);
    size_t keylens[2];
    long long len;

    *out = NULL;
    if (need > sizeof(stack_key) && (key = malloc(need)) == NULL)
        return -1;
    write_key_pair(key, prefix, prefix_len, user, user_len, d->hash_tag,
                   d->queue_leases ? ":leases:queue" : ":queue", ":h", &keylens[0], &keylens[1]);
    const char *keys[2] = {key, key + keylens[0]};
    const char *words[2] = {d->member, d->tenant};
    len = format_script_call(RL_SCRIPT_QUEUE, 2, keys, keylens, now_ms, 2, words, RL_QUEUE_FIELDS,
                             d->queue, out);
    if (key != stack_key)
        free(key);
    return len;
}

/* Formats "EVALSHA sha 1 {prefix}:{name}:upstream now" and the observation's numbers (see
   the header of lua/observe_upstream.lua); the upstream's name is the call's user. Returns the length and sets *out, or -1 (out of memory). */
static long long
format_observe(const char *prefix, size_t prefix_len, const char *user, size_t user_len,
               const rl_prepared *d, long long now_ms, char **out)
{
    char stack_key[RL_STACK_ARENA], *key = stack_key, *end;
    size_t need = prefix_len + 1 + rl_key_user_room(user_len) + 9;
    long long len;

    *out = NULL;
    if (need > sizeof(stack_key) && (key = malloc(need)) == NULL)
        return -1;
    end = write_upstream_key(key, prefix, prefix_len, user, user_len, d->hash_tag);
    const char *keys[1] = {key};
    const size_t keylens[1] = {(size_t)(end - key)};
    len = format_script_call(RL_SCRIPT_OBSERVE, 1, keys, keylens, now_ms, 0, NULL,
                             RL_UPSTREAM_FIELDS, d->upstream, out);
    if (key != stack_key)
        free(key);
    return len;
}

size_t
rl_key_user(char *out, const char *user, size_t user_len, int hash_tag)
{
    char *cursor = out;
    if (!hash_tag) {
        memcpy(out, user, user_len);
        return user_len;
    }
    /* The tag ends at the first '}': an id's own '}' would cut it short (ids "a" and
       "a}b" would share a slot, and "a}" a tag with others). Percent-encoding '%', '{' and
       '}' keeps the map from ids to tags one-to-one; ids without them are unchanged. */
    *cursor++ = '{';
    cursor = percent_encode(cursor, user, user_len, 0);
    *cursor++ = '}';
    return (size_t)(cursor - out);
}

/* Whether the len bytes at text end with the NUL-terminated suffix. */
static int
ends_with(const char *text, size_t len, const char *suffix)
{
    size_t n = strlen(suffix);
    return len >= n && memcmp(text + len - n, suffix, n) == 0;
}

int
rl_key_read(const char *name, size_t len, const char *prefix, size_t prefix_len, int hash_tag,
            rl_key_reading *out)
{
    const char *rest, *digits;
    size_t rest_len, digits_len;
    long long seconds = 0;

    memset(out, 0, sizeof(*out));
    if (len <= prefix_len || memcmp(name, prefix, prefix_len) != 0 || name[prefix_len] != ':')
        return -1;
    rest = name + prefix_len + 1;
    rest_len = len - prefix_len - 1;
    if (hash_tag) { /* "{owner}:...": the tag ends at the first '}' (rl_key_user) */
        const char *end = memchr(rest, '}', rest_len);
        if (rest_len == 0 || rest[0] != '{' || end == NULL ||
            (size_t)(end - rest) + 1 >= rest_len || end[1] != ':')
            return -1;
        out->owner = rest + 1;
        out->owner_len = (size_t)(end - rest) - 1;
        rest_len -= (size_t)(end - rest) + 2;
        rest = end + 2;
    }
    /* write_key_pair: "{owner}:leases" (its ":stats" companion is no key of the reading). */
    if ((rest_len == 6 && memcmp(rest, "leases", 6) == 0) || ends_with(rest, rest_len, ":leases")) {
        if (!hash_tag) {
            out->owner = rest;
            out->owner_len = rest_len > 7 ? rest_len - 7 : 0;
        } else if (rest_len != 6) {
            return -1;
        }
        out->kind = RL_KEY_LEASES;
        return out->owner_len > 0 ? 0 : -1;
    }
    /* budget_key: "{owner}:{period_start_ms}:budget={name}", a calendar budget: its last
       field starts with "budget=" (no window's does) and holds no ':'; the start's digits
       are read as a window's seconds, the name as a scope's. */
    for (size_t i = rest_len; i > 0; i--) {
        if (rest[i - 1] != ':')
            continue;
        if (rest_len - i > 7 && memcmp(rest + i, "budget=", 7) == 0) {
            out->kind = RL_KEY_BUDGET;
            out->scope = rest + i + 7;
            out->scope_len = rest_len - i - 7;
            rest_len = i - 1;
        }
        break;
    }
    /* format_gcra: "{owner}:{seconds}:gcra", a GCRA bucket: the digits and the owner, as a
       window's (no window key ends in ":gcra": a scope's name has its ':' encoded). */
    if (out->kind == RL_KEY_BUDGET) {
        /* nothing but the digits and the owner are left */
    } else if (ends_with(rest, rest_len, ":gcra")) {
        out->kind = RL_KEY_GCRA;
        rest_len -= 5;
    } else if (ends_with(rest, rest_len, ":w") || ends_with(rest, rest_len, ":c")) {
        /* window_key, read from its end: the storage's suffix, "shared" or "scope=",
           "tokens", the digits; what is left is the owner. */
        out->suffix = rest[rest_len - 1];
        rest_len -= 2;
    }
    if (out->kind == RL_KEY_GCRA || out->kind == RL_KEY_BUDGET) {
        /* nothing but the digits and the owner */
    } else if (ends_with(rest, rest_len, ":shared")) {
        out->kind = RL_KEY_SHARED;
        rest_len -= 7;
    } else {
        for (size_t i = rest_len; i >= 7; i--) { /* the last ":scope=", whose name has no ':' */
            if (memcmp(rest + i - 7, ":scope=", 7) == 0) {
                out->scope = rest + i;
                out->scope_len = rest_len - i;
                if (out->scope_len == 0)
                    return -1;
                out->kind = RL_KEY_SCOPE;
                rest_len = i - 7;
                break;
            }
            if (rest[i - 1] == ':')
                break;
        }
    }
    if (out->kind != RL_KEY_GCRA && out->kind != RL_KEY_BUDGET &&
        ends_with(rest, rest_len, ":tokens")) {
        out->tokens = 1;
        rest_len -= 7;
    }
    digits = rest;
    digits_len = rest_len;
    if (!hash_tag) {
        const char *colon = NULL;
        for (size_t i = rest_len; i > 0 && colon == NULL; i--)
            if (rest[i - 1] == ':')
                colon = rest + i - 1;
        if (colon == NULL || colon == rest)
            return -1;
        out->owner = rest;
        out->owner_len = (size_t)(colon - rest);
        digits = colon + 1;
        digits_len = rest_len - out->owner_len - 1;
    }
    if (digits_len == 0)
        return -1;
    for (size_t i = 0; i < digits_len; i++) {
        if (digits[i] < '0' || digits[i] > '9' || seconds > (LLONG_MAX - (digits[i] - '0')) / 10)
            return -1; /* not a number of seconds, or one beyond LLONG_MAX */
        seconds = seconds * 10 + (digits[i] - '0');
    }
    out->seconds = seconds;
    return seconds >= 1 ? 0 : -1;
}

size_t
rl_key_unescape(char *out, const char *text, size_t len)
{
    static const char hex[] = "0123456789ABCDEF";
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        const char *high = NULL, *low = NULL;
        if (text[i] == '%' && i + 2 < len) {
            high = memchr(hex, text[i + 1], 16);
            low = memchr(hex, text[i + 2], 16);
        }
        if (high != NULL && low != NULL) {
            out[n++] = (char)((high - hex) << 4 | (low - hex));
            i += 2;
        } else {
            out[n++] = text[i];
        }
    }
    return n;
}

/* The keys of one window, per storage: in the sorted-set storage (lib/zset_log.lua) the
   window's set, its weights and its running totals, in that order in KEYS (every window's
   set, then every window's weights, then every window's totals); in the compact storage
   (lib/compact_log.lua) one string. Each is the window's key and a suffix whose last field
   ("w", "t", "c") is never a window key's own (digits, "tokens", "scope=...", "shared")
   nor "leases": a window of one storage never meets one of the other. */
static const struct {
    int count;
    const char *suffix[3];
} window_keys[] = {
    [RL_STORAGE_ZSET] = {3, {"", ":w", ":t"}},
    [RL_STORAGE_COMPACT] = {1, {":c", NULL, NULL}},
};
#define RL_ARGV_MAX (13 + 6 * RL_MAX_WINDOWS + RL_MAX_SCOPES)

/* Formats "EVALSHA sha 3n key... weights... totals... ARGV..." with hiredis (see the
   KEYS/ARGV headers of lua/sliding_window.lua and lua/reconcile.lua). Returns the
   command's length and sets *out (free with redisFreeCommand), or -1 when out of memory.
   now_ms < 0 passes "" so the script reads the server's clock. */
long long
rl_script_format(const char *prefix, size_t prefix_len, const char *user, size_t user_len,
                 const rl_prepared *d, long long now_ms, char **out)
{
    const rl_windows *w = &d->windows;
    const char *argv[RL_ARGV_MAX];
    size_t argvlen[RL_ARGV_MAX];
    char stack_arena[RL_STACK_ARENA];
    char *arena = stack_arena, *cursor;
    char numkeys[RL_NUMBER_TEXT], now_text[RL_NUMBER_TEXT], score_text[RL_NUMBER_TEXT],
        cost_text[RL_NUMBER_TEXT], windows_text[RL_NUMBER_TEXT], tie_text[RL_NUMBER_TEXT],
        limit_text[RL_NUMBER_TEXT], lease_text[RL_NUMBER_TEXT];
    const int per_window = window_keys[d->storage].count;
    /* the leases key and its stats key, last */
    const int slot_keys = 2 * rl_script_holds_slot(d->script);
    /* reconcile_release.lua wakes the in-flight cap's waiters (lib/queue.lua's queue_wake):
       the cap's wait queue, its two keys before the leases' */
    const int release_queue = 2 * (d->script == RL_SCRIPT_RECONCILE_RELEASE ||
                                   d->script == RL_SCRIPT_COMPACT_RECONCILE_RELEASE);
    /* with gcra=: window 0 is the bucket, whose one key and four values come last */
    const int first = rl_script_gcra_windows(d->script);
    size_t owner_len = user_len, scope_room = 0;
    for (int k = 0; k < d->nscopes; k++) {
        if (d->scopes[k].name_len > owner_len)
            owner_len = d->scopes[k].name_len;
        if (RL_SCOPE_SUFFIX + 3 * d->scopes[k].name_len > scope_room)
            scope_room = RL_SCOPE_SUFFIX + 3 * d->scopes[k].name_len;
    }
    size_t key_room = prefix_len + 1 + rl_key_user_room(owner_len) + RL_NUMBER_TEXT +
                      RL_KEY_SUFFIXES + scope_room;
    /* A decision through shared scopes reads each one's upstream view (lib/upstream.lua):
       one key per shared scope, after the windows' keys. */
    int upstreams = 0;
    if (d->script == RL_SCRIPT_WINDOW || d->script == RL_SCRIPT_COMPACT_WINDOW ||
        d->script == RL_SCRIPT_IN_FLIGHT || d->script == RL_SCRIPT_COMPACT_IN_FLIGHT) {
        for (int k = 0; k < d->nscopes; k++)
            upstreams += d->scopes[k].shared;
    }
    /* reset.lua's pattern and base (the pattern escapes each byte at most once). */
    /* ... and sliding_window.lua each one's wait queue (lib/queue.lua): two keys more; a
       peek reads the queues too (its tickets count as an admission counts them), not the
       views. */
    int queues =
        d->script == RL_SCRIPT_WINDOW || d->script == RL_SCRIPT_COMPACT_WINDOW ? upstreams : 0;
    if (rl_script_peeks(d->script)) {
        for (int k = 0; k < d->nscopes; k++)
            queues += d->scopes[k].shared;
    }
    size_t need = (size_t)w->count * (3 * key_room + 4 * RL_NUMBER_TEXT) + 4 * key_room +
                  (size_t)upstreams * key_room + (size_t)queues * 2 * key_room +
                  (size_t)release_queue * 2 * key_room;
    const char **keys = argv + 3;
    size_t *keylens = argvlen + 3;
    int argc = 0;
    long long len;

    if (d->script == RL_SCRIPT_LEASE)
        return format_lease(prefix, prefix_len, user, user_len, d, now_ms, out);
    if (d->script == RL_SCRIPT_GCRA)
        return format_gcra(prefix, prefix_len, user, user_len, d, now_ms, out);
    if (d->script == RL_SCRIPT_BUDGET_HOLD || d->script == RL_SCRIPT_BUDGET_SETTLE)
        return format_budgets(prefix, prefix_len, d, now_ms, out);
    if (d->script == RL_SCRIPT_OBSERVE)
        return format_observe(prefix, prefix_len, user, user_len, d, now_ms, out);
    if (d->script == RL_SCRIPT_QUEUE)
        return format_queue(prefix, prefix_len, user, user_len, d, now_ms, out);
    *out = NULL;
    if (need > sizeof(stack_arena)) {
        arena = malloc(need);
        if (arena == NULL)
            return -1;
    }
    cursor = arena;

    argv[argc] = "EVALSHA";
    argvlen[argc++] = 7;
    argv[argc] = rl_script_sha1(d->script);
    argvlen[argc++] = strlen(argv[1]);
    argvlen[argc] = (size_t)snprintf(numkeys, sizeof(numkeys), "%d",
                                     per_window * (w->count - first) + upstreams + 2 * queues +
                                         release_queue + slot_keys + first);
    argv[argc++] = numkeys;
    for (int i = first; i < w->count; i++) {
        char *key = cursor;
        size_t key_len = window_key(cursor, prefix, prefix_len, user, user_len, d, i);
        for (int k = 0; k < per_window; k++) {
            const char *suffix = window_keys[d->storage].suffix[k];
            size_t suffix_len = strlen(suffix);
            if (k > 0) /* another key of the window: its key, then its suffix */
                memcpy(cursor, key, key_len);
            memcpy(cursor + key_len, suffix, suffix_len);
            keys[k * (w->count - first) + i - first] = cursor;
            keylens[k * (w->count - first) + i - first] = key_len + suffix_len;
            cursor += key_len + suffix_len;
        }
    }
    argc += per_window * (w->count - first);
    for (int k = 0; k < d->nscopes && upstreams > 0; k++) {
        if (!d->scopes[k].shared)
            continue;
        char *key = cursor;
        cursor = write_upstream_key(cursor, prefix, prefix_len, d->scopes[k].name,
                                    d->scopes[k].name_len, d->hash_tag);
        argv[argc] = key;
        argvlen[argc++] = (size_t)(cursor - key);
    }
    for (int k = 0; k < d->nscopes && queues > 0; k++) {
        if (!d->scopes[k].shared)
            continue;
        char *key = cursor;
        cursor =
            write_key_pair(cursor, prefix, prefix_len, d->scopes[k].name, d->scopes[k].name_len,
                           d->hash_tag, ":queue", ":h", &argvlen[argc], &argvlen[argc + 1]);
        argv[argc] = key;
        argv[argc + 1] = key + argvlen[argc];
        argc += 2;
    }
    if (first) { /* the bucket's key, last: format_gcra's */
        char *key = cursor;
        cursor = write_user_key(cursor, prefix, prefix_len, user, user_len, d->hash_tag);
        cursor += snprintf(cursor, RL_NUMBER_TEXT, ":%lld", w->seconds[0]);
        memcpy(cursor, ":gcra", 5);
        cursor += 5;
        argv[argc] = key;
        argvlen[argc++] = (size_t)(cursor - key);
    }
    if (release_queue) { /* the in-flight cap's wait queue, as format_lease names it */
        char *queue = cursor;
        cursor = write_key_pair(cursor, prefix, prefix_len, user, user_len, d->hash_tag,
                                ":leases:queue", ":h", &argvlen[argc], &argvlen[argc + 1]);
        argv[argc] = queue;
        argv[argc + 1] = queue + argvlen[argc];
        argc += 2;
    }
    if (slot_keys) { /* the leases key and its stats key, as format_lease names them */
        char *leases = cursor;
        cursor = write_key_pair(cursor, prefix, prefix_len, user, user_len, d->hash_tag, ":leases",
                                ":stats", &argvlen[argc], &argvlen[argc + 1]);
        argv[argc] = leases;
        argv[argc + 1] = leases + argvlen[argc];
        argc += 2;
    }
    if (d->script == RL_SCRIPT_RESET) {
        /* cursor ("" for the KEYS), pattern, base, count: see lua/reset.lua. */
        char *base = cursor;
        char *base_end = write_user_key(base, prefix, prefix_len, user, user_len, d->hash_tag);
        *base_end++ = ':';
        size_t base_len = (size_t)(base_end - base);
        char *pattern = base + base_len;
        size_t pattern_len = glob_prefix(pattern, base, base_len);
        argv[argc] = d->scan ? d->cursor : "";
        argvlen[argc++] = d->scan ? strlen(d->cursor) : 0;
        argv[argc] = pattern;
        argvlen[argc++] = pattern_len;
        argv[argc] = base;
        argvlen[argc++] = base_len;
        argv[argc] = RL_SCAN_COUNT;
        argvlen[argc++] = strlen(RL_SCAN_COUNT);
        argvlen[argc] = (size_t)snprintf(windows_text, sizeof(windows_text), "%d", w->count);
        argv[argc++] = windows_text;
        goto format;
    }
    argv[argc] = d->member;
    argvlen[argc++] = strlen(d->member); /* "" for peek, which logs nothing */
    if (now_ms >= 0) {
        argvlen[argc] = (size_t)snprintf(now_text, sizeof(now_text), "%lld", now_ms);
        argv[argc] = now_text;
    } else {
        argv[argc] = "";
        argvlen[argc] = 0;
    }
    if (rl_script_reconciles(d->script)) {
        /* member, score, cost, now, tie, then each window's length in ms. */
        argvlen[argc + 2] = argvlen[argc];
        argv[argc + 2] = argv[argc];
        argvlen[argc] = (size_t)snprintf(score_text, sizeof(score_text), "%lld", d->score_ms);
        argv[argc] = score_text;
        argvlen[argc + 1] = (size_t)snprintf(cost_text, sizeof(cost_text), "%lld", d->new_cost);
        argv[argc + 1] = cost_text;
        argvlen[argc + 3] = (size_t)snprintf(tie_text, sizeof(tie_text), "%lld", d->tie);
        argv[argc + 3] = tie_text;
        argc += 4;
        for (int i = 0; i < w->count; i++) {
            char *text = cursor;
            cursor += snprintf(cursor, RL_NUMBER_TEXT, "%lld", w->seconds[i] * 1000LL);
            argv[argc] = text;
            argvlen[argc++] = (size_t)(cursor - text);
        }
        if (d->shares_len > 0 && d->shares != NULL) { /* "C class": lib/set_cost.lua */
            argv[argc] = d->shares;
            argvlen[argc++] = d->shares_len;
        }
    } else {
        argc++;
        for (int i = first; i < w->count; i++) {
            const long long values[3] = {w->seconds[i] * 1000LL, w->limit[i], w->cost[i]};
            for (int k = 0; k < 3; k++) {
                char *text = cursor;
                cursor += snprintf(cursor, RL_NUMBER_TEXT, "%lld", values[k]);
                argv[argc] = text;
                argvlen[argc++] = (size_t)(cursor - text);
            }
        }
        if (first) { /* the bucket: interval, scale, burst, cost (lua/gcra_windows.lua) */
            const long long values[4] = {d->gcra_units, d->gcra_scale, w->limit[0], w->cost[0]};
            for (int k = 0; k < 4; k++) {
                char *text = cursor;
                cursor += snprintf(cursor, RL_NUMBER_TEXT, "%lld", values[k]);
                argv[argc] = text;
                argvlen[argc++] = (size_t)(cursor - text);
            }
        }
        if (slot_keys) { /* reserve with in_flight: the slot limit and the lease's length */
            argvlen[argc] =
                (size_t)snprintf(limit_text, sizeof(limit_text), "%lld", d->lease_limit);
            argv[argc++] = limit_text;
            argvlen[argc] = (size_t)snprintf(lease_text, sizeof(lease_text), "%lld", d->lease_ms);
            argv[argc++] = lease_text;
        }
        if (d->shares_len > 0 && d->shares != NULL) { /* lua/lib/shares.lua's spec */
            argv[argc] = d->shares;
            argvlen[argc++] = d->shares_len;
        }
        if (d->probe_len > 0 && d->probe != NULL) { /* lua/lib/upstream.lua's probe spec */
            argv[argc] = d->probe;
            argvlen[argc++] = d->probe_len;
        }
    }
format:
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

int
rl_reply_is_cluster_redirect(const redisReply *r)
{
    return rl_reply_is_error(r, "MOVED ") || rl_reply_is_error(r, "ASK ") ||
           rl_reply_is_error(r, "TRYAGAIN") || rl_reply_is_error(r, "CLUSTERDOWN");
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

static rl_status
integer_at(const redisReply *array, size_t i, long long *out, rl_error *err)
{
    const redisReply *e = array->element[i];
    *out = 0; /* set on every path: a caller's `||` chain reads it only after RL_OK, which
                 the compiler cannot see through rl_error_set */
    if (e == NULL || e->type != REDIS_REPLY_INTEGER)
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "unexpected reply to the rate-limit script: element %zu is %s, "
                            "expected an integer",
                            i + 1, e ? rl_reply_type_name(e->type) : "missing");
    *out = e->integer;
    return RL_OK;
}

/* RL_OK when the integer `what` that the `script` script answered lies in [min, max] (what
   that script can answer: see RL_MAX_UNIX_MS), else a malformed reply naming the integer
   and its range. Every integer of a reply passes here before anything is computed from
   it, so no arithmetic below can overflow. */
static rl_status
within(const char *script, const char *what, long long value, long long min, long long max,
       rl_error *err)
{
    if (value >= min && value <= max)
        return RL_OK;
    return rl_error_set(err, RL_ERR_PROTOCOL,
                        "the %s script answered %s = %lld, out of range (%lld to %lld): not a "
                        "reply this script can give",
                        script, what, value, min, max);
}

/* The rounded-up seconds of a wait in ms (bounded by the caller: no overflow). */
static long long
ceil_seconds(long long ms)
{
    return (ms + 999) / 1000;
}

/* lua/reconcile_release.lua: {windows found, 1 when the lease was still held}. */
static rl_status
decode_reconcile_release(const redisReply *reply, const rl_prepared *d, rl_result *out,
                         rl_error *err)
{
    long long found = -1, released = -1;
    if (reply->type != REDIS_REPLY_ARRAY || reply->elements != 2)
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "unexpected reply to the reconcile-and-release script: %s, expected "
                            "an array of 2 integers",
                            rl_reply_type_name(reply->type));
    if (integer_at(reply, 0, &found, err) != RL_OK ||
        integer_at(reply, 1, &released, err) != RL_OK ||
        within("reconcile-and-release", "found", found, 0, d->windows.count, err) != RL_OK ||
        within("reconcile-and-release", "released", released, 0, 1, err) != RL_OK)
        return err->kind;
    memset(out, 0, sizeof(*out));
    out->found = found;
    out->slot = (int)released;
    return RL_OK;
}

/* Reads element i and i + 1 of reply, arrays of `count` soft limits fired before and after
   (0..100, never fewer after), into before and after. */
static rl_status
fired_arrays(const char *name, const redisReply *reply, size_t i, size_t count, int *before,
             int *after, rl_error *err)
{
    for (size_t e = i; e < i + 2; e++) {
        const redisReply *a = reply->element[e];
        if (a == NULL || a->type != REDIS_REPLY_ARRAY || a->elements != count)
            return rl_error_set(err, RL_ERR_PROTOCOL,
                                "unexpected reply to the %s script: element %zu is %s, expected "
                                "an array of %zu integers",
                                name, e + 1, a ? rl_reply_type_name(a->type) : "missing", count);
    }
    for (size_t k = 0; k < count; k++) {
        long long b, a;
        if (integer_at(reply->element[i], k, &b, err) != RL_OK ||
            integer_at(reply->element[i + 1], k, &a, err) != RL_OK ||
            within(name, "fired", b, 0, 100, err) != RL_OK ||
            within(name, "fired", a, b, 100, err) != RL_OK)
            return err->kind;
        before[k] = (int)b;
        after[k] = (int)a;
    }
    return RL_OK;
}

/* lua/budget_hold.lua: {allowed, refusing index, kind, now, {remaining}, {start}, {end}},
   followed by {fired before}, {fired after} when a soft limit was crossed, checked
   against the request: each budget's period is one of the three sent, its remaining at
   most its limit; or {0, -1, 0, now, {}, {}, {}}: the periods sent do not hold the
   script's now (kind -1 here; the caller computes them anew from now). */
static rl_status
decode_budget_hold(const redisReply *reply, const rl_prepared *d, rl_result *out, rl_error *err)
{
    static const char name[] = "budget hold";
    const int n = d->nbudgets;
    long long v[4];
    if (reply->type != REDIS_REPLY_ARRAY || (reply->elements != 7 && reply->elements != 9))
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "unexpected reply to the budget hold script: %s%s, expected an "
                            "array of 4 integers and 3 or 5 arrays",
                            rl_reply_type_name(reply->type),
                            reply->type == REDIS_REPLY_ARRAY ? " of another length" : "");
    for (size_t i = 0; i < 4; i++) {
        if (integer_at(reply, i, &v[i], err) != RL_OK)
            return err->kind;
    }
    long long allowed = v[0], refused = v[1], kind = v[2], now = v[3];
    if (within(name, "allowed", allowed, 0, 1, err) != RL_OK ||
        within(name, "now", now, 0, RL_MAX_UNIX_MS, err) != RL_OK ||
        within(name, "refused", refused, -1, allowed ? -1 : n - 1, err) != RL_OK ||
        within(name, "kind", kind, allowed || refused < 0 ? 0 : 1, allowed || refused < 0 ? 0 : 3,
               err) != RL_OK)
        return err->kind;
    const int stale = !allowed && refused < 0;
    const size_t count = stale ? 0 : (size_t)n;
    for (size_t i = 4; i < 7; i++) {
        const redisReply *e = reply->element[i];
        if (e == NULL || e->type != REDIS_REPLY_ARRAY || e->elements != count)
            return rl_error_set(err, RL_ERR_PROTOCOL,
                                "unexpected reply to the budget hold script: element %zu is %s, "
                                "expected an array of %zu integers",
                                i + 1, e ? rl_reply_type_name(e->type) : "missing", count);
    }
    memset(out, 0, sizeof(*out)); /* no soft limit crossed: fired 0 before and after */
    if (reply->elements == 9 &&
        fired_arrays(name, reply, 7, count, out->fired_before, out->fired_after, err) != RL_OK)
        return err->kind;
    for (size_t k = 0; k < count; k++) {
        const rl_budget *b = &d->budgets[k];
        long long remaining, start, end;
        if (integer_at(reply->element[4], k, &remaining, err) != RL_OK ||
            integer_at(reply->element[5], k, &start, err) != RL_OK ||
            integer_at(reply->element[6], k, &end, err) != RL_OK ||
            within(name, "remaining", remaining, 0, b->limit, err) != RL_OK)
            return err->kind;
        int j = -1; /* which of the three periods sent */
        for (int i = 0; i < 3 && j < 0; i++)
            j = start == b->bounds[i] ? i : -1;
        /* now lies in the period, but for a replay that found its hold across a boundary */
        if (j < 0 || end != b->bounds[j + 1] || ((now < start || now >= end) && d->replay == NULL))
            return rl_error_set(err, RL_ERR_PROTOCOL,
                                "the budget hold script answered the period [%lld, %lld) at now = "
                                "%lld for budget %zu: not one of the periods sent",
                                start, end, now, k);
        out->remaining_of[k] = remaining;
        out->start_of[k] = start;
        out->end_of[k] = end;
    }
    out->allowed = (int)allowed;
    out->window = (int)refused;
    out->kind = stale ? -1 : (int)kind;
    out->now_ms = now;
    out->evaluated = (int)count;
    out->slot = -1;
    return RL_OK;
}

/* lua/wait_queue.lua: take, the ticket's rank or -1/-2 (full); leave, 1 or 0. */
static rl_status
decode_queue(const redisReply *reply, rl_result *out, rl_error *err)
{
    if (reply->type != REDIS_REPLY_INTEGER)
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "unexpected reply to the wait queue script: %s, expected an integer",
                            rl_reply_type_name(reply->type));
    if (within("wait queue", "rank", reply->integer, -2, RL_MAX_QUEUE_LENGTH, err) != RL_OK)
        return err->kind;
    memset(out, 0, sizeof(*out));
    out->found = reply->integer;
    return RL_OK;
}

/* lua/observe_upstream.lua: the upstream's closed-until time (unix ms), 0 when open. */
static rl_status
decode_observe(const redisReply *reply, rl_result *out, rl_error *err)
{
    if (reply->type != REDIS_REPLY_INTEGER)
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "unexpected reply to the observe-upstream script: %s, expected an "
                            "integer",
                            rl_reply_type_name(reply->type));
    if (within("observe-upstream", "closed_until", reply->integer, 0, RL_MAX_UNIX_MS, err) != RL_OK)
        return err->kind;
    memset(out, 0, sizeof(*out));
    out->expires_ms = reply->integer;
    return RL_OK;
}

/* lua/budget_settle.lua: found, or {found, {fired before}, {fired after}} when a soft
   limit was crossed. */
static rl_status
decode_budget_settle(const redisReply *reply, const rl_prepared *d, rl_result *out, rl_error *err)
{
    static const char name[] = "budget settle";
    long long found;
    memset(out, 0, sizeof(*out)); /* no soft limit crossed: fired 0 before and after */
    if (reply->type == REDIS_REPLY_INTEGER) {
        if (within(name, "found", reply->integer, 0, d->nbudgets, err) != RL_OK)
            return err->kind;
        out->found = reply->integer;
        return RL_OK;
    }
    if (reply->type != REDIS_REPLY_ARRAY || reply->elements != 3)
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "unexpected reply to the budget settle script: %s%s, expected an "
                            "integer from 0 to %d, or an array of it and 2 arrays",
                            rl_reply_type_name(reply->type),
                            reply->type == REDIS_REPLY_ARRAY ? " of another length" : "",
                            d->nbudgets);
    if (integer_at(reply, 0, &found, err) != RL_OK ||
        within(name, "found", found, 0, d->nbudgets, err) != RL_OK ||
        fired_arrays(name, reply, 1, (size_t)d->nbudgets, out->fired_before, out->fired_after,
                     err) != RL_OK)
        return err->kind;
    out->found = found;
    return RL_OK;
}

/* lua/reconcile.lua: the number of windows whose entry was found. */
static rl_status
decode_reconcile(const redisReply *reply, const rl_prepared *d, rl_result *out, rl_error *err)
{
    if (reply->type != REDIS_REPLY_INTEGER)
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "unexpected reply to the reconcile script: %s, expected an integer "
                            "from 0 to %d",
                            rl_reply_type_name(reply->type), d->windows.count);
    if (within("reconcile", "found", reply->integer, 0, d->windows.count, err) != RL_OK)
        return err->kind;
    memset(out, 0, sizeof(*out));
    out->found = reply->integer;
    return RL_OK;
}

/* 1 when text (len bytes) is the decimal text of an unsigned 64-bit number: a SCAN
   cursor, which the next reset sends back. */
static int
is_cursor(const char *text, size_t len)
{
    static const char max_text[] = "18446744073709551615";
    if (len < 1 || len > RL_MAX_CURSOR_DIGITS || strspn(text, "0123456789") < len)
        return 0;
    return len < RL_MAX_CURSOR_DIGITS || memcmp(text, max_text, RL_MAX_CURSOR_DIGITS) <= 0;
}

/* lua/reset.lua: {entries removed, the SCAN cursor to go on from}. */
static rl_status
decode_reset(const redisReply *reply, rl_result *out, rl_error *err)
{
    const redisReply *cursor;
    long long removed = 0;
    if (reply->type != REDIS_REPLY_ARRAY || reply->elements != 2)
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "unexpected reply to the reset script: %s, expected an array of an "
                            "integer and a cursor",
                            rl_reply_type_name(reply->type));
    if (integer_at(reply, 0, &removed, err) != RL_OK ||
        within("reset", "removed", removed, 0, RL_MAX_LIMIT, err) != RL_OK)
        return err->kind;
    cursor = reply->element[1];
    if (cursor == NULL || cursor->type != REDIS_REPLY_STRING ||
        !is_cursor(cursor->str, cursor->len))
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "the reset script answered a cursor that is %s%s, out of range: "
                            "expected 1 to %d digits (an unsigned 64-bit SCAN cursor)",
                            cursor ? rl_reply_type_name(cursor->type) : "missing",
                            cursor && cursor->type == REDIS_REPLY_STRING ? " of other text" : "",
                            RL_MAX_CURSOR_DIGITS);
    memset(out, 0, sizeof(*out));
    out->found = removed;
    memcpy(out->cursor, cursor->str, cursor->len);
    out->cursor[cursor->len] = '\0';
    return RL_OK;
}

/* lua/peek.lua's 8th element: {used, oldest} of every window. */
static rl_status
decode_usage(const redisReply *usage, const rl_windows *w, rl_result *out, rl_error *err)
{
    if (usage == NULL || usage->type != REDIS_REPLY_ARRAY ||
        usage->elements != 2 * (size_t)w->count)
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "unexpected reply to the peek script: element 8 is %s, expected an "
                            "array of %d integers",
                            usage ? rl_reply_type_name(usage->type) : "missing", 2 * w->count);
    for (int i = 0; i < w->count; i++) {
        long long used, oldest;
        if (integer_at(usage, 2 * (size_t)i, &used, err) != RL_OK ||
            integer_at(usage, 2 * (size_t)i + 1, &oldest, err) != RL_OK ||
            within("peek", "used", used, 0, RL_MAX_LIMIT, err) != RL_OK ||
            within("peek", "oldest", oldest, -1, RL_MAX_UNIX_MS, err) != RL_OK)
            return err->kind;
        if ((used == 0) != (oldest == -1))
            return rl_error_set(err, RL_ERR_PROTOCOL,
                                "the peek script answered a usage out of range (%lld used, "
                                "oldest %lld): an empty window has no oldest entry",
                                used, oldest);
        out->used_of[i] = used;
        out->oldest_of[i] = oldest;
    }
    return RL_OK;
}

/* lua/lease.lua: {ok, held, retry_ms, expires_ms, now_ms, bound_ms}, checked against the
   request. A refusal's retry_ms is the hint, at most bound_ms (the soonest lease's expiry). */
static rl_status
decode_lease(const redisReply *reply, const rl_prepared *d, rl_result *out, rl_error *err)
{
    static const char name[] = "lease";
    /* A refusal waits for the soonest expiry: a lease of any caller, so the longest. */
    const long long longest_wait = RL_MAX_WINDOW_SECONDS * 1000 + RL_MAX_CLOCK_SKEW_MS;
    /* an acquire with shares: a 7th, the share rule that refused it (0: none) */
    const size_t elements = d->shape == RL_SHAPE_ACQUIRE && d->shares_len > 0 ? 7 : 6;
    long long v[7] = {0, 0, 0, 0, 0, 0, 0};
    if (reply->type != REDIS_REPLY_ARRAY || reply->elements != elements)
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "unexpected reply to the lease script: %s%s, expected an array of %zu "
                            "integers",
                            rl_reply_type_name(reply->type),
                            reply->type == REDIS_REPLY_ARRAY ? " of another length" : "", elements);
    for (size_t i = 0; i < elements; i++) {
        if (integer_at(reply, i, &v[i], err) != RL_OK)
            return err->kind;
    }
    long long ok = v[0], held = v[1], retry_ms = v[2], expires = v[3], now = v[4], bound = v[5];
    if (within(name, "ok", ok, 0, 1, err) != RL_OK ||
        within(name, "held", held, 0, RL_MAX_LIMIT, err) != RL_OK ||
        within(name, "now", now, 0, RL_MAX_UNIX_MS, err) != RL_OK ||
        within(name, "retry_ms", retry_ms, 0, longest_wait, err) != RL_OK ||
        within(name, "bound_ms", bound, retry_ms, longest_wait, err) != RL_OK ||
        within(name, "share rule", v[6], 0, ok == 1 ? 0 : 129, err) != RL_OK)
        return err->kind;
    /* 2j: the reserve of class j; 2j + 1: class j's ceiling (at most 64 classes) */
    if (v[6] == 1)
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "unexpected reply to the lease script: share "
                            "rule 1");
    int granted = ok == 1 && d->shape != RL_SHAPE_RELEASE;
    /* A granted lease expires after now, within its length (a replayed acquire answers the
       first attempt's expiry, stamped by a clock that may have been ahead). */
    if (granted && within(name, "expires_ms", expires, now + 1,
                          now + d->lease_ms + RL_MAX_CLOCK_SKEW_MS, err) != RL_OK)
        return err->kind;
    if (!granted && within(name, "expires_ms", expires, 0, 0, err) != RL_OK)
        return err->kind;
    if ((d->shape == RL_SHAPE_ACQUIRE && ok == 1 && (held < 1 || retry_ms != 0 || bound != 0)) ||
        /* a refusal with free slots: tickets of the cap's wait queue are ahead of it, or
           a class's share refused it */
        (d->shape == RL_SHAPE_ACQUIRE && ok == 0 && retry_ms < 1) ||
        (d->shape != RL_SHAPE_ACQUIRE && (retry_ms != 0 || bound != 0)))
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "the lease script answered values out of range "
                            "(%lld, %lld, %lld, %lld, %lld, %lld)",
                            ok, held, retry_ms, expires, now, bound);
    memset(out, 0, sizeof(*out));
    out->allowed = (int)ok;
    out->remaining = held;
    out->retry_after_ms = retry_ms;
    out->retry_after_s = ceil_seconds(retry_ms);
    out->retry_bound_ms = bound;
    out->expires_ms = expires;
    out->now_ms = now;
    out->share_rule = v[6];
    return RL_OK;
}

/* lua/reserve_in_flight.lua's 9th element, {granted, holders, wait ms, expiry, bound ms},
   after the decision's own (allowed or refused by a window): granted when the decision
   allowed, nothing held when a window refused it. Holders: at most this call's limit for its
   own slot, but others may hold theirs under a larger one; only an absurd count is
   malformed. */
static rl_status
decode_slot(const redisReply *answer, const rl_prepared *d, rl_result *out, rl_error *err)
{
    const char *name = "in-flight reserve";
    long long v[5] = {-1, -1, -1, -1, -1};
    if (answer == NULL || answer->type != REDIS_REPLY_ARRAY || answer->elements != 5)
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "unexpected reply to the in-flight reserve script: element 9 is %s, "
                            "expected an array of 5 integers",
                            answer ? rl_reply_type_name(answer->type) : "missing");
    for (size_t i = 0; i < 5; i++) {
        if (integer_at(answer, i, &v[i], err) != RL_OK)
            return err->kind;
    }
    if (within(name, "granted", v[0], out->allowed, out->allowed, err) != RL_OK ||
        within(name, "holders", v[1], out->allowed, RL_MAX_LIMIT, err) != RL_OK ||
        within(name, "a granted slot's wait", v[2], 0, 0, err) != RL_OK ||
        within(name, "a granted slot's bound", v[4], 0, 0, err) != RL_OK ||
        (out->allowed &&
         within(name, "expiry", v[3], out->now_ms + 1, out->now_ms + d->lease_ms, err) != RL_OK) ||
        (!out->allowed && within(name, "expiry", v[3], 0, 0, err) != RL_OK))
        return err->kind;
    out->slot = (int)v[0];
    out->slot_held = v[1];
    out->slot_retry_ms = 0;
    out->retry_bound_ms = 0;
    out->expires_ms = v[3];
    return RL_OK;
}

/* lua/reserve_in_flight.lua's answer when the slot was refused: no window decided
   {0, 0, retry_s, 0, now, {}, retry_ms, 0, {0, holders, retry_ms, 0, bound_ms}}: retry_ms
   the hint, at most bound_ms (the soonest lease's expiry). */
static rl_status
decode_slot_refusal(const redisReply *reply, const rl_prepared *d, rl_result *out, rl_error *err)
{
    const char *name = "in-flight reserve";
    long long v[5], retry_ms = 0, tie = -1, slot[5] = {-1, -1, -1, -1, -1};
    const redisReply *each = reply->element[5], *answer = reply->element[8];
    for (size_t i = 0; i < 5; i++) {
        if (integer_at(reply, i, &v[i], err) != RL_OK)
            return err->kind;
    }
    if (integer_at(reply, 6, &retry_ms, err) != RL_OK || integer_at(reply, 7, &tie, err) != RL_OK)
        return err->kind;
    if (answer == NULL || answer->type != REDIS_REPLY_ARRAY || answer->elements != 5 ||
        each == NULL || each->type != REDIS_REPLY_ARRAY || each->elements != 0)
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "unexpected reply to the in-flight reserve script: a refused slot "
                            "with window reports, or without its answer");
    for (size_t i = 0; i < 5; i++) {
        if (integer_at(answer, i, &slot[i], err) != RL_OK)
            return err->kind;
    }
    if (within(name, "allowed", v[0], 0, 0, err) != RL_OK ||
        within(name, "remaining", v[1], 0, 0, err) != RL_OK ||
        within(name, "now", v[4], 0, RL_MAX_UNIX_MS, err) != RL_OK ||
        within(name, "retry_ms", retry_ms, 1, RL_MAX_WINDOW_SECONDS * 1000, err) != RL_OK ||
        within(name, "retry_after_s", v[2], ceil_seconds(retry_ms), ceil_seconds(retry_ms), err) !=
            RL_OK ||
        within(name, "tie", tie, 0, 0, err) != RL_OK ||
        within(name, "granted", slot[0], 0, 0, err) != RL_OK ||
        within(name, "holders", slot[1], d->lease_limit, RL_MAX_LIMIT, err) != RL_OK ||
        within(name, "the slot's wait", slot[2], retry_ms, retry_ms, err) != RL_OK ||
        within(name, "expiry", slot[3], 0, 0, err) != RL_OK ||
        within(name, "the slot's bound", slot[4], retry_ms, RL_MAX_WINDOW_SECONDS * 1000, err) !=
            RL_OK)
        return err->kind;
    memset(out, 0, sizeof(*out));
    out->retry_after_s = v[2];
    out->retry_after_ms = retry_ms;
    out->window = -1;
    out->now_ms = v[4];
    out->slot = 0;
    out->slot_held = slot[1];
    out->slot_retry_ms = retry_ms;
    out->retry_bound_ms = slot[4];
    return RL_OK;
}

/* lua/gcra.lua: {allowed, remaining, retry_after_s, retry_ms, now}, checked against the
   request: an allow leaves at most burst - cost and waits for nothing; a refusal leaves
   fewer than cost and waits 1 ms to the bucket's depth (burst * period / rate, rounded
   up) plus the skew of a clock that wrote a TAT ahead of this one's. */
static rl_status
decode_gcra(const redisReply *reply, const rl_prepared *d, rl_result *out, rl_error *err)
{
    static const char name[] = "GCRA";
    const rl_windows *w = &d->windows;
    long long v[5];
    if (reply->type != REDIS_REPLY_ARRAY || reply->elements != 5)
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "unexpected reply to the GCRA script: %s%s, expected an array of 5 "
                            "integers",
                            rl_reply_type_name(reply->type),
                            reply->type == REDIS_REPLY_ARRAY ? " of another length" : "");
    for (size_t i = 0; i < 5; i++) {
        if (integer_at(reply, i, &v[i], err) != RL_OK)
            return err->kind;
    }
    long long allowed = v[0], remaining = v[1], retry = v[2], retry_ms = v[3], now = v[4];
    long long burst = w->limit[0], cost = w->cost[0];
    /* burst * interval < 2^52 (py_request.c): no overflow; the depth in ms, rounded up. */
    long long depth_ms = (burst * d->gcra_units + d->gcra_scale - 1) / d->gcra_scale;
    if (within(name, "allowed", allowed, 0, 1, err) != RL_OK ||
        within(name, "now", now, 0, RL_MAX_UNIX_MS, err) != RL_OK)
        return err->kind;
    if (allowed) {
        if (within(name, "remaining", remaining, 0, burst - cost, err) != RL_OK ||
            within(name, "retry_after_s", retry, 0, 0, err) != RL_OK ||
            within(name, "retry_ms", retry_ms, 0, 0, err) != RL_OK)
            return err->kind;
    } else if (within(name, "remaining", remaining, 0, cost - 1, err) != RL_OK ||
               within(name, "retry_ms", retry_ms, 1, depth_ms + RL_MAX_CLOCK_SKEW_MS, err) !=
                   RL_OK ||
               within(name, "retry_after_s", retry, ceil_seconds(retry_ms), ceil_seconds(retry_ms),
                      err) != RL_OK) {
        return err->kind;
    }
    memset(out, 0, sizeof(*out));
    out->allowed = (int)allowed;
    out->remaining = remaining;
    out->retry_after_s = retry;
    out->retry_after_ms = retry_ms;
    out->window = 0;
    out->now_ms = now;
    out->evaluated = 1;
    out->remaining_of[0] = remaining;
    out->slot = -1;
    return RL_OK;
}

/* lua/sliding_window.lua (and peek.lua's first 7): {allowed, remaining, retry_after_s,
   window, now, {remaining per window}, retry_ms}, checked against the request's windows. */
static rl_status
decode_window(const redisReply *reply, const rl_prepared *d, rl_result *out, rl_error *err)
{
    const char *name = rl_script_peeks(d->script) ? "peek" : "rate-limit";
    const rl_windows *w = &d->windows;
    int nwindows = w->count;
    /* peek: a usage array 8th; the compact storage's decision: the entry's tie 8th; with an
       in-flight slot: the tie 8th and the slot's answer 9th */
    int slot = d->script == RL_SCRIPT_IN_FLIGHT || d->script == RL_SCRIPT_COMPACT_IN_FLIGHT;
    int tied = d->script == RL_SCRIPT_COMPACT_WINDOW || d->script == RL_SCRIPT_COMPACT_GCRA_WINDOWS;
    size_t elements = slot ? 9 : rl_script_peeks(d->script) || tied ? 8 : 7;
    /* reserve with shares: the rule that refused, last (lua/lib/shares.lua) */
    int shares = d->shares_len > 0 && !rl_script_peeks(d->script);
    elements += (size_t)shares;
    long long v[5] = {0, 0, 0, 0, 0}, retry_ms = 0;
    const redisReply *each;
    if (reply->type != REDIS_REPLY_ARRAY || reply->elements != elements)
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "unexpected reply to the rate-limit script: %s%s, expected an array "
                            "of 5 integers, an array and an integer",
                            rl_reply_type_name(reply->type),
                            reply->type == REDIS_REPLY_ARRAY ? " of another length" : "");
    for (size_t i = 0; i < 5; i++) {
        if (integer_at(reply, i, &v[i], err) != RL_OK)
            return err->kind;
    }
    if (integer_at(reply, 6, &retry_ms, err) != RL_OK)
        return err->kind;
    long long allowed = v[0], remaining = v[1], retry = v[2], window = v[3], now = v[4];
    if (slot && window == 0)
        return decode_slot_refusal(reply, d, out, err);
    if (within(name, "allowed", allowed, 0, 1, err) != RL_OK ||
        within(name, "window", window, 1, nwindows, err) != RL_OK ||
        within(name, "now", now, 0, RL_MAX_UNIX_MS, err) != RL_OK)
        return err->kind;
    long long limit = w->limit[window - 1];
    if (allowed) {
        if (within(name, "remaining", remaining, 0, limit - 1, err) != RL_OK ||
            within(name, "retry_after_s", retry, 0, 0, err) != RL_OK ||
            within(name, "retry_ms", retry_ms, 0, 0, err) != RL_OK)
            return err->kind;
    } else {
        /* The wait until enough of the window's entries leave it: at most the window, and
           the skew of the clock that stamped them. retry_after_s is that wait rounded up. */
        long long longest_wait = w->seconds[window - 1] * 1000 + RL_MAX_CLOCK_SKEW_MS;
        if (window == 1 && rl_script_gcra_windows(d->script)) /* the bucket: its depth */
            longest_wait = (w->limit[0] * d->gcra_units + d->gcra_scale - 1) / d->gcra_scale +
                           RL_MAX_CLOCK_SKEW_MS;
        if (within(name, "remaining", remaining, 0, 0, err) != RL_OK ||
            within(name, "retry_ms", retry_ms, 1, longest_wait, err) != RL_OK ||
            within(name, "retry_after_s", retry, ceil_seconds(retry_ms), ceil_seconds(retry_ms),
                   err) != RL_OK)
            return err->kind;
    }
    /* Every window's remaining on allow; on reject the windows up to the rejecting one. */
    each = reply->element[5];
    size_t evaluated = allowed ? (size_t)nwindows : (size_t)window;
    if (each == NULL || each->type != REDIS_REPLY_ARRAY || each->elements != evaluated)
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "unexpected reply to the rate-limit script: element 6 is %s, "
                            "expected an array of %zu integers",
                            each ? rl_reply_type_name(each->type) : "missing", evaluated);
    for (size_t i = 0; i < evaluated; i++) {
        long long r = 0;
        if (integer_at(each, i, &r, err) != RL_OK)
            return err->kind;
        /* On allow no window has fewer left than the fewest reported; on reject a window
           before the rejecting one has up to its limit (the request's cost given back). */
        if (within(name, "a window's remaining", r, allowed ? remaining : 0,
                   allowed ? w->limit[i] - 1 : w->limit[i], err) != RL_OK)
            return err->kind;
        out->remaining_of[i] = r;
    }
    out->allowed = (int)allowed;
    out->remaining = remaining;
    out->retry_after_s = retry;
    out->retry_after_ms = retry_ms;
    out->window = (int)(window - 1);
    out->now_ms = now;
    out->evaluated = (int)evaluated;
    out->found = 0;
    out->expires_ms = 0;
    out->tie = 0;
    out->slot = -1;
    if (rl_script_peeks(d->script))
        return decode_usage(reply->element[7], w, out, err);
    if (elements > 7) {
        if (integer_at(reply, 7, &out->tie, err) != RL_OK ||
            within(name, "tie", out->tie, 0, RL_MAX_TIE, err) != RL_OK)
            return err->kind;
    }
    out->share_rule = 0;
    if (shares) {
        /* 2j: the reserve of class j; 2j + 1: class j's ceiling (at most 64 classes) */
        if (integer_at(reply, elements - 1, &out->share_rule, err) != RL_OK ||
            within(name, "share rule", out->share_rule, 0, allowed ? 0 : 129, err) != RL_OK)
            return err->kind;
        if (!allowed && out->share_rule == 1)
            return rl_error_set(err, RL_ERR_PROTOCOL,
                                "unexpected reply to the rate-limit script: share rule 1");
    }
    if (slot)
        return decode_slot(reply->element[8], d, out, err);
    return RL_OK;
}

rl_status
rl_script_decode(const redisReply *reply, const rl_prepared *d, rl_result *out, rl_error *err)
{
    if (reply->type == REDIS_REPLY_ERROR) {
        if (rl_reply_is_error(reply, "NOAUTH") || rl_reply_is_error(reply, "WRONGPASS"))
            return rl_error_set(err, RL_ERR_AUTH,
                                "the Redis server requires authentication: put the password "
                                "in the URL (%.120s)",
                                reply->str);
        if (rl_reply_is_error(reply, "CROSSSLOT"))
            return rl_error_set(err, RL_ERR_SERVER,
                                "Redis answered %.200s: the server is a Redis Cluster node; use a "
                                "redis+cluster:// URL",
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
    switch (d->script) {
    case RL_SCRIPT_RECONCILE_RELEASE:
    case RL_SCRIPT_COMPACT_RECONCILE_RELEASE:
        return decode_reconcile_release(reply, d, out, err);
    case RL_SCRIPT_RECONCILE:
    case RL_SCRIPT_COMPACT_RECONCILE:
        return decode_reconcile(reply, d, out, err);
    case RL_SCRIPT_RESET:
        return decode_reset(reply, out, err);
    case RL_SCRIPT_LEASE:
        return decode_lease(reply, d, out, err);
    case RL_SCRIPT_GCRA:
        return decode_gcra(reply, d, out, err);
    case RL_SCRIPT_BUDGET_HOLD:
        return decode_budget_hold(reply, d, out, err);
    case RL_SCRIPT_BUDGET_SETTLE:
        return decode_budget_settle(reply, d, out, err);
    case RL_SCRIPT_OBSERVE:
        return decode_observe(reply, out, err);
    case RL_SCRIPT_QUEUE:
        return decode_queue(reply, out, err);
    default:
        return decode_window(reply, d, out, err);
    }
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
