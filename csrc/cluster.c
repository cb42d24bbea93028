/*
 * cluster.c - Redis Cluster for the blocking limiter: hash slots, the slot map, a pool of
 * connections per node, and the call that follows the cluster's answers.
 *
 * Every key of one decision carries the user id in a hash tag (script.c, rl_key_user), so
 * one decision is one script on one node, never CROSSSLOT. A call goes to the node that
 * the map says serves the decision's slot, then:
 *   - MOVED: the map is wrong (a failover, a resharding): the slot is pointed at the node
 *     named, the whole map is asked for again, and the decision is sent there;
 *   - ASK: the slot is migrating: ASKING and the decision, once, on the node named;
 *   - TRYAGAIN, CLUSTERDOWN, a refused connection or a node that died mid-call: a short
 *     pause, the map asked for again (from any node that answers), and the decision sent
 *     where it now belongs;
 * all within the call's one deadline (socket_timeout, plus the time spent connecting, as
 * on a single node). A decision whose connection broke mid-call is resent in its replay
 * form (proto.c's rule, kept across nodes): the script answers "already counted" for an
 * entry its first attempt wrote, so a retry never counts a request twice. The NOSCRIPT
 * reload is per connection (proto.c), so a promoted replica loads the script by itself.
 *
 * The map comes from CLUSTER SHARDS (Redis 7), or CLUSTER SLOTS where that is unknown.
 *
 * Sentinel mode uses the same call with one destination: the master that the sentinels
 * agree on (SENTINEL MASTER from each, the highest config epoch, checked with ROLE),
 * asked again every RL_SENTINEL_RECHECK while calls flow, at once when it is gone (a
 * connection refused or broken mid-call: the replay rule holds) or answers READONLY (a
 * demoted master: nothing ran); while a sentinel reports a failover under way the calls
 * wait (within their deadline) rather than write to a master about to be replaced.
 * A call that timed out makes the map (or the master) be asked again: its node may be
 * frozen, and replaced by the time the next call goes out.
 * Nodes are never forgotten (a cluster has few): a node's pool is only ever added.
 *
 * Why not hiredis-cluster / libvalkey: neither is packaged in Debian 12, the wheel and
 * the hiredis 1.x build would each need it built and bundled, and both own the socket
 * and reply parsing that proto.c already does for both limiters (NOSCRIPT, replay marker,
 * bounded reader). What a decision needs of a cluster is this file.
 *
 * GIL contract: rl_cluster_init/add_seed/after_fork run with the GIL held, everything
 * else without it, like conn.c. Lock order: the GIL is released first; the cluster's
 * mutex is never held while a pool's mutex is taken or across I/O.
 */
#include "native.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RL_CLUSTER_MAX_ATTEMPTS 64    /* MOVED answers to one call (the deadline bounds the rest) */
#define RL_CLUSTER_PAUSE 0.025        /* seconds between retries while a failover is under way */
#define RL_ASK_WAIT 0.25              /* the most one sentinel or map source may take to answer */
#define RL_SENTINEL_RECHECK 0.1       /* seconds between two askings of the sentinels */
#define RL_STALE_REREAD 0.1           /* seconds between two map reads after a timeout */
#define RL_SENTINEL_SUSPECT 5.0       /* a sentinel that timed out is asked last this long */
#define RL_SENTINEL_FAILOVER_HOLD 5.0 /* the longest a failover under way holds the calls */

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

/* ---------------------------------------------------------------- nodes */

/* A node's config takes the limiter's TLS context (shared: each config frees its own
   reference). */
static void
share_tls(rl_config *cfg, const rl_config *base)
{
    if (base->ssl_ctx == NULL)
        return;
    SSL_CTX_up_ref(base->ssl_ctx);
    cfg->ssl_ctx = base->ssl_ctx;
    cfg->tls = 1;
    cfg->tls_verify = base->tls_verify;
}

/* The index of the node at host:port, added when new. Cluster mutex held. -1: no room or
   no memory. */
static int
node_index(rl_cluster *c, const char *host, size_t host_len, int port)
{
    for (int i = 0; i < c->node_count; i++) {
        const rl_config *cfg = &c->nodes[i]->pool.config;
        if (cfg->port == port && strlen(cfg->host) == host_len &&
            memcmp(cfg->host, host, host_len) == 0)
            return i;
    }
    if (c->node_count == RL_CLUSTER_MAX_NODES)
        return -1;
    char *name = strndup(host, host_len);
    rl_node *node = calloc(1, sizeof(*node));
    const rl_config *base = &c->base;
    if (name == NULL || node == NULL ||
        rl_config_init(&node->pool.config, name, port, NULL, base->db, base->username,
                       base->password, base->connect_timeout, base->socket_timeout) < 0) {
        free(name);
        free(node);
        return -1;
    }
    free(name);
    share_tls(&node->pool.config, base);
    node->pool.config.min_replicas = base->min_replicas;
    node->pool.config.replica_timeout_ms = base->replica_timeout_ms;
    if (rl_pool_init(&node->pool, c->max_open) < 0) {
        rl_config_clear(&node->pool.config);
        free(node);
        return -1;
    }
    node->pool.closed = c->closed;
    node->pool.metrics = c->metrics;
    c->nodes[c->node_count] = node;
    return c->node_count++;
}

/* A sentinel's pool: its own address, no credentials (the URL's are the data nodes'), the
   same timeouts and TLS. NULL when out of memory. */
static rl_node *
sentinel_new(const rl_cluster *c, const char *host, int port)
{
    const rl_config *base = &c->base;
    rl_node *node = calloc(1, sizeof(*node));
    if (node == NULL || rl_config_init(&node->pool.config, host, port, NULL, 0, NULL, NULL,
                                       base->connect_timeout, base->socket_timeout) < 0) {
        free(node);
        return NULL;
    }
    share_tls(&node->pool.config, base);
    if (rl_pool_init(&node->pool, 2) < 0) { /* a question now and then */
        rl_config_clear(&node->pool.config);
        free(node);
        return NULL;
    }
    return node;
}

int
rl_cluster_init(rl_cluster *c, int max_open, const char *master_name)
{
    c->master = -1;
    if (master_name != NULL && (c->master_name = strdup(master_name)) == NULL)
        return -1;
    int rc = pthread_mutex_init(&c->mutex, NULL);
    if (rc != 0) {
        errno = rc;
        return -1;
    }
    c->max_open = max_open;
    for (int i = 0; i < RL_CLUSTER_SLOTS; i++)
        c->slots[i] = -1;
    c->initialized = 1;
    return 0;
}

int
rl_cluster_add_seed(rl_cluster *c, const char *host, int port)
{
    if (c->master_name == NULL)
        return node_index(c, host, strlen(host), port) < 0 ? -1 : 0;
    if (c->sentinel_count == RL_CLUSTER_MAX_NODES)
        return -1;
    rl_node *sentinel = sentinel_new(c, host, port);
    if (sentinel == NULL)
        return -1;
    c->sentinels[c->sentinel_count++] = sentinel;
    return 0;
}

/* A copy of the node list (nodes are never removed: the pointers stay valid). */
static int
nodes_snapshot(rl_cluster *c, rl_node **out)
{
    pthread_mutex_lock(&c->mutex);
    int n = c->node_count;
    memcpy(out, c->nodes, (size_t)n * sizeof(rl_node *));
    pthread_mutex_unlock(&c->mutex);
    return n;
}

void
rl_cluster_close(rl_cluster *c)
{
    rl_node *nodes[RL_CLUSTER_MAX_NODES];
    pthread_mutex_lock(&c->mutex);
    c->closed = 1;
    pthread_mutex_unlock(&c->mutex);
    int n = nodes_snapshot(c, nodes);
    for (int i = 0; i < n; i++)
        rl_pool_close(&nodes[i]->pool);
    for (int i = 0; i < c->sentinel_count; i++) /* fixed after init */
        rl_pool_close(&c->sentinels[i]->pool);
}

void
rl_cluster_destroy(rl_cluster *c)
{
    for (int i = 0; i < c->sentinel_count; i++) {
        rl_pool_destroy(&c->sentinels[i]->pool);
        rl_config_clear(&c->sentinels[i]->pool.config);
        free(c->sentinels[i]);
    }
    c->sentinel_count = 0;
    free(c->master_name);
    c->master_name = NULL;
    if (!c->initialized) {
        rl_config_clear(&c->base);
        return;
    }
    for (int i = 0; i < c->node_count; i++) {
        rl_pool_destroy(&c->nodes[i]->pool);
        rl_config_clear(&c->nodes[i]->pool.config);
        free(c->nodes[i]);
    }
    c->node_count = 0;
    pthread_mutex_destroy(&c->mutex);
    rl_config_clear(&c->base);
    c->initialized = 0;
}

void
rl_cluster_after_fork(rl_cluster *c)
{
    (void)pthread_mutex_init(&c->mutex, NULL);
    c->asking = 0; /* a parent's thread that was asking is not in the child */
    c->reading = 0;
    for (int i = 0; i < c->node_count; i++)
        rl_pool_after_fork(&c->nodes[i]->pool);
    for (int i = 0; i < c->sentinel_count; i++)
        rl_pool_after_fork(&c->sentinels[i]->pool);
}

int
rl_cluster_open_count(rl_cluster *c)
{
    rl_node *nodes[RL_CLUSTER_MAX_NODES];
    int n = nodes_snapshot(c, nodes), open = 0;
    for (int i = 0; i < n; i++)
        open += rl_pool_open_count(&nodes[i]->pool);
    return open;
}

int
rl_cluster_is_closed(rl_cluster *c)
{
    pthread_mutex_lock(&c->mutex);
    int closed = c->closed;
    pthread_mutex_unlock(&c->mutex);
    return closed;
}

int
rl_cluster_take_warning(rl_cluster *c, char *buf)
{
    rl_node *nodes[RL_CLUSTER_MAX_NODES];
    int n = nodes_snapshot(c, nodes);
    for (int i = 0; i < n; i++) {
        if (__atomic_load_n(&nodes[i]->pool.warning_state, __ATOMIC_RELAXED) == 1 &&
            rl_pool_take_warning(&nodes[i]->pool, buf))
            return 1;
    }
    return 0;
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
   answered). Cluster mutex held. */
static rl_status
map_range(rl_cluster *c, short *map, long long start, long long end, const redisReply *host,
          long long port, const rl_config *asked, rl_error *err)
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
    int index = node_index(c, name, name_len, (int)port);
    if (index < 0)
        return rl_error_set(err, RL_ERR_NOMEM, "too many Redis Cluster nodes (over %d)",
                            RL_CLUSTER_MAX_NODES);
    for (long long s = start; s <= end; s++)
        map[s] = (short)index;
    return RL_OK;
}

/* CLUSTER SLOTS: [[start, end, [host, port, id, ...], replicas...], ...]. */
static rl_status
parse_slots(rl_cluster *c, const redisReply *r, short *map, const rl_config *asked, rl_error *err)
{
    if (r->type != REDIS_REPLY_ARRAY)
        return rl_error_set(err, RL_ERR_PROTOCOL, "CLUSTER SLOTS answered %s",
                            rl_reply_type_name(r->type));
    for (size_t i = 0; i < r->elements; i++) {
        const redisReply *e = r->element[i];
        if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
            e->element[0]->type != REDIS_REPLY_INTEGER ||
            e->element[1]->type != REDIS_REPLY_INTEGER ||
            e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2 ||
            e->element[2]->element[1]->type != REDIS_REPLY_INTEGER)
            return rl_error_set(err, RL_ERR_PROTOCOL, "CLUSTER SLOTS answered a malformed entry");
        const redisReply *master = e->element[2];
        rl_status st = map_range(c, map, e->element[0]->integer, e->element[1]->integer,
                                 master->element[0], master->element[1]->integer, asked, err);
        if (st != RL_OK)
            return st;
    }
    return RL_OK;
}

/* CLUSTER SHARDS: [["slots", [start, end, ...], "nodes", [{"ip", "port", "role", "health",
   ...}, ...]], ...], maps as flat arrays (RESP2). The shard's master, online first. */
static rl_status
parse_shards(rl_cluster *c, const redisReply *r, short *map, const rl_config *asked, rl_error *err)
{
    if (r->type != REDIS_REPLY_ARRAY)
        return rl_error_set(err, RL_ERR_PROTOCOL, "CLUSTER SHARDS answered %s",
                            rl_reply_type_name(r->type));
    for (size_t i = 0; i < r->elements; i++) {
        const redisReply *slots = map_get(r->element[i], "slots");
        const redisReply *nodes = map_get(r->element[i], "nodes");
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
        const redisReply *port = map_get(master, c->base.tls ? "tls-port" : "port");
        if (master == NULL || port == NULL || port->type != REDIS_REPLY_INTEGER)
            return rl_error_set(err, RL_ERR_PROTOCOL,
                                "CLUSTER SHARDS answered a shard "
                                "without a master");
        for (size_t k = 0; k < slots->elements; k += 2) {
            if (slots->element[k]->type != REDIS_REPLY_INTEGER ||
                slots->element[k + 1]->type != REDIS_REPLY_INTEGER)
                return rl_error_set(err, RL_ERR_PROTOCOL,
                                    "CLUSTER SHARDS answered a malformed slot range");
            rl_status st =
                map_range(c, map, slots->element[k]->integer, slots->element[k + 1]->integer,
                          map_get(master, "ip"), port->integer, asked, err);
            if (st != RL_OK)
                return st;
        }
    }
    return RL_OK;
}

/* Waits a little before the next attempt (a failover or a migration needs time), never
   past the deadline. 0, or -1 when no time is left. */
static int
pause_before_retry(double deadline)
{
    double left = deadline - rl_monotonic();
    if (left <= 0)
        return -1;
    double wait = left < RL_CLUSTER_PAUSE ? left : RL_CLUSTER_PAUSE;
    struct timespec ts = {(time_t)wait, (long)((wait - (double)(time_t)wait) * 1e9)};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
    return 0;
}

/* The seconds one node may take to answer a question of ours when `remaining` nodes are
   still to be asked before deadline: its share, at most RL_ASK_WAIT, so a frozen node (a
   socket that accepts and never answers) costs a fraction of the call, never all of it. */
static double
ask_deadline(double deadline, int remaining)
{
    double now = rl_monotonic(), share = (deadline - now) / (remaining > 0 ? remaining : 1);
    return now + (share < RL_ASK_WAIT ? share : RL_ASK_WAIT);
}

/* What one sentinel says of the master: SENTINEL MASTER's flat map. 0, or -1 when it does
   not know the master (or answered something else). */
typedef struct {
    char host[256];
    int port;
    long long epoch; /* config-epoch: bumped by each failover */
    int in_failover; /* flags hold failover_in_progress (this sentinel leads one) */
} sentinel_view;

static int
parse_sentinel_master(const redisReply *r, sentinel_view *v)
{
    const redisReply *ip = map_get(r, "ip"), *port = map_get(r, "port");
    const redisReply *epoch = map_get(r, "config-epoch"), *flags = map_get(r, "flags");
    if (ip == NULL || port == NULL || ip->type != REDIS_REPLY_STRING ||
        port->type != REDIS_REPLY_STRING || ip->len == 0 || ip->len >= sizeof(v->host))
        return -1;
    memcpy(v->host, ip->str, ip->len);
    v->host[ip->len] = '\0';
    v->port = (int)strtol(port->str, NULL, 10);
    v->epoch =
        epoch != NULL && epoch->type == REDIS_REPLY_STRING ? strtoll(epoch->str, NULL, 10) : 0;
    v->in_failover = flags != NULL && flags->type == REDIS_REPLY_STRING &&
                     strstr(flags->str, "failover_in_progress") != NULL;
    return v->port >= 1 && v->port <= 65535 ? 0 : -1;
}

/* ROLE on a node the sentinels name: RL_OK unless it answers that it is a replica (a
   stale sentinel's pick, or a master demoted meanwhile). A node that cannot be asked is
   not refused here: the call that goes there finds out. */
static rl_status
verify_master(rl_node *node, double deadline, rl_error *err)
{
    const char *argv[1] = {"ROLE"};
    size_t argvlen[1] = {4};
    redisReply *reply = NULL;
    rl_error ignored;
    if (rl_pool_command(&node->pool, 1, argv, argvlen, deadline, &reply, &ignored) != RL_OK)
        return RL_OK;
    int replica = reply->type == REDIS_REPLY_ARRAY && reply->elements > 0 &&
                  !string_is(reply->element[0], "master");
    freeReplyObject(reply);
    if (replica)
        return rl_error_set(err, RL_ERR_CONNECT,
                            "the sentinels named %s:%d as the master, but it answers ROLE "
                            "as a replica",
                            node->pool.config.host, node->pool.config.port);
    return RL_OK;
}

/* Sentinel mode: asks every sentinel where the master is (SENTINEL MASTER), each within
   its share of the deadline, the last one that answered first and one that timed out last
   (and not at all once another answered); points every decision at the address of the
   highest config epoch among the answers, after ROLE confirmed it is no replica. Notes a
   failover under way (any sentinel's flags say so). RL_OK, or the last error. */
static rl_status
ask_sentinels(rl_cluster *c, double deadline, rl_error *err)
{
    rl_status st = rl_error_set(err, RL_ERR_CONNECT, "no sentinel is known");
    int n = c->sentinel_count, order[RL_CLUSTER_MAX_NODES], count = 0, answered = 0;
    double now = rl_monotonic();
    pthread_mutex_lock(&c->mutex);
    int first = c->last_sentinel, suspects = 0;
    for (int pass = 0; pass < 2; pass++) { /* the trusted ones, then the suspects */
        for (int k = 0; k < n; k++) {
            int i = (first + k) % n;
            if ((c->suspect_until[i] > now) == pass) {
                order[count++] = i;
                suspects += pass;
            }
        }
    }
    pthread_mutex_unlock(&c->mutex);
    sentinel_view views[RL_CLUSTER_MAX_NODES], *view;
    int in_failover = 0;
    for (int k = 0; k < count; k++) {
        int i = order[k];
        rl_node *sentinel = c->sentinels[i];
        if (answered > 0 && k >= count - suspects)
            break; /* only suspects are left, and a sentinel answered */
        const char *argv[3] = {"SENTINEL", "MASTER", c->master_name};
        size_t argvlen[3] = {8, 6, strlen(c->master_name)};
        redisReply *reply = NULL;
        st = rl_pool_command(&sentinel->pool, 3, argv, argvlen, ask_deadline(deadline, count - k),
                             &reply, err);
        if (st == RL_ERR_CLOSED || st == RL_ERR_NOMEM)
            return st;
        if (st != RL_OK) {
            if (st != RL_ERR_SERVER) {
                pthread_mutex_lock(&c->mutex);
                c->suspect_until[i] = rl_monotonic() + RL_SENTINEL_SUSPECT;
                pthread_mutex_unlock(&c->mutex);
            }
            continue;
        }
        view = &views[answered];
        int known = parse_sentinel_master(reply, view) == 0;
        freeReplyObject(reply);
        if (!known) {
            st = rl_error_set(
                err, RL_ERR_CONNECT, "the sentinel at %s:%d does not know a master named %.100s",
                sentinel->pool.config.host, sentinel->pool.config.port, c->master_name);
            continue;
        }
        if (answered++ == 0) {
            pthread_mutex_lock(&c->mutex);
            c->last_sentinel = i;
            c->suspect_until[i] = 0;
            pthread_mutex_unlock(&c->mutex);
        }
        in_failover |= view->in_failover;
    }
    /* The highest config epoch; between equal ones, the address more sentinels name. */
    sentinel_view *best = NULL;
    int best_votes = 0;
    for (int a = 0; a < answered; a++) {
        int votes = 0;
        for (int b = 0; b < answered; b++)
            votes += views[b].epoch == views[a].epoch && views[b].port == views[a].port &&
                     strcmp(views[b].host, views[a].host) == 0;
        if (best == NULL || views[a].epoch > best->epoch ||
            (views[a].epoch == best->epoch && votes > best_votes)) {
            best = &views[a];
            best_votes = votes;
        }
    }
    if (answered == 0)
        return st;
    pthread_mutex_lock(&c->mutex);
    now = rl_monotonic();
    c->failover_since = in_failover ? (c->failover_since > 0 ? c->failover_since : now) : 0;
    int index = node_index(c, best->host, strlen(best->host), best->port);
    int changed = index >= 0 && index != c->master;
    rl_node *node = index >= 0 ? c->nodes[index] : NULL;
    c->refreshes++;
    pthread_mutex_unlock(&c->mutex);
    if (index < 0)
        return rl_error_set(err, RL_ERR_NOMEM, "too many Redis nodes (over %d)",
                            RL_CLUSTER_MAX_NODES);
    if (!changed)
        return RL_OK;
    if ((st = verify_master(node, ask_deadline(deadline, 1), err)) != RL_OK)
        return st;
    pthread_mutex_lock(&c->mutex);
    int old = c->master;
    c->master = index;
    rl_node *previous = old >= 0 && old != index ? c->nodes[old] : NULL;
    pthread_mutex_unlock(&c->mutex);
    if (previous != NULL)
        rl_pool_drop_idle(&previous->pool); /* no new call goes to the old master */
    return RL_OK;
}

/* Sentinel mode, before each call: asks the sentinels again when the last answer is older
   than RL_SENTINEL_RECHECK (one thread asks, the others go on with the master they know),
   and waits, within the deadline, while a sentinel reports a failover under way: a write
   to the old master then may be lost when the replica takes over, and count nothing. RL_OK,
   or RL_ERR_CONNECT when the failover outlasted the deadline. */
static rl_status
follow_sentinels(rl_cluster *c, double deadline, rl_error *err)
{
    for (;;) {
        double now = rl_monotonic();
        pthread_mutex_lock(&c->mutex);
        int failover = c->failover_since > 0 && now - c->failover_since < RL_SENTINEL_FAILOVER_HOLD;
        double period = failover ? RL_CLUSTER_PAUSE : RL_SENTINEL_RECHECK;
        int due = c->master >= 0 && !c->asking && now - c->asked_at >= period;
        if (due) {
            c->asking = 1;
            c->asked_at = now;
        }
        pthread_mutex_unlock(&c->mutex);
        if (due) {
            /* Its own deadline, not what is left of the call's: a sentinel is suspected
               only when it missed a full share. */
            rl_error ignored; /* the call's own error says more; the next tick asks again */
            (void)ask_sentinels(c, rl_monotonic() + RL_ASK_WAIT * c->sentinel_count, &ignored);
            pthread_mutex_lock(&c->mutex);
            c->asking = 0;
            failover = c->failover_since > 0 &&
                       rl_monotonic() - c->failover_since < RL_SENTINEL_FAILOVER_HOLD;
            pthread_mutex_unlock(&c->mutex);
        }
        if (!failover)
            return RL_OK;
        if (pause_before_retry(deadline) < 0)
            return rl_error_set(err, RL_ERR_CONNECT,
                                "a Sentinel failover of %.100s is under way (no decision is "
                                "sent to a master that may be replaced)",
                                c->master_name);
    }
}

/* Asks the nodes, one after another, for the slot map, and installs the first answer
   (in sentinel mode: asks the sentinels for the master). RL_OK, or the last error. */
static rl_status
refresh(rl_cluster *c, double deadline, rl_error *err)
{
    if (c->master_name != NULL)
        return ask_sentinels(c, deadline, err);
    rl_node *nodes[RL_CLUSTER_MAX_NODES];
    short *map = malloc(sizeof(short) * RL_CLUSTER_SLOTS);
    int n = nodes_snapshot(c, nodes);
    pthread_mutex_lock(&c->mutex);
    unsigned long first = c->refreshes;
    pthread_mutex_unlock(&c->mutex);
    rl_status st = rl_error_set(err, RL_ERR_CONNECT, "no Redis Cluster node is known");
    if (map == NULL)
        return rl_error_set(err, RL_ERR_NOMEM, "out of memory reading the cluster's slot map");
    for (int k = 0; k < n; k++) {
        /* Start from a different node each time: a dead one is not always asked first. */
        rl_node *node = nodes[(k + first) % (unsigned long)n];
        redisReply *reply = NULL;
        const char *argv[2] = {"CLUSTER", "SHARDS"};
        size_t argvlen[2] = {7, 6};
        int shards = 1;
        /* Each node within its share: a frozen one (SIGSTOP) costs a fraction of the call. */
        double asked = ask_deadline(deadline, n - k);
        st = rl_pool_command(&node->pool, 2, argv, argvlen, asked, &reply, err);
        if (st == RL_ERR_SERVER) { /* before Redis 7: no CLUSTER SHARDS */
            argv[1] = "SLOTS";
            argvlen[1] = 5;
            shards = 0;
            st = rl_pool_command(&node->pool, 2, argv, argvlen, asked, &reply, err);
        }
        if (st == RL_ERR_AUTH || st == RL_ERR_CLOSED || st == RL_ERR_NOMEM)
            break;
        if (st != RL_OK)
            continue;
        for (int s = 0; s < RL_CLUSTER_SLOTS; s++)
            map[s] = -1;
        pthread_mutex_lock(&c->mutex);
        st = shards ? parse_shards(c, reply, map, &node->pool.config, err)
                    : parse_slots(c, reply, map, &node->pool.config, err);
        if (st == RL_OK)
            memcpy(c->slots, map, sizeof(short) * RL_CLUSTER_SLOTS);
        c->refreshes++;
        pthread_mutex_unlock(&c->mutex);
        freeReplyObject(reply);
        if (st == RL_OK)
            break;
    }
    free(map);
    return st;
}

/* The node that serves slot, reading the map first when the slot is unknown. */
static rl_status
route(rl_cluster *c, int slot, double deadline, rl_node **out, rl_error *err)
{
    if (c->master_name != NULL) {
        rl_status st = follow_sentinels(c, deadline, err);
        if (st != RL_OK)
            return st;
    } else {
        /* A call timed out lately: its node may be frozen (SIGSTOP, a stalled VM) and its
           replica promoted any moment: the map is read again every RL_STALE_REREAD (one
           thread reads, the others go on), so the calls leave that node at once. */
        double now = rl_monotonic();
        pthread_mutex_lock(&c->mutex);
        int due = now < c->stale_until && !c->reading && now - c->map_read_at >= RL_STALE_REREAD;
        if (due) {
            c->reading = 1;
            c->map_read_at = now;
        }
        pthread_mutex_unlock(&c->mutex);
        if (due) {
            rl_error ignored;
            (void)refresh(c, deadline, &ignored);
            pthread_mutex_lock(&c->mutex);
            c->reading = 0;
            pthread_mutex_unlock(&c->mutex);
        }
    }
    for (int attempt = 0;; attempt++) {
        pthread_mutex_lock(&c->mutex);
        int closed = c->closed, index = c->master_name != NULL ? c->master : c->slots[slot];
        *out = index >= 0 ? c->nodes[index] : NULL;
        pthread_mutex_unlock(&c->mutex);
        if (closed)
            return rl_error_set(err, RL_ERR_CLOSED, "the rate limiter is closed");
        if (*out != NULL)
            return RL_OK;
        if (attempt == 1 && c->master_name != NULL)
            return rl_error_set(err, RL_ERR_CONNECT, "the sentinels named no master");
        if (attempt == 1)
            return rl_error_set(err, RL_ERR_CONNECT,
                                "no Redis Cluster node serves hash slot %d (are all slots "
                                "assigned?)",
                                slot);
        rl_status st = refresh(c, deadline, err);
        if (st != RL_OK)
            return st;
    }
}

/* "MOVED 3999 127.0.0.1:6381" / "ASK ...": the slot and the node's index (added when
   new). 0, or -1 when the text is not that. */
static int
parse_redirect(rl_cluster *c, const char *text, int *slot, int *index)
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
    pthread_mutex_lock(&c->mutex);
    *index = node_index(c, host, host_len, (int)port);
    pthread_mutex_unlock(&c->mutex);
    *slot = (int)s;
    return *index < 0 ? -1 : 0;
}

/* ----------------------------------------------------------------- calls */

void
rl_routed_call_init(rl_routed_call *rc, rl_cluster *cluster, rl_pool *pool, rl_prepared *d)
{
    memset(rc, 0, sizeof(*rc));
    rc->cluster = cluster;
    rc->decision = d;
    if (cluster == NULL)
        rl_call_init(&rc->call, pool, d);
    /* One deadline for every node this call may try (a cluster's pool is chosen per try). */
    rc->deadline =
        cluster == NULL ? rc->call.deadline : rl_monotonic() + cluster->base.socket_timeout;
    rc->under_way = cluster == NULL;
}

rl_status
rl_routed_call_run(rl_routed_call *rc, rl_error *err)
{
    rl_cluster *c = rc->cluster;
    if (c == NULL) {
        rl_status st = rl_call_run(&rc->call, err);
        rc->result = rc->call.result;
        return st;
    }
    for (;;) {
        rl_status st;
        if (!rc->under_way) {
            rl_node *node = NULL;
            if (rc->ask_index >= 0 && rc->asking) {
                pthread_mutex_lock(&c->mutex);
                node = c->nodes[rc->ask_index];
                pthread_mutex_unlock(&c->mutex);
            } else if ((st = route(c, rc->decision->slot, rc->deadline, &node, err)) != RL_OK) {
                return st;
            }
            rl_call_init(&rc->call, &node->pool, rc->decision);
            rc->call.deadline = rc->deadline;
            rc->call.asking = rc->asking;
            rc->asking = 0;
            rc->under_way = 1;
        }
        st = rl_call_run(&rc->call, err);
        if (st == RL_ERR_INTERRUPTED)
            return st; /* resumed by the next rl_routed_call_run */
        rc->under_way = 0;
        rc->deadline = rc->call.deadline; /* plus the time spent connecting */
        if (st == RL_OK) {
            rc->result = rc->call.result;
            return RL_OK;
        }
        int slot, index;
        switch (st) {
        case RL_ERR_REDIRECT:
            if (strncmp(err->message, "MOVED ", 6) == 0 &&
                parse_redirect(c, err->message, &slot, &index) == 0) {
                /* MOVED is the only answer retried without a pause: bound it (nodes that
                   send a call back and forth), the others by the deadline. */
                if (++rc->attempts >= RL_CLUSTER_MAX_ATTEMPTS)
                    return rl_error_set(err, RL_ERR_IO,
                                        "the Redis Cluster answered MOVED %d times to one call",
                                        RL_CLUSTER_MAX_ATTEMPTS);
                /* The map again (others may have moved too), then the slot pointed where
                   MOVED said: the answer of the node that served it a moment ago, newer than
                   what a node whose gossip lags (a replica, say) may still answer. */
                (void)refresh(c, rc->deadline, &rc->refresh_error);
                pthread_mutex_lock(&c->mutex);
                c->slots[slot] = (short)index;
                pthread_mutex_unlock(&c->mutex);
                continue;
            }
            if (strncmp(err->message, "ASK ", 4) == 0 &&
                parse_redirect(c, err->message, &slot, &index) == 0) {
                rc->asking = 1;
                rc->ask_index = index;
                continue;
            }
            break; /* TRYAGAIN, CLUSTERDOWN: pause, then ask for the map again */
        case RL_ERR_CONNECT:
        case RL_ERR_IO:
            break; /* a dead node: its replica takes over within the failover time */
        case RL_ERR_SERVER:
            /* Sentinel: a demoted master refuses the script's first write (its trim), so
               nothing ran: ask the sentinels for the new one. */
            if (c->master_name != NULL && strstr(err->message, "READONLY") != NULL)
                break;
            return st;
        case RL_ERR_TIMEOUT:
            /* Not retried (the decision may have run), but the node may be frozen and
               its replica promoted meanwhile: the next call reads the map first. */
            pthread_mutex_lock(&c->mutex);
            c->stale_until = rl_monotonic() + 2 * c->base.socket_timeout;
            c->asked_at = 0; /* sentinel: ask them at the next call */
            pthread_mutex_unlock(&c->mutex);
            return st;
        default:
            return st; /* an error reply, garbage: as on a single node */
        }
        if (pause_before_retry(rc->deadline) < 0) {
            if (st == RL_ERR_REDIRECT) {
                /* Not the single-node hint (module.c): this is a cluster that stayed busy. */
                char said[200];
                snprintf(said, sizeof(said), "%.199s", err->message);
                return rl_error_set(err, RL_ERR_IO,
                                    "the Redis Cluster answered %.200s until the call's deadline "
                                    "(socket_timeout)",
                                    said);
            }
            return st;
        }
        (void)refresh(c, rc->deadline, &rc->refresh_error);
    }
}

void
rl_routed_call_abandon(rl_routed_call *rc)
{
    if (rc->under_way)
        rl_call_abandon(&rc->call);
    rc->under_way = 0;
}
