/*
 * cluster.c - Redis Cluster and Sentinel for the blocking limiter: the driver of the router
 * (router.c) over blocking sockets, with a pool of connections per node.
 *
 * Every key of one decision carries the user id in a hash tag (script.c, rl_key_user), so
 * one decision is one script on one node, never CROSSSLOT. What a call does after each
 * answer (MOVED, ASK, TRYAGAIN, CLUSTERDOWN, a dead node, a timeout, a demoted master's
 * READONLY), when the map is read again and which master the sentinels agree on are the
 * router's rules; this file only sends where rl_route_next says, asks what rl_read_step
 * says, sleeps the pauses and hands every answer back. A decision whose connection broke
 * mid-call is resent in its replay form (proto.c's rule, kept across nodes): the script
 * answers "already counted" for an entry its first attempt wrote, so a retry never counts a
 * request twice. The NOSCRIPT reload is per connection (proto.c), so a promoted replica
 * loads the script by itself. After a Sentinel switch, the idle connections to the old
 * master are closed at once.
 *
 * Why not hiredis-cluster / libvalkey: neither is packaged in Debian 12, the wheel and
 * the hiredis 1.x build would each need it built and bundled, and both own the socket
 * and reply parsing that proto.c already does for both limiters (NOSCRIPT, replay marker,
 * bounded reader).
 *
 * GIL contract: rl_cluster_init/add_seed/after_fork run with the GIL held, everything
 * else without it, like conn.c. Lock order: the GIL is released first; the cluster's
 * mutex (the pools table) and the router's are never held while a pool's mutex is taken
 * or across I/O.
 */
#include "native.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

/* A pool for address: the data nodes' credentials (sentinel: none), the same timeouts and
   TLS. NULL when out of memory. */
static rl_node *
node_new(const rl_cluster *c, const rl_address *address, int sentinel)
{
    const rl_config *base = &c->base;
    rl_node *node = calloc(1, sizeof(*node));
    if (node == NULL)
        return NULL;
    int rc = sentinel ? rl_config_init(&node->pool.config, address->host, address->port, NULL, 0,
                                       NULL, NULL, base->connect_timeout, base->socket_timeout)
                      : rl_config_init(&node->pool.config, address->host, address->port, NULL,
                                       base->db, base->username, base->password,
                                       base->connect_timeout, base->socket_timeout);
    if (rc < 0) {
        free(node);
        return NULL;
    }
    share_tls(&node->pool.config, base);
    if (!sentinel) {
        node->pool.config.min_replicas = base->min_replicas;
        node->pool.config.replica_timeout_ms = base->replica_timeout_ms;
    }
    if (rl_pool_init(&node->pool, sentinel ? 2 : c->max_open) <
        0) { /* sentinel: a question now and then */
        rl_config_clear(&node->pool.config);
        free(node);
        return NULL;
    }
    node->pool.metrics = sentinel ? NULL : c->metrics;
    return node;
}

/* The pool of the router's node (or sentinel) index, made when first needed. NULL with err
   filled (closed, out of memory). */
static rl_node *
node_at(rl_cluster *c, int sentinel, int index, rl_error *err)
{
    rl_address address;
    rl_node **table = sentinel ? c->sentinels : c->nodes;
    pthread_mutex_lock(&c->mutex);
    rl_node *node = index >= 0 && index < RL_CLUSTER_MAX_NODES ? table[index] : NULL;
    int closed = c->closed;
    pthread_mutex_unlock(&c->mutex);
    if (closed) {
        rl_error_set(err, RL_ERR_CLOSED, "the rate limiter is closed");
        return NULL;
    }
    if (node != NULL)
        return node;
    if (rl_router_address(&c->router, sentinel, index, &address) < 0) {
        rl_error_set(err, RL_ERR_PROTOCOL, "the router named an unknown node");
        return NULL;
    }
    rl_node *made = node_new(c, &address, sentinel);
    if (made == NULL) {
        rl_error_set(err, RL_ERR_NOMEM, "out of memory opening a pool for %.200s:%d", address.host,
                     address.port);
        return NULL;
    }
    pthread_mutex_lock(&c->mutex);
    if (table[index] == NULL) { /* another thread may have made it meanwhile */
        made->pool.closed = c->closed;
        table[index] = made;
        made = NULL;
    }
    node = table[index];
    pthread_mutex_unlock(&c->mutex);
    if (made != NULL) {
        rl_pool_destroy(&made->pool);
        rl_config_clear(&made->pool.config);
        free(made);
    }
    return node;
}

int
rl_cluster_init(rl_cluster *c, int max_open, const char *master_name)
{
    if (rl_router_init(&c->router, master_name, c->base.tls, c->base.socket_timeout) < 0)
        return -1;
    int rc = pthread_mutex_init(&c->mutex, NULL);
    if (rc != 0) {
        rl_router_destroy(&c->router);
        errno = rc;
        return -1;
    }
    c->max_open = max_open;
    c->initialized = 1;
    return 0;
}

int
rl_cluster_add_seed(rl_cluster *c, const char *host, int port)
{
    if (rl_router_add_seed(&c->router, host, port) < 0)
        return -1;
    if (c->router.master_name == NULL)
        return 0; /* a node's pool is made when a call first goes there */
    rl_address address = c->router.sentinels[c->router.sentinel_count - 1]; /* set-up: GIL */
    rl_node *sentinel = node_new(c, &address, 1);
    if (sentinel == NULL)
        return -1;
    c->sentinels[c->sentinel_count++] = sentinel;
    return 0;
}

/* A copy of the pools made so far (never removed: the pointers stay valid). */
static int
nodes_snapshot(rl_cluster *c, rl_node **out)
{
    int n = 0;
    pthread_mutex_lock(&c->mutex);
    for (int i = 0; i < RL_CLUSTER_MAX_NODES; i++) {
        if (c->nodes[i] != NULL)
            out[n++] = c->nodes[i];
    }
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

static void
node_free(rl_node *node)
{
    rl_pool_destroy(&node->pool);
    rl_config_clear(&node->pool.config);
    free(node);
}

void
rl_cluster_destroy(rl_cluster *c)
{
    for (int i = 0; i < c->sentinel_count; i++)
        node_free(c->sentinels[i]);
    c->sentinel_count = 0;
    if (c->initialized) {
        for (int i = 0; i < RL_CLUSTER_MAX_NODES; i++) {
            if (c->nodes[i] != NULL)
                node_free(c->nodes[i]);
            c->nodes[i] = NULL;
        }
        pthread_mutex_destroy(&c->mutex);
        rl_router_destroy(&c->router);
        c->initialized = 0;
    }
    rl_config_clear(&c->base);
}

void
rl_cluster_after_fork(rl_cluster *c)
{
    (void)pthread_mutex_init(&c->mutex, NULL);
    rl_router_after_fork(&c->router);
    for (int i = 0; i < RL_CLUSTER_MAX_NODES; i++) {
        if (c->nodes[i] != NULL)
            rl_pool_after_fork(&c->nodes[i]->pool);
    }
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

/* ----------------------------------------------------------------- reads */

/* One read of the map or of the sentinels, as the router asks it. Its errors are the
   router's to keep (rt); a call's own error says more. */
static void
read_map(rl_cluster *c, double deadline, rl_route *rt)
{
    rl_read rd;
    rl_status st = RL_OK;
    rl_error err = {RL_OK, ""};
    redisReply *reply = NULL;
    rl_read_begin(&c->router, &rd, deadline);
    while (rl_read_step(&c->router, &rd, st, reply, &err)) {
        if (reply != NULL)
            freeReplyObject(reply);
        reply = NULL;
        rl_node *node = node_at(c, rd.q.sentinel, rd.q.target, &err);
        st = node == NULL ? err.kind
                          : rl_pool_command(&node->pool, rd.q.argc, rd.q.argv, rd.q.argvlen,
                                            rd.q.deadline, &reply, &err);
    }
    if (reply != NULL)
        freeReplyObject(reply);
    int replaced = rd.replaced;
    rl_read_end(&c->router, &rd, rt);
    if (replaced >= 0) { /* no new call goes to the old master: close its idle connections */
        pthread_mutex_lock(&c->mutex);
        rl_node *old = c->nodes[replaced];
        pthread_mutex_unlock(&c->mutex);
        if (old != NULL)
            rl_pool_drop_idle(&old->pool);
    }
}

/* Sleeps seconds (a failover or a migration needs time), through signals. */
static void
pause_for(double seconds)
{
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
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
    if (cluster != NULL)
        rl_route_begin(&rc->route, d->slot, rc->deadline);
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
            rl_node *node;
            switch (rl_route_next(&c->router, &rc->route, err)) {
            case RL_ROUTE_FAIL:
                return rc->route.status;
            case RL_ROUTE_WAIT:
                pause_for(rc->route.seconds);
                continue;
            case RL_ROUTE_READ:
                read_map(c, rc->route.read_deadline, &rc->route);
                continue;
            case RL_ROUTE_SEND:
            default:
                if ((node = node_at(c, 0, rc->route.node, err)) == NULL)
                    return err->kind;
                break;
            }
            rl_call_init(&rc->call, &node->pool, rc->decision);
            rc->call.deadline = rc->deadline;
            rc->call.asking = rc->route.asking;
            rc->under_way = 1;
        }
        st = rl_call_run(&rc->call, err);
        if (st == RL_ERR_INTERRUPTED)
            return st; /* resumed by the next rl_routed_call_run */
        rc->under_way = 0;
        /* Plus the time spent connecting, as on a single node. */
        rc->deadline = rc->route.deadline = rc->call.deadline;
        if (st == RL_OK) {
            rc->result = rc->call.result;
            return RL_OK;
        }
        if (!rl_route_failed(&c->router, &rc->route, st, err))
            return rc->route.status;
    }
}

void
rl_routed_call_abandon(rl_routed_call *rc)
{
    if (rc->under_way)
        rl_call_abandon(&rc->call);
    rc->under_way = 0;
}
