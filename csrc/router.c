/*
 * router.c - the routing of a Redis Cluster or a Sentinel set, with no I/O in it (the
 * same move as proto.c, one floor up). Both limiters drive it: cluster.c over blocking
 * sockets, aio.py through _native.Router (py_routing.c). It owns, once:
 *   - the hash slot of a key (CRC16 of the hash tag);
 *   - the map: the nodes met (seeds first, never removed) and which serves each slot, read
 *     from CLUSTER SHARDS (Redis 7) or CLUSTER SLOTS (before); or, behind sentinels, the
 *     master they agree on: SENTINEL MASTER from each, the highest config epoch (between
 *     equal ones, the address more sentinels name), checked with ROLE (a replica is
 *     refused);
 *   - what a call does after each answer or failure (rl_route_failed, rl_route_next):
 *       MOVED: the slot is pointed at the node named; the map is read again when none was
 *         read for RL_MOVED_READ_AFTER, or after RL_MOVED_READ_EVERY MOVEDs (a resharding
 *         moves many slots: one read, not one per MOVED), and the patch is applied after it
 *         (newer than what a node whose gossip lags may answer);
 *       ASK: ASKING and the decision, once, on the node named;
 *       TRYAGAIN, CLUSTERDOWN, a refused or broken connection, and, behind sentinels, a
 *         demoted master's READONLY: a pause, the map read again, the call sent where it
 *         now belongs, within the call's deadline;
 *       a timeout: not retried (the decision may have run), but the map is read again
 *         every RL_STALE_REREAD for twice socket_timeout (the node may be frozen and its
 *         replica promoted any moment); behind sentinels, they are asked at the next call;
 *       behind sentinels, they are asked again every RL_SENTINEL_RECHECK while calls flow,
 *         and while one reports a failover under way the calls wait (rather than write to a
 *         master about to be replaced), at most RL_SENTINEL_FAILOVER_HOLD;
 *   - single flight: one read at a time for every thread and task of a limiter; the
 *     others go on with the map they have, or wait a pause when they have none;
 *   - each question within its share of the read's deadline (at most RL_ASK_WAIT), so a
 *     frozen node or sentinel costs a fraction of a call; a sentinel that timed out is
 *     asked last for RL_SENTINEL_SUSPECT (not at all while another answers).
 * Drivers only move bytes: they send where rl_route_next says, ask what rl_read_step says,
 * and hand every answer back.
 *
 * GIL contract: nothing here touches a Python object; every function may run with or
 * without the GIL, from any thread. Each public function takes the router's mutex and
 * releases it before returning; no other lock is taken under it.
 */
#include "native.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RL_CLUSTER_MAX_ATTEMPTS 64    /* MOVED answers to one call (the deadline bounds the rest) */
#define RL_CLUSTER_PAUSE 0.025        /* seconds between tries while a failover is under way */
#define RL_ASK_WAIT 0.25              /* the most one node or sentinel may take to answer */
#define RL_SENTINEL_RECHECK 0.1       /* seconds between two askings of the sentinels */
#define RL_STALE_REREAD 0.1           /* seconds between two map reads after a timeout */
#define RL_SENTINEL_SUSPECT 5.0       /* a sentinel that timed out is asked last this long */
#define RL_SENTINEL_FAILOVER_HOLD 5.0 /* the longest a failover under way holds the calls */
#define RL_MOVED_READ_AFTER 0.1       /* a MOVED reads the map when none was read this long */
#define RL_MOVED_READ_EVERY 64        /* ... or after this many MOVEDs since the last read */
#define RL_READ_ABANDONED                                                                          \
    30.0 /* a read held longer than this was abandoned (a killed
                                         thread, a cancelled task that never ended it) */

/* ---------------------------------------------------------------- slots */

/* CRC16-CCITT (XMODEM), the hash of the Redis Cluster specification. */
/* clang-format off */
static const uint16_t crc16_table[256] = {
    0x0000, 0x1021, 0x2042, 0x3063, 0x4084, 0x50a5, 0x60c6, 0x70e7,
    0x8108, 0x9129, 0xa14a, 0xb16b, 0xc18c, 0xd1ad, 0xe1ce, 0xf1ef,
    0x1231, 0x0210, 0x3273, 0x2252, 0x52b5, 0x4294, 0x72f7, 0x62d6,
    0x9339, 0x8318, 0xb37b, 0xa35a, 0xd3bd, 0xc39c, 0xf3ff, 0xe3de,
    0x2462, 0x3443, 0x0420, 0x1401, 0x64e6, 0x74c7, 0x44a4, 0x5485,
    0xa56a, 0xb54b, 0x8528, 0x9509, 0xe5ee, 0xf5cf, 0xc5ac, 0xd58d,
    0x3653, 0x2672, 0x1611, 0x0630, 0x76d7, 0x66f6, 0x5695, 0x46b4,
    0xb75b, 0xa77a, 0x9719, 0x8738, 0xf7df, 0xe7fe, 0xd79d, 0xc7bc,
    0x48c4, 0x58e5, 0x6886, 0x78a7, 0x0840, 0x1861, 0x2802, 0x3823,
    0xc9cc, 0xd9ed, 0xe98e, 0xf9af, 0x8948, 0x9969, 0xa90a, 0xb92b,
    0x5af5, 0x4ad4, 0x7ab7, 0x6a96, 0x1a71, 0x0a50, 0x3a33, 0x2a12,
    0xdbfd, 0xcbdc, 0xfbbf, 0xeb9e, 0x9b79, 0x8b58, 0xbb3b, 0xab1a,
    0x6ca6, 0x7c87, 0x4ce4, 0x5cc5, 0x2c22, 0x3c03, 0x0c60, 0x1c41,
    0xedae, 0xfd8f, 0xcdec, 0xddcd, 0xad2a, 0xbd0b, 0x8d68, 0x9d49,
    0x7e97, 0x6eb6, 0x5ed5, 0x4ef4, 0x3e13, 0x2e32, 0x1e51, 0x0e70,
    0xff9f, 0xefbe, 0xdfdd, 0xcffc, 0xbf1b, 0xaf3a, 0x9f59, 0x8f78,
    0x9188, 0x81a9, 0xb1ca, 0xa1eb, 0xd10c, 0xc12d, 0xf14e, 0xe16f,
    0x1080, 0x00a1, 0x30c2, 0x20e3, 0x5004, 0x4025, 0x7046, 0x6067,
    0x83b9, 0x9398, 0xa3fb, 0xb3da, 0xc33d, 0xd31c, 0xe37f, 0xf35e,
    0x02b1, 0x1290, 0x22f3, 0x32d2, 0x4235, 0x5214, 0x6277, 0x7256,
    0xb5ea, 0xa5cb, 0x95a8, 0x8589, 0xf56e, 0xe54f, 0xd52c, 0xc50d,
    0x34e2, 0x24c3, 0x14a0, 0x0481, 0x7466, 0x6447, 0x5424, 0x4405,
    0xa7db, 0xb7fa, 0x8799, 0x97b8, 0xe75f, 0xf77e, 0xc71d, 0xd73c,
    0x26d3, 0x36f2, 0x0691, 0x16b0, 0x6657, 0x7676, 0x4615, 0x5634,
    0xd94c, 0xc96d, 0xf90e, 0xe92f, 0x99c8, 0x89e9, 0xb98a, 0xa9ab,
    0x5844, 0x4865, 0x7806, 0x6827, 0x18c0, 0x08e1, 0x3882, 0x28a3,
    0xcb7d, 0xdb5c, 0xeb3f, 0xfb1e, 0x8bf9, 0x9bd8, 0xabbb, 0xbb9a,
    0x4a75, 0x5a54, 0x6a37, 0x7a16, 0x0af1, 0x1ad0, 0x2ab3, 0x3a92,
    0xfd2e, 0xed0f, 0xdd6c, 0xcd4d, 0xbdaa, 0xad8b, 0x9de8, 0x8dc9,
    0x7c26, 0x6c07, 0x5c64, 0x4c45, 0x3ca2, 0x2c83, 0x1ce0, 0x0cc1,
    0xef1f, 0xff3e, 0xcf5d, 0xdf7c, 0xaf9b, 0xbfba, 0x8fd9, 0x9ff8,
    0x6e17, 0x7e36, 0x4e55, 0x5e74, 0x2e93, 0x3eb2, 0x0ed1, 0x1ef0,
};
/* clang-format on */

static int
crc16_slot(const char *data, size_t len)
{
    uint16_t crc = 0;
    for (size_t i = 0; i < len; i++)
        crc = (uint16_t)(crc << 8) ^ crc16_table[((crc >> 8) ^ (unsigned char)data[i]) & 0xff];
    return crc & (RL_CLUSTER_SLOTS - 1);
}

int
rl_key_slot(const char *key, size_t len)
{
    /* Redis's rule: the bytes between the first '{' and the next '}', when not empty. */
    const char *open = memchr(key, '{', len);
    if (open != NULL) {
        size_t rest = len - (size_t)(open + 1 - key);
        const char *close = memchr(open + 1, '}', rest);
        if (close != NULL && close > open + 1)
            return crc16_slot(open + 1, (size_t)(close - open - 1));
    }
    return crc16_slot(key, len);
}

int
rl_user_slot(const char *user, size_t user_len)
{
    /* The tag exactly as rl_key_user writes it (one encoding, one place). */
    char stack[512];
    size_t room = rl_key_user_room(user_len);
    char *tag = room <= sizeof(stack) ? stack : malloc(room);
    if (tag == NULL)
        return -1;
    size_t len = rl_key_user(tag, user, user_len, 1);
    int slot = crc16_slot(tag + 1, len - 2);
    if (tag != stack)
        free(tag);
    return slot;
}

/* ---------------------------------------------------------------- set-up */

int
rl_router_init(rl_router *r, const char *master_name, int tls, double socket_timeout)
{
    memset(r, 0, sizeof(*r));
    r->master = -1;
    r->last_sentinel = 0;
    r->tls = tls;
    r->socket_timeout = socket_timeout;
    for (int i = 0; i < RL_CLUSTER_SLOTS; i++)
        r->slots[i] = -1;
    if (master_name != NULL && (r->master_name = strdup(master_name)) == NULL)
        return -1;
    int rc = pthread_mutex_init(&r->mutex, NULL);
    if (rc != 0) {
        free(r->master_name);
        r->master_name = NULL;
        errno = rc;
        return -1;
    }
    r->initialized = 1;
    return 0;
}

/* The index of the node at host:port, added when new; -1 when the table is full (or the
   name too long). Mutex held. */
static int
node_index(rl_router *r, const char *host, size_t host_len, int port)
{
    for (int i = 0; i < r->node_count; i++) {
        if (r->nodes[i].port == port && strlen(r->nodes[i].host) == host_len &&
            memcmp(r->nodes[i].host, host, host_len) == 0)
            return i;
    }
    if (r->node_count == RL_CLUSTER_MAX_NODES || host_len == 0 ||
        host_len >= sizeof(r->nodes[0].host) || memchr(host, '\0', host_len) != NULL)
        return -1;
    rl_address *a = &r->nodes[r->node_count];
    memcpy(a->host, host, host_len);
    a->host[host_len] = '\0';
    a->port = port;
    return r->node_count++;
}

int
rl_router_add_seed(rl_router *r, const char *host, int port)
{
    size_t len = strlen(host);
    int index;
    pthread_mutex_lock(&r->mutex);
    if (r->master_name == NULL) {
        index = node_index(r, host, len, port);
    } else if (r->sentinel_count < RL_CLUSTER_MAX_NODES && len > 0 &&
               len < sizeof(r->sentinels[0].host)) {
        index = r->sentinel_count++;
        memcpy(r->sentinels[index].host, host, len + 1);
        r->sentinels[index].port = port;
    } else {
        index = -1;
    }
    pthread_mutex_unlock(&r->mutex);
    return index < 0 ? -1 : 0;
}

void
rl_router_after_fork(rl_router *r)
{
    (void)pthread_mutex_init(&r->mutex, NULL);
    r->reading_since = 0; /* a parent's thread that was reading is not in the child */
}

void
rl_router_destroy(rl_router *r)
{
    if (r->initialized)
        pthread_mutex_destroy(&r->mutex);
    free(r->master_name);
    r->master_name = NULL;
    r->initialized = 0;
}

int
rl_router_address(rl_router *r, int sentinel, int index, rl_address *out)
{
    int found = 0;
    pthread_mutex_lock(&r->mutex);
    if (index >= 0 && index < (sentinel ? r->sentinel_count : r->node_count)) {
        *out = sentinel ? r->sentinels[index] : r->nodes[index];
        found = 1;
    }
    pthread_mutex_unlock(&r->mutex);
    return found ? 0 : -1;
}

/* Mutex held. */
static int
destination(const rl_router *r, int slot)
{
    if (r->master_name != NULL)
        return r->master;
    return slot >= 0 && slot < RL_CLUSTER_SLOTS ? r->slots[slot] : -1;
}

int
rl_router_destination(rl_router *r, int slot)
{
    pthread_mutex_lock(&r->mutex);
    int node = destination(r, slot);
    pthread_mutex_unlock(&r->mutex);
    return node;
}

int
rl_router_masters(rl_router *r, int *out, int room)
{
    char seen[RL_CLUSTER_MAX_NODES] = {0};
    int n = 0;
    pthread_mutex_lock(&r->mutex);
    if (r->master_name != NULL) {
        if (r->master >= 0 && room > 0)
            out[n++] = r->master;
    } else {
        for (int s = 0; s < RL_CLUSTER_SLOTS; s++) {
            int node = r->slots[s];
            if (node >= 0 && !seen[node] && n < room) {
                seen[node] = 1;
                out[n++] = node;
            }
        }
    }
    pthread_mutex_unlock(&r->mutex);
    return n;
}

/* Claims the one read. Mutex held. 1: this caller reads; 0: another one does. */
static int
claim_read(rl_router *r, double now)
{
    if (r->reading_since > 0 && now - r->reading_since < RL_READ_ABANDONED)
        return 0;
    r->reading_since = now;
    return 1;
}

/* ------------------------------------------------------------------ map */

static int
string_is(const redisReply *r, const char *text)
{
    size_t n = strlen(text);
    return r != NULL && (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS) &&
           r->len == n && memcmp(r->str, text, n) == 0;
}

/* The value after name in a flat RESP2 map (an array of name, value, ...), or NULL. */
static const redisReply *
map_get(const redisReply *map, const char *name)
{
    if (map == NULL || map->type != REDIS_REPLY_ARRAY)
        return NULL;
    for (size_t i = 0; i + 1 < map->elements; i += 2) {
        if (string_is(map->element[i], name))
            return map->element[i + 1];
    }
    return NULL;
}

/* Points slots start..end at host:port in map (an empty or "?" host is the node that
   answered). Mutex held. */
static rl_status
map_range(rl_router *r, short *map, long long start, long long end, const redisReply *host,
          long long port, const rl_address *asked, rl_error *err)
{
    if (start < 0 || end < start || end >= RL_CLUSTER_SLOTS || port < 1 || port > 65535 ||
        host == NULL || host->type != REDIS_REPLY_STRING)
        return rl_error_set(err, RL_ERR_PROTOCOL, "Redis Cluster answered a malformed slot map");
    const char *name = host->str;
    size_t name_len = host->len;
    if (name_len == 0 || (name_len == 1 && name[0] == '?')) {
        name = asked->host;
        name_len = strlen(asked->host);
    }
    int index = node_index(r, name, name_len, (int)port);
    if (index < 0)
        return rl_error_set(err, RL_ERR_PROTOCOL,
                            "Redis Cluster named too many nodes (over %d) or a malformed one",
                            RL_CLUSTER_MAX_NODES);
    for (long long s = start; s <= end; s++)
        map[s] = (short)index;
    return RL_OK;
}

/* CLUSTER SLOTS: [[start, end, [host, port, id, ...], replicas...], ...]. Mutex held. */
static rl_status
parse_slots(rl_router *r, const redisReply *reply, short *map, const rl_address *asked,
            rl_error *err)
{
    if (reply->type != REDIS_REPLY_ARRAY)
        return rl_error_set(err, RL_ERR_PROTOCOL, "CLUSTER SLOTS answered %s",
                            rl_reply_type_name(reply->type));
    for (size_t i = 0; i < reply->elements; i++) {
        const redisReply *e = reply->element[i];
        if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
            e->element[0]->type != REDIS_REPLY_INTEGER ||
            e->element[1]->type != REDIS_REPLY_INTEGER ||
            e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2 ||
            e->element[2]->element[1]->type != REDIS_REPLY_INTEGER)
            return rl_error_set(err, RL_ERR_PROTOCOL, "CLUSTER SLOTS answered a malformed entry");
        const redisReply *master = e->element[2];
        rl_status st = map_range(r, map, e->element[0]->integer, e->element[1]->integer,
                                 master->element[0], master->element[1]->integer, asked, err);
        if (st != RL_OK)
            return st;
    }
    return RL_OK;
}

/* CLUSTER SHARDS: [["slots", [start, end, ...], "nodes", [{"ip", "port", "role", "health",
   ...}, ...]], ...], maps as flat arrays (RESP2). The shard's master, online first. Mutex
   held. */
static rl_status
parse_shards(rl_router *r, const redisReply *reply, short *map, const rl_address *asked,
             rl_error *err)
{
    if (reply->type != REDIS_REPLY_ARRAY)
        return rl_error_set(err, RL_ERR_PROTOCOL, "CLUSTER SHARDS answered %s",
                            rl_reply_type_name(reply->type));
    for (size_t i = 0; i < reply->elements; i++) {
        const redisReply *slots = map_get(reply->element[i], "slots");
        const redisReply *nodes = map_get(reply->element[i], "nodes");
        const redisReply *master = NULL;
        if (slots == NULL || nodes == NULL || slots->type != REDIS_REPLY_ARRAY ||
            nodes->type != REDIS_REPLY_ARRAY || slots->elements % 2 != 0)
            return rl_error_set(err, RL_ERR_PROTOCOL, "CLUSTER SHARDS answered a malformed shard");
        if (slots->elements == 0)
            continue; /* a shard without slots (a new, empty master) */
        for (size_t k = 0; k < nodes->elements; k++) {
            const redisReply *node = nodes->element[k];
            if (!string_is(map_get(node, "role"), "master"))
                continue;
            if (master == NULL || string_is(map_get(node, "health"), "online"))
                master = node;
        }
        const redisReply *port = map_get(master, r->tls ? "tls-port" : "port");
        if (master == NULL || port == NULL || port->type != REDIS_REPLY_INTEGER)
            return rl_error_set(err, RL_ERR_PROTOCOL,
                                "CLUSTER SHARDS answered a shard without a master");
        for (size_t k = 0; k < slots->elements; k += 2) {
            if (slots->element[k]->type != REDIS_REPLY_INTEGER ||
                slots->element[k + 1]->type != REDIS_REPLY_INTEGER)
                return rl_error_set(err, RL_ERR_PROTOCOL,
                                    "CLUSTER SHARDS answered a malformed slot range");
            rl_status st =
                map_range(r, map, slots->element[k]->integer, slots->element[k + 1]->integer,
                          map_get(master, "ip"), port->integer, asked, err);
            if (st != RL_OK)
                return st;
        }
    }
    return RL_OK;
}

/* What one sentinel says of the master: SENTINEL MASTER's flat map, as a node of the
   router (added when new). 0, or -1 when it does not know the master (or answered
   something else). Mutex held. */
static int
parse_sentinel_master(rl_router *r, const redisReply *reply, rl_sentinel_view *v, int *in_failover)
{
    const redisReply *ip = map_get(reply, "ip"), *port = map_get(reply, "port");
    const redisReply *epoch = map_get(reply, "config-epoch"), *flags = map_get(reply, "flags");
    char number[24];
    if (ip == NULL || port == NULL || ip->type != REDIS_REPLY_STRING ||
        port->type != REDIS_REPLY_STRING || port->len == 0 || port->len >= sizeof(number))
        return -1;
    memcpy(number, port->str, port->len);
    number[port->len] = '\0';
    char *end = NULL;
    long p = strtol(number, &end, 10);
    if (*end != '\0' || p < 1 || p > 65535)
        return -1;
    v->node = node_index(r, ip->str, ip->len, (int)p);
    v->epoch = 0;
    if (epoch != NULL && epoch->type == REDIS_REPLY_STRING && epoch->len < sizeof(number)) {
        memcpy(number, epoch->str, epoch->len);
        number[epoch->len] = '\0';
        v->epoch = strtoll(number, NULL, 10);
    }
    if (flags != NULL && flags->type == REDIS_REPLY_STRING &&
        memmem(flags->str, flags->len, "failover_in_progress", 20) != NULL)
        *in_failover = 1;
    return v->node < 0 ? -1 : 0;
}

/* ----------------------------------------------------------------- reads */

static void
question(rl_read *rd, rl_ask ask, int sentinel, int target, const char *master_name)
{
    static const char *const words[][2] = {
        [RL_ASK_SHARDS] = {"CLUSTER", "SHARDS"},
        [RL_ASK_SLOTS] = {"CLUSTER", "SLOTS"},
        [RL_ASK_SENTINEL_MASTER] = {"SENTINEL", "MASTER"},
        [RL_ASK_ROLE] = {"ROLE", NULL},
    };
    rl_question *q = &rd->q;
    q->ask = ask;
    q->sentinel = sentinel;
    q->target = target;
    q->argc = 0;
    for (int i = 0; i < 2 && words[ask][i] != NULL; i++) {
        q->argv[q->argc] = words[ask][i];
        q->argvlen[q->argc++] = strlen(words[ask][i]);
    }
    if (ask == RL_ASK_SENTINEL_MASTER) {
        q->argv[q->argc] = master_name;
        q->argvlen[q->argc++] = strlen(master_name);
    }
    /* Its share of what is left, at most RL_ASK_WAIT: a frozen node (a socket that accepts
       and never answers) costs a fraction of the read, never all of it. */
    int remaining = (rd->count - rd->next) > 0 ? rd->count - rd->next : 1;
    double now = rl_monotonic(), share = (rd->deadline - now) / remaining;
    q->deadline = now + (share < RL_ASK_WAIT ? share : RL_ASK_WAIT);
}

void
rl_read_begin(rl_router *r, rl_read *rd, double deadline)
{
    memset(rd, 0, sizeof(*rd));
    rd->deadline = deadline;
    rd->replaced = -1;
    rd->chosen = -1;
    rd->status = rl_error_set(&rd->error, RL_ERR_CONNECT,
                              r->master_name != NULL ? "no sentinel is known"
                                                     : "no Redis Cluster node is known");
    double now = rl_monotonic();
    pthread_mutex_lock(&r->mutex);
    rd->sentinels = r->master_name != NULL;
    if (rd->sentinels) {
        r->asked_at = now; /* every read asks them: the timer counts from here */
        /* The one that answered last first, those that timed out lately last. */
        int n = r->sentinel_count;
        for (int pass = 0; pass < 2; pass++) {
            for (int k = 0; k < n; k++) {
                int i = (r->last_sentinel + k) % n;
                if ((r->suspect_until[i] > now) == pass) {
                    rd->order[rd->count++] = i;
                    rd->suspects += pass;
                }
            }
        }
    } else {
        /* From a different node each time: a dead one is not always asked first. */
        int n = r->node_count;
        for (int k = 0; k < n; k++)
            rd->order[rd->count++] = (int)((r->reads + (unsigned long)k) % (unsigned long)n);
    }
    pthread_mutex_unlock(&r->mutex);
}

/* The master the answers agree on: the highest config epoch; between equal ones, the node
   more sentinels name. */
static int
choose_master(const rl_read *rd)
{
    int best = -1, best_votes = 0;
    for (int a = 0; a < rd->answered; a++) {
        int votes = 0;
        for (int b = 0; b < rd->answered; b++)
            votes +=
                rd->views[b].epoch == rd->views[a].epoch && rd->views[b].node == rd->views[a].node;
        if (best < 0 || rd->views[a].epoch > rd->views[best].epoch ||
            (rd->views[a].epoch == rd->views[best].epoch && votes > best_votes)) {
            best = a;
            best_votes = votes;
        }
    }
    return best < 0 ? -1 : rd->views[best].node;
}

/* Takes the answer to rd->q. Mutex held. 1: the read is over (rd->status). */
static int
take_answer(rl_router *r, rl_read *rd, rl_status st, const redisReply *reply, const rl_error *err)
{
    const rl_question *q = &rd->q;
    if (st == RL_ERR_CLOSED || st == RL_ERR_NOMEM) {
        rd->error = *err;
        rd->status = st;
        return 1;
    }
    switch (q->ask) {
    case RL_ASK_SHARDS:
    case RL_ASK_SLOTS:
        if (st == RL_ERR_AUTH) { /* the same credentials everywhere: no node will take them */
            rd->error = *err;
            rd->status = st;
            return 1;
        }
        if (st != RL_OK) {
            rd->error = *err;
            rd->status = st;
            return 0;
        }
        for (int s = 0; s < RL_CLUSTER_SLOTS; s++)
            rd->map[s] = -1;
        {
            rl_address asked = r->nodes[q->target];
            st = q->ask == RL_ASK_SHARDS ? parse_shards(r, reply, rd->map, &asked, &rd->error)
                                         : parse_slots(r, reply, rd->map, &asked, &rd->error);
        }
        r->reads++;
        rd->status = st;
        if (st != RL_OK)
            return 0;
        memcpy(r->slots, rd->map, sizeof(short) * RL_CLUSTER_SLOTS);
        return 1;
    case RL_ASK_SENTINEL_MASTER:
        if (st != RL_OK) {
            if (st != RL_ERR_SERVER)
                r->suspect_until[q->target] = rl_monotonic() + RL_SENTINEL_SUSPECT;
            rd->error = *err;
            rd->status = st;
            return 0;
        }
        if (rd->answered < RL_CLUSTER_MAX_NODES &&
            parse_sentinel_master(r, reply, &rd->views[rd->answered], &rd->in_failover) == 0) {
            if (rd->answered++ == 0) {
                r->last_sentinel = q->target;
                r->suspect_until[q->target] = 0;
            }
        } else {
            rd->status = rl_error_set(&rd->error, RL_ERR_CONNECT,
                                      "the sentinel at %.200s:%d does not know a master named "
                                      "%.60s",
                                      r->sentinels[q->target].host, r->sentinels[q->target].port,
                                      r->master_name);
        }
        return 0;
    case RL_ASK_ROLE:
    default:
        /* A node that cannot be asked is not refused here: the call that goes there finds
           out. One that answers as a replica is never used. */
        if (st == RL_OK && reply->type == REDIS_REPLY_ARRAY && reply->elements > 0 &&
            !string_is(reply->element[0], "master")) {
            rd->status = rl_error_set(&rd->error, RL_ERR_CONNECT,
                                      "the sentinels named %.200s:%d as the master, but it "
                                      "answers ROLE as a replica",
                                      r->nodes[q->target].host, r->nodes[q->target].port);
            return 1;
        }
        if (r->master != q->target)
            rd->replaced = r->master;
        r->master = q->target;
        rd->status = RL_OK;
        return 1;
    }
}

int
rl_read_step(rl_router *r, rl_read *rd, rl_status st, const redisReply *reply, const rl_error *err)
{
    int over = 0;
    pthread_mutex_lock(&r->mutex);
    if (rd->started) {
        if (rd->q.ask == RL_ASK_SHARDS && st == RL_ERR_SERVER) {
            /* Before Redis 7: no CLUSTER SHARDS; the same node, its share again. */
            rd->next--;
            question(rd, RL_ASK_SLOTS, 0, rd->q.target, NULL);
            rd->next++;
            pthread_mutex_unlock(&r->mutex);
            return 1;
        }
        over = take_answer(r, rd, st, reply, err);
    } else if (!rd->sentinels && rd->map == NULL &&
               (rd->map = malloc(sizeof(short) * RL_CLUSTER_SLOTS)) == NULL) {
        rd->status =
            rl_error_set(&rd->error, RL_ERR_NOMEM, "out of memory reading the cluster's slot map");
        over = 1;
    }
    rd->started = 1;
    if (over)
        goto done;
    if (!rd->sentinels) {
        if (rd->next < rd->count && rl_monotonic() < rd->deadline) {
            int node = rd->order[rd->next];
            question(rd, RL_ASK_SHARDS, 0, node, NULL);
            rd->next++;
            pthread_mutex_unlock(&r->mutex);
            return 1;
        }
        goto done;
    }
    /* Every sentinel (not the suspects once one answered), then the choice. */
    if (rd->next < rd->count && !(rd->answered > 0 && rd->next >= rd->count - rd->suspects)) {
        int sentinel = rd->order[rd->next];
        question(rd, RL_ASK_SENTINEL_MASTER, 1, sentinel, r->master_name);
        rd->next++;
        pthread_mutex_unlock(&r->mutex);
        return 1;
    }
    if (rd->answered == 0)
        goto done;
    double now = rl_monotonic();
    r->failover_since = rd->in_failover ? (r->failover_since > 0 ? r->failover_since : now) : 0;
    r->reads++;
    rd->chosen = choose_master(rd);
    if (rd->chosen == r->master) {
        rd->status = RL_OK;
        goto done;
    }
    rd->next = rd->count - 1; /* ROLE gets the share of one */
    question(rd, RL_ASK_ROLE, 0, rd->chosen, NULL);
    rd->next = rd->count;
    pthread_mutex_unlock(&r->mutex);
    return 1;
done:
    pthread_mutex_unlock(&r->mutex);
    return 0;
}

void
rl_read_end(rl_router *r, rl_read *rd, rl_route *rt)
{
    if (rt != NULL) {
        rt->read_status = rd->status;
        if (rd->status != RL_OK)
            rt->read_error = rd->error;
    }
    free(rd->map);
    rd->map = NULL;
    pthread_mutex_lock(&r->mutex);
    r->reading_since = 0;
    r->read_at = rl_monotonic();
    r->moved_since_read = 0;
    pthread_mutex_unlock(&r->mutex);
}

/* ----------------------------------------------------------------- calls */

void
rl_route_begin(rl_route *rt, int slot, double deadline)
{
    memset(rt, 0, sizeof(*rt));
    rt->slot = slot;
    rt->deadline = deadline;
    rt->ask = -1;
    rt->patch_node = -1;
    rt->node = -1;
}

/* Mutex held: WAIT for a pause within the deadline, or FAIL. */
static rl_route_action
pause_or_fail(rl_route *rt, double now)
{
    double left = rt->deadline - now;
    if (left <= 0)
        return RL_ROUTE_FAIL;
    rt->seconds = left < RL_CLUSTER_PAUSE ? left : RL_CLUSTER_PAUSE;
    return RL_ROUTE_WAIT;
}

rl_route_action
rl_route_next(rl_router *r, rl_route *rt, rl_error *err)
{
    rl_route_action action;
    double now = rl_monotonic();
    rt->asking = 0;
    rt->status = rt->last_status;
    pthread_mutex_lock(&r->mutex);
    if (rt->want_pause) {
        rt->want_pause = 0;
        if ((action = pause_or_fail(rt, now)) == RL_ROUTE_WAIT)
            goto out;
        if (rt->busy[0] != '\0') /* not the single-node hint: a cluster that stayed busy */
            rt->status = rl_error_set(err, RL_ERR_IO,
                                      "the Redis Cluster answered %.128s until the call's "
                                      "deadline (socket_timeout)",
                                      rt->busy);
        goto out;
    }
    if (rt->want_read) {
        rt->want_read = 0;
        if (claim_read(r, now)) {
            rt->read_deadline = rt->deadline;
            action = RL_ROUTE_READ;
            goto out;
        }
    }
    if (rt->patch_node >= 0) { /* MOVED, after the read it asked for */
        r->slots[rt->patch_slot] = (short)rt->patch_node;
        rt->patch_node = -1;
    }
    if (r->master_name != NULL) {
        int failover = r->failover_since > 0 && now - r->failover_since < RL_SENTINEL_FAILOVER_HOLD;
        double period = failover ? RL_CLUSTER_PAUSE : RL_SENTINEL_RECHECK;
        if (r->master >= 0 && now - r->asked_at >= period && claim_read(r, now)) {
            /* Its own deadline, not what is left of the call's: a sentinel is suspected
               only when it missed a full share. */
            r->asked_at = now;
            rt->read_deadline = now + RL_ASK_WAIT * r->sentinel_count;
            action = RL_ROUTE_READ;
            goto out;
        }
        if (failover) {
            if ((action = pause_or_fail(rt, now)) == RL_ROUTE_FAIL)
                rt->status = rl_error_set(err, RL_ERR_CONNECT,
                                          "a Sentinel failover of %.100s is under way (no "
                                          "decision is sent to a master that may be replaced)",
                                          r->master_name);
            goto out;
        }
    } else if (now < r->stale_until && now - r->stale_read_at >= RL_STALE_REREAD &&
               claim_read(r, now)) {
        /* A call timed out lately: its node may be frozen (SIGSTOP, a stalled VM) and its
           replica promoted any moment: the calls leave that node as soon as the map says. */
        r->stale_read_at = now;
        rt->read_deadline = rt->deadline;
        action = RL_ROUTE_READ;
        goto out;
    }
    if (rt->ask >= 0) {
        rt->node = rt->ask;
        rt->asking = 1;
        rt->ask = -1;
        action = RL_ROUTE_SEND;
        goto out;
    }
    rt->node = destination(r, rt->slot);
    if (rt->node >= 0) {
        action = RL_ROUTE_SEND;
        goto out;
    }
    if (!rt->read_once && claim_read(r, now)) {
        rt->read_once = 1;
        if (r->master_name != NULL)
            r->asked_at = now;
        rt->read_deadline = rt->deadline;
        action = RL_ROUTE_READ;
        goto out;
    }
    if (!rt->read_once && (action = pause_or_fail(rt, now)) == RL_ROUTE_WAIT)
        goto out; /* another caller reads the map: this one waits for it */
    action = RL_ROUTE_FAIL;
    if (rt->read_status != RL_OK) { /* the read's own error says why */
        *err = rt->read_error;
        rt->status = err->kind;
    } else if (r->master_name != NULL)
        rt->status = rl_error_set(err, RL_ERR_CONNECT, "the sentinels named no master");
    else
        rt->status = rl_error_set(err, RL_ERR_CONNECT,
                                  "no Redis Cluster node serves hash slot %d (are all slots "
                                  "assigned?)",
                                  rt->slot);
out:
    pthread_mutex_unlock(&r->mutex);
    return action;
}

/* "MOVED 3999 127.0.0.1:6381" / "ASK ...": the slot and the node (added when new). 0, or
   -1 when the text is not that. Mutex held. */
static int
parse_redirect(rl_router *r, const char *text, int *slot, int *node)
{
    const char *space = strchr(text, ' ');
    char *end = NULL;
    if (space == NULL)
        return -1;
    long s = strtol(space + 1, &end, 10);
    if (end == NULL || *end != ' ' || s < 0 || s >= RL_CLUSTER_SLOTS)
        return -1;
    const char *address = end + 1, *colon = strrchr(address, ':');
    if (colon == NULL || colon == address)
        return -1;
    long port = strtol(colon + 1, &end, 10);
    if (*end != '\0' || port < 1 || port > 65535)
        return -1;
    const char *host = address;
    size_t host_len = (size_t)(colon - address);
    if (host_len >= 2 && host[0] == '[' && host[host_len - 1] == ']') {
        host++;
        host_len -= 2;
    }
    *node = node_index(r, host, host_len, (int)port);
    *slot = (int)s;
    return *node < 0 ? -1 : 0;
}

int
rl_route_failed(rl_router *r, rl_route *rt, rl_status st, rl_error *err)
{
    int go_on = 0, slot, node;
    double now = rl_monotonic();
    rt->last_status = rt->status = st;
    rt->own_error = 0;
    pthread_mutex_lock(&r->mutex);
    switch (st) {
    case RL_ERR_REDIRECT:
        if (strncmp(err->message, "MOVED ", 6) == 0 &&
            parse_redirect(r, err->message, &slot, &node) == 0) {
            /* MOVED is the only answer tried again without a pause: bound it (nodes that
               send a call back and forth), the others by the deadline. */
            if (++rt->moved >= RL_CLUSTER_MAX_ATTEMPTS) {
                rt->own_error = 1;
                rt->status = rl_error_set(err, RL_ERR_IO,
                                          "the Redis Cluster answered MOVED %d times to one call",
                                          RL_CLUSTER_MAX_ATTEMPTS);
                break;
            }
            if (++r->moved_since_read >= RL_MOVED_READ_EVERY ||
                now - r->read_at >= RL_MOVED_READ_AFTER) {
                rt->want_read = 1; /* others may have moved too: read, then patch */
                rt->patch_slot = slot;
                rt->patch_node = node;
            } else {
                r->slots[slot] = (short)node;
            }
            go_on = 1;
            break;
        }
        if (strncmp(err->message, "ASK ", 4) == 0 &&
            parse_redirect(r, err->message, &slot, &node) == 0) {
            rt->ask = node;
            go_on = 1;
            break;
        }
        /* TRYAGAIN, CLUSTERDOWN: pause, then read the map again. */
        snprintf(rt->busy, sizeof(rt->busy), "%.120s", err->message);
        rt->want_pause = rt->want_read = 1;
        go_on = 1;
        break;
    case RL_ERR_CONNECT:
    case RL_ERR_IO: /* a dead node: its replica takes over within the failover time */
        rt->busy[0] = '\0';
        rt->want_pause = rt->want_read = 1;
        go_on = 1;
        break;
    case RL_ERR_SERVER:
        /* Sentinel: a demoted master refuses the script's first write (its trim) with
           Redis's READONLY error code, so nothing ran: ask the sentinels for the new one. */
        if (r->master_name != NULL && strstr(err->message, "READONLY") != NULL) {
            rt->busy[0] = '\0';
            rt->want_pause = rt->want_read = 1;
            go_on = 1;
        }
        break;
    case RL_ERR_TIMEOUT:
        /* Not tried again (the decision may have run), but the node may be frozen and its
           replica promoted meanwhile: the next calls read the map (ask the sentinels). */
        r->stale_until = now + 2 * r->socket_timeout;
        r->asked_at = 0;
        break;
    default:
        break; /* an error reply, garbage, a refused password: as on a single node */
    }
    pthread_mutex_unlock(&r->mutex);
    return go_on;
}
