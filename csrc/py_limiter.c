/*
 * py_limiter.c - the Limiter type: the blocking rate limiter that genai_ratelimit.RateLimiter
 * subclasses. One call = one decision: validate and format with the GIL held, then release
 * the GIL for the pool and the socket, then build the result tuple with the GIL again.
 *
 * GIL/lock contract: the pool's mutex is only ever taken with the GIL released
 * (Py_BEGIN_ALLOW_THREADS around every rl_pool_* call that locks). Every method that
 * touches the pool first runs the fork check (own_pool) with the GIL held, so only one
 * thread of a fork child resets the pool, before anything can lock a mutex copied from
 * the parent in a locked state.
 *
 * Signals (PEP 475): when a signal interrupts the socket I/O, the call takes the GIL
 * back, runs the Python signal handlers, and resumes within the same deadline; if a
 * handler raises, the call raises that and its connection is discarded.
 *
 * The type holds no Python references (all its configuration is copied into C memory), so
 * it needs no GC support of its own; Python subclasses get theirs from CPython.
 */
#include "native.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    PyObject_HEAD
    rl_pool pool;        /* connections, shared by every thread (a single node) */
    rl_cluster *cluster; /* a Redis Cluster instead (owned), or NULL */
    char *key_prefix;    /* UTF-8, owned */
    size_t key_prefix_len;
    int client_clock;              /* 1: the caller's clock; 0: the server's TIME */
    rl_storage storage;            /* where the windows are kept (sorted sets or strings) */
    int configured;                /* __init__ ran to completion */
    unsigned long fork_generation; /* rl_fork_generation() at the last call; 0 before */
    rl_random *random;             /* the module's page of randomness (its fork generation) */
    int metrics_on;                /* count into metrics (constructor's metrics=True) */
    rl_metrics metrics;            /* this limiter's counters (py_metrics.c) */
} LimiterObject;

static rl_module_state *
state_of(PyTypeObject *defining_class)
{
    return (rl_module_state *)PyType_GetModuleState(defining_class);
}

static void Limiter_dealloc(LimiterObject *self);

static void
free_cluster(LimiterObject *self)
{
    if (self->cluster != NULL) {
        rl_cluster_destroy(self->cluster);
        free(self->cluster);
        self->cluster = NULL;
    }
}

/* The module state of the Limiter type under a Python subclass (RateLimiter): the first
   type of the MRO that is ours. Borrowed; the module outlives the types it made. */
static rl_module_state *
state_of_type(PyTypeObject *type)
{
    rl_module_state *state = NULL;
    PyObject *mro = PyObject_GetAttrString((PyObject *)type, "__mro__");
    if (mro == NULL)
        return NULL;
    for (Py_ssize_t i = 0; PyTuple_Check(mro) && i < PyTuple_Size(mro); i++) {
        PyTypeObject *base = (PyTypeObject *)PyTuple_GetItem(mro, i);
        if (PyType_GetSlot(base, Py_tp_dealloc) == (void *)Limiter_dealloc) {
            state = (rl_module_state *)PyType_GetModuleState(base);
            break;
        }
    }
    Py_DECREF(mro);
    if (state == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "not a Limiter type");
    return state;
}

static PyObject *
Limiter_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kwargs))
{
    rl_module_state *state = state_of_type(type);
    if (state == NULL)
        return NULL;
    allocfunc tp_alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    LimiterObject *self = (LimiterObject *)tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->random = state->random;
    /* tp_alloc zeroed everything: pool.initialized == 0, configured == 0. */
    return (PyObject *)self;
}

/* Cluster mode: the pool's config (credentials, db, timeouts, TLS) becomes every node's,
   and nodes, a sequence of (host, port), the seeds; with sentinel_master, nodes are the
   sentinels that name that master. 0, or -1 with an exception. */
static int
configure_cluster(LimiterObject *self, PyObject *nodes, int max_connections,
                  const char *sentinel_master)
{
    PyObject *seq = PySequence_Fast(nodes, "cluster_nodes must be a sequence of (host, port)");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = rl_seq_size(seq);
    if (n < 1 || n > RL_CLUSTER_MAX_NODES) {
        PyErr_Format(PyExc_ValueError, "cluster_nodes needs 1 to %d nodes", RL_CLUSTER_MAX_NODES);
        goto error;
    }
    rl_cluster *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    c->base = self->pool.config; /* moved: the single-node pool is not used */
    memset(&self->pool.config, 0, sizeof(self->pool.config));
    self->cluster = c;
    c->metrics = self->pool.metrics; /* every node's pool counts into the limiter's */
    if (rl_cluster_init(c, max_connections, sentinel_master) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto error;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *host;
        int port;
        if (!PyArg_ParseTuple(rl_seq_item(seq, i), "si;cluster_nodes holds (host, port) pairs",
                              &host, &port))
            goto error;
        if (port < 1 || port > 65535) {
            PyErr_Format(PyExc_ValueError, "port must be between 1 and 65535, got %d", port);
            goto error;
        }
        if (rl_cluster_add_seed(c, host, port) < 0) {
            PyErr_NoMemory();
            goto error;
        }
    }
    Py_DECREF(seq);
    return 0;
error:
    Py_DECREF(seq);
    return -1;
}

static int
Limiter_init(LimiterObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"host",
                               "port",
                               "unix_path",
                               "db",
                               "username",
                               "password",
                               "connect_timeout",
                               "socket_timeout",
                               "key_prefix",
                               "client_clock",
                               "max_connections",
                               "tls",
                               "ssl_verify",
                               "ssl_ca_certs",
                               "ssl_certfile",
                               "ssl_keyfile",
                               "metrics",
                               "cluster_nodes",
                               "sentinel_master",
                               "storage",
                               "min_replicas",
                               "replica_timeout_ms",
                               NULL};
    const char *host = NULL, *unix_path = NULL, *username = NULL, *password = NULL;
    const char *prefix = "ratelimit", *ca = NULL, *certfile = NULL, *keyfile = NULL;
    Py_ssize_t prefix_len = 9;
    int port = 6379, client_clock = 0, max_connections = 32, tls = 0, ssl_verify = 1, metrics = 1;
    long long db = 0;
    double connect_timeout = 1.0, socket_timeout = 1.0;
    PyObject *cluster_nodes = NULL;
    const char *sentinel_master = NULL, *storage = NULL;
    int min_replicas = 0;
    long long replica_timeout_ms = 100;

    if (self->configured) {
        PyErr_SetString(PyExc_RuntimeError, "a limiter is configured once, by its constructor");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, "|$zizLzzdds#pippzzzpOzziL", keywords, &host, &port, &unix_path, &db,
            &username, &password, &connect_timeout, &socket_timeout, &prefix, &prefix_len,
            &client_clock, &max_connections, &tls, &ssl_verify, &ca, &certfile, &keyfile, &metrics,
            &cluster_nodes, &sentinel_master, &storage, &min_replicas, &replica_timeout_ms))
        return -1;
    if (rl_parse_storage(storage, &self->storage) < 0)
        return -1;
    if (host == NULL && unix_path == NULL) {
        PyErr_SetString(PyExc_ValueError, "a host or a unix socket path is needed");
        return -1;
    }
    if (port < 1 || port > 65535) {
        PyErr_Format(PyExc_ValueError, "port must be between 1 and 65535, got %d", port);
        return -1;
    }
    if (db < 0) {
        PyErr_Format(PyExc_ValueError, "db must be >= 0, got %lld", db);
        return -1;
    }
    if (rl_check_limiter_values(connect_timeout, socket_timeout, prefix_len, max_connections,
                                min_replicas, replica_timeout_ms) < 0)
        return -1;
    if (tls && host == NULL) {
        PyErr_SetString(PyExc_ValueError, "TLS needs a TCP host (rediss://), not a unix socket");
        return -1;
    }

    free(self->key_prefix); /* a retried __init__ after a failed one */
    rl_config_clear(&self->pool.config);
    free_cluster(self);
    self->key_prefix = malloc((size_t)prefix_len + 1);
    if (self->key_prefix == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(self->key_prefix, prefix, (size_t)prefix_len + 1);
    self->key_prefix_len = (size_t)prefix_len;
    self->client_clock = client_clock;
    if (rl_config_init(&self->pool.config, host, port, unix_path, db, username, password,
                       connect_timeout, socket_timeout) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    self->pool.config.min_replicas = min_replicas;
    self->pool.config.replica_timeout_ms = replica_timeout_ms;
    if (tls) {
        rl_error err = {RL_OK, ""};
        if (rl_config_tls(&self->pool.config, ssl_verify, ca, certfile, keyfile, &err) != RL_OK) {
            /* A missing or unreadable certificate file is a configuration error. */
            if (err.kind == RL_ERR_NOMEM)
                PyErr_NoMemory();
            else
                PyErr_SetString(PyExc_ValueError, err.message);
            return -1;
        }
    }
    self->metrics_on = metrics;
    self->pool.metrics = metrics ? &self->metrics : NULL;
    if (cluster_nodes != NULL && cluster_nodes != Py_None) {
        if (configure_cluster(self, cluster_nodes, max_connections, sentinel_master) < 0)
            return -1;
    } else if (rl_pool_init(&self->pool, max_connections) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->configured = 1;
    return 0;
}

static void
Limiter_dealloc(LimiterObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    rl_pool_destroy(&self->pool);
    rl_config_clear(&self->pool.config);
    free_cluster(self);
    free(self->key_prefix);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(self);
    Py_DECREF(tp);
}

/* The fork check, GIL held: in a fork child (seen through the page the kernel wipes, so a
   fork() made from C, which runs none of Python's at-fork hooks, is seen as well) the
   parent's pool is dropped and made anew before anything touches it. */
static void
own_pool(LimiterObject *self)
{
    unsigned long generation = rl_fork_generation(self->random);
    if (self->fork_generation != generation) {
        if (self->fork_generation != 0 && self->cluster != NULL)
            rl_cluster_after_fork(self->cluster);
        else if (self->fork_generation != 0)
            rl_pool_after_fork(&self->pool);
        self->fork_generation = generation;
    }
}

/* Runs one prepared decision. Returns a new reference to the result tuple, or NULL. */
static PyObject *
decide(LimiterObject *self, rl_module_state *state, PyObject *user_id, rl_prepared *p)
{
    rl_error err = {RL_OK, ""};
    rl_status st;
    PyObject *result = NULL;

    if (!self->configured) {
        PyErr_SetString(PyExc_RuntimeError, "the limiter was not initialised (call __init__)");
        return NULL;
    }
    if (rl_prepare(state, self->key_prefix, self->key_prefix_len, self->client_clock, user_id, p) <
        0)
        goto done;
    if (p->disabled) {
        result = rl_result_object(state, p, &p->result);
        goto done;
    }
    own_pool(self);
    rl_routed_call call;
    char warning[RL_WARNING_LEN];
    int warn = 0;
    rl_routed_call_init(&call, self->cluster, &self->pool, p);
    Py_BEGIN_ALLOW_THREADS
    st = rl_routed_call_run(&call, &err);
    Py_END_ALLOW_THREADS
    while (st == RL_ERR_INTERRUPTED) {
        if (PyErr_CheckSignals() < 0) {
            /* A handler raised (KeyboardInterrupt, say): that is the call's outcome. */
            Py_BEGIN_ALLOW_THREADS
            rl_routed_call_abandon(&call);
            Py_END_ALLOW_THREADS
            goto done;
        }
        Py_BEGIN_ALLOW_THREADS
        st = rl_routed_call_run(&call, &err);
        Py_END_ALLOW_THREADS
    }
    if (self->cluster != NULL) {
        Py_BEGIN_ALLOW_THREADS
        warn = rl_cluster_take_warning(self->cluster, warning);
        Py_END_ALLOW_THREADS
    } else if (__atomic_load_n(&self->pool.warning_state, __ATOMIC_RELAXED) == 1) {
        Py_BEGIN_ALLOW_THREADS /* once at most */
        warn = rl_pool_take_warning(&self->pool, warning);
        Py_END_ALLOW_THREADS
    }
    if (warn && rl_log_warning(warning) < 0)
        goto done;
    if (st != RL_OK) {
        if (self->metrics_on && rl_script_decides(p->script))
            rl_metrics_count(&self->metrics.unavailable);
        rl_raise(state, &err);
        goto done;
    }
    p->result = call.result;
    result = rl_result_object(state, p, &p->result);
done:
    rl_prepared_clear(p);
    return result;
}

/* Parses one method's arguments and runs the decision. */
static PyObject *
run(LimiterObject *self, PyTypeObject *defining_class, rl_shape shape, PyObject *const *args,
    Py_ssize_t nargs, PyObject *kwnames)
{
    rl_prepared p;
    PyObject *user_id;
    if (rl_parse_request(shape, args, nargs, kwnames, &p, &user_id) < 0)
        return NULL;
    p.hash_tag = self->cluster != NULL && self->cluster->router.master_name == NULL;
    p.storage = self->storage;
    return decide(self, state_of(defining_class), user_id, &p);
}

/* Limiter_<name>: the METH_METHOD | METH_FASTCALL | METH_KEYWORDS method of one shape. */
#define LIMITER_METHOD(name, shape)                                                                \
    static PyObject *Limiter_##name(LimiterObject *self, PyTypeObject *defining_class,             \
                                    PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)    \
    {                                                                                              \
        return run(self, defining_class, shape, args, nargs, kwnames);                             \
    }

PyDoc_STRVAR(Limiter_check_doc,
"check($self, /, user_id, limit, window_seconds, *, cost=1)\n--\n\n"
"-> (allowed, remaining, retry_after_s)\n\n"
"Decides one request of user_id against `limit` per `window_seconds`, in one script\n"
"execution on Redis. The request costs `cost` units of the limit (1: one request). On\n"
"allow the request is logged; a rejection writes nothing.");

LIMITER_METHOD(check, RL_SHAPE_CHECK)

PyDoc_STRVAR(Limiter_check_windows_doc,
"check_windows($self, /, user_id, windows, *, cost=1)\n--\n\n"
"-> (allowed, remaining, retry_after_s, window_seconds)\n\n"
"Decides one request against every (limit, window_seconds) pair in one script execution,\n"
"shortest window first. The first window that rejects stops the script: no later window\n"
"is read or written and nothing is logged. On allow the request is logged in every\n"
"window, and window_seconds names the window with the fewest remaining (ties: the\n"
"shorter); on reject it names the window that rejected.");

LIMITER_METHOD(check_windows, RL_SHAPE_WINDOWS)

PyDoc_STRVAR(Limiter_check_windows_detailed_doc,
"check_windows_detailed($self, /, user_id, windows, *, cost=1, gcra=None)\n--\n\n"
"-> WindowDecision\n\n"
"check_windows, answered as a WindowDecision: the same 4-tuple, with the exact wait\n"
"(retry_after_ms) and the decision's time (timestamp_ms) as attributes. gcra=(rate,\n"
"period_seconds, burst): a GCRA bucket (check_rate's key) decided first, with the windows,\n"
"all or nothing (lua/gcra_windows.lua); windows may then be empty.");

LIMITER_METHOD(check_windows_detailed, RL_SHAPE_DETAILED)

PyDoc_STRVAR(Limiter_reserve_doc,
"_reserve($self, /, user_id, windows, *, cost=1, token_windows=(), tokens=None,\n"
"    scopes=(), in_flight=None, shares=None, ticket=None,\n"
"    probe=None)\n--\n\n"
"-> (allowed, remaining, retry_after_s, window_seconds, is_token_window, member,\n"
"    timestamp_ms, ((limit, window_seconds, is_token_window, remaining|None, scope), ...),\n"
"    retry_after_ms, scope, tie, slot)\n\n"
"One decision over request windows (charged `cost`) and token windows (charged `tokens`),\n"
"the user's own and those of `scopes` ((name, shared, windows, token_windows) tuples; a\n"
"window's scope is 0 for the user's own, k for scopes[k - 1]), all or nothing. tie names\n"
"the entry in the compact storage. in_flight=(limit, lease_seconds) takes an in-flight\n"
"slot in the same script: slot is _acquire's tuple, or None (a window refused; no slot).\n"
"ticket: a wait queue's ticket (a UUID4, _wait_queue's), the entry's member: the shared\n"
"scopes' queues admit it at its turn (lua/lib/queue.lua).\n"
"RateLimiter.reserve wraps it in a Reservation.");

LIMITER_METHOD(reserve, RL_SHAPE_RESERVE)

PyDoc_STRVAR(Limiter_reconcile_doc,
"_reconcile($self, /, user_id, windows, member, timestamp_ms, cost, *, tokens=False,\n"
"    scopes=(), tie=0, release=False, shares=None)\n--\n\n"
"-> the number of windows whose entry was found\n\n"
"Sets the cost of a reserved entry in every window where it is still present, the\n"
"user's own and those of `scopes` ((name, shared, windows) tuples); release=True also\n"
"gives back the in-flight lease whose id is the member, in the same script.\n"
"RateLimiter.reconcile calls it with a Reservation's fields.");

LIMITER_METHOD(reconcile, RL_SHAPE_RECONCILE)

PyDoc_STRVAR(Limiter_peek_doc,
"_peek($self, /, user_id, windows, *, cost=1, token_windows=(), tokens=None,\n"
"    scopes=())\n--\n\n"
"-> (allowed, remaining, retry_after_s, window_seconds, is_token_window, now_ms,\n"
"    ((limit, window_seconds, is_token_window, used, oldest_ms|None), ...), retry_after_ms)\n\n"
"What _reserve (and so check_windows) would answer now, in one read-only script\n"
"execution that writes nothing. RateLimiter.peek returns its first four fields.");

LIMITER_METHOD(peek, RL_SHAPE_PEEK)

PyDoc_STRVAR(Limiter_check_rate_doc,
"_check_rate($self, /, user_id, rate, period_seconds, burst, *, cost=1)\n--\n\n"
"-> (allowed, remaining, retry_after_s, retry_after_ms, now_ms)\n\n"
"One GCRA decision (lua/gcra.lua): `rate` requests per `period_seconds`, up to `burst` at\n"
"once, for a request of weight `cost`, in one script execution. On allow the key's\n"
"theoretical arrival time moves on; a refusal writes nothing. RateLimiter.check_rate\n"
"returns its first three fields.");

LIMITER_METHOD(check_rate, RL_SHAPE_GCRA)

PyDoc_STRVAR(Limiter_hold_budgets_doc,
"_hold_budgets($self, /, user_id, budgets, hold_ms)\n--\n\n"
"-> (allowed, refused, kind, now_ms, hold_id, ((remaining, start_ms, end_ms, fired_before,\n"
"fired_after), ...))\n\n"
"Holds amounts in calendar budgets, all or nothing, in one script execution\n"
"(lua/budget_hold.lua). budgets: (owner, name, limit, amount, previous_start, start, end,\n"
"next_end, thresholds) tuples (genai_ratelimit/periods.py); user_id: the owner whose slot\n"
"the script runs in. kind -1: the periods sent do not hold the script's now_ms (ask again).");

LIMITER_METHOD(hold_budgets, RL_SHAPE_BUDGET_HOLD)

PyDoc_STRVAR(Limiter_settle_budgets_doc,
"_settle_budgets($self, /, user_id, budgets, hold_id)\n--\n\n"
"-> (found, ((fired_before, fired_after), ...))\n\n"
"Settles a hold (lua/budget_settle.lua): budgets are (owner, name, period_start, actual,\n"
"limit, thresholds) tuples naming the periods that admitted it; found: the number of\n"
"budgets whose hold was found. Settling twice changes nothing.");

LIMITER_METHOD(settle_budgets, RL_SHAPE_BUDGET_SETTLE)

PyDoc_STRVAR(Limiter_observe_upstream_doc,
"_observe_upstream($self, /, name, observation)\n--\n\n"
"-> the upstream's closed-until time (unix ms, 0 when open)\n\n"
"Records a provider response's word on the shared scope `name`: observation is (requests\n"
"left, ms to their reset, their limit, the same for tokens, ms closed for, the bound in ms),\n"
"-1 where it said nothing (lua/observe_upstream.lua). RateLimiter.observe_upstream reads\n"
"the headers.");

LIMITER_METHOD(observe_upstream, RL_SHAPE_OBSERVE)

PyDoc_STRVAR(Limiter_wait_queue_doc,
"_wait_queue($self, /, name, ticket, tenant, numbers, leases=False)\n--\n\n"
"-> take: the ticket's rank (0: first), -1 the queue is full, -2 the tenant's share is;\n"
"leave: 1 when the ticket was removed, else 0\n\n"
"A ticket of the wait queue of the shared scope `name` (lua/wait_queue.lua): numbers is\n"
"(wait_ms, max_queue, max_tenant), wait_ms 0 to leave; tenant a hex digest. A take of a\n"
"ticket already held renews its deadline. leases=True: the queue of the in-flight cap\n"
"`name` (acquire's), \"{name}:leases:queue\".");

LIMITER_METHOD(wait_queue, RL_SHAPE_QUEUE)

PyDoc_STRVAR(Limiter_reset_doc,
"_reset($self, /, user_id, windows=None, *, token_windows=None, cursor=None)\n--\n\n"
"-> (entries_removed, next_cursor)\n\n"
"Deletes the user's keys of the windows given, or with windows=None one SCAN step of\n"
"all of them from cursor (next_cursor '0': done). RateLimiter.reset loops over it.");

LIMITER_METHOD(reset, RL_SHAPE_RESET)

PyDoc_STRVAR(Limiter_metrics_doc,
"metrics($self, /)\n--\n\n"
"The limiter's counters: decisions allowed, rejected (by window), unavailable; fail-open\n"
"and shadow outcomes; replays; connection errors; Redis round-trip latency buckets.");

static PyObject *
Limiter_get_metrics(LimiterObject *self, PyObject *Py_UNUSED(ignored))
{
    return rl_metrics_object(&self->metrics, self->metrics_on);
}

PyDoc_STRVAR(Limiter_record_outcome_doc,
"_record_outcome($self, kind, count=1, /)\n--\n\n"
"Counts what only the caller knows: 'fail_open' or 'shadow' (the FastAPI layer), a\n"
"reservation's 'reserved_tokens', a reconcile's 'charged_tokens' and 'refunded_tokens'.");

static PyObject *
Limiter_record_outcome(LimiterObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return rl_metrics_record(self->metrics_on ? &self->metrics : NULL, args, nargs);
}
PyDoc_STRVAR(Limiter_acquire_doc,
"_acquire($self, /, user_id, limit, lease_seconds, shares=None, ticket=None)\n--\n\n"
"-> (allowed, held, retry_after_s, retry_after_ms, lease_id, expires_at_ms, now_ms,\n"
"    retry_bound_ms, share_rule)\n\n"
"Takes one of `limit` concurrent slots of user_id for lease_seconds (lua/lease.lua);\n"
"shares: lua/lib/shares.lua's \"L ...\" spec, share_rule the rule that refused (0: none).\n"
"ticket: the caller's ticket in the cap's wait queue (_wait_queue(leases=True)), the\n"
"lease's id. RateLimiter.acquire wraps it in a Lease.");

LIMITER_METHOD(acquire, RL_SHAPE_ACQUIRE)

PyDoc_STRVAR(Limiter_release_doc,
"_release($self, /, user_id, lease_id)\n--\n\n"
"-> whether the lease was still held\n\n"
"Gives a lease's slot back (idempotent). RateLimiter.release calls it with a Lease.");

LIMITER_METHOD(release, RL_SHAPE_RELEASE)

PyDoc_STRVAR(Limiter_renew_doc,
"_renew($self, /, user_id, lease_id, lease_seconds)\n--\n\n"
"-> (renewed, expires_at_ms)\n\n"
"Extends a lease that is still held to lease_seconds from now; an expired or released\n"
"lease is not renewed. RateLimiter.renew calls it with a Lease.");

LIMITER_METHOD(renew, RL_SHAPE_RENEW)

PyDoc_STRVAR(Limiter_close_doc,
"close($self, /)\n--\n\nCloses every idle connection; connections in use close when their call ends.\n"
"Later checks raise RateLimiterError. Closing twice is harmless.");

static PyObject *
Limiter_close(LimiterObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->configured) {
        own_pool(self);
        Py_BEGIN_ALLOW_THREADS
        if (self->cluster != NULL)
            rl_cluster_close(self->cluster);
        else
            rl_pool_close(&self->pool);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *
Limiter_get_key_prefix(LimiterObject *self, void *Py_UNUSED(closure))
{
    if (self->key_prefix == NULL)
        Py_RETURN_NONE;
    return PyUnicode_DecodeUTF8(self->key_prefix, (Py_ssize_t)self->key_prefix_len, "strict");
}

static PyObject *
Limiter_get_max_connections(LimiterObject *self, void *Py_UNUSED(closure))
{
    if (self->configured && self->cluster != NULL)
        return PyLong_FromLong(self->cluster->max_open); /* per node */
    return PyLong_FromLong(self->configured ? self->pool.max_open : 0);
}

static PyObject *
Limiter_get_open_connections(LimiterObject *self, void *Py_UNUSED(closure))
{
    int n = 0;
    if (self->configured) {
        own_pool(self);
        Py_BEGIN_ALLOW_THREADS
        n = self->cluster != NULL ? rl_cluster_open_count(self->cluster)
                                  : rl_pool_open_count(&self->pool);
        Py_END_ALLOW_THREADS
    }
    return PyLong_FromLong(n);
}

static PyObject *
Limiter_get_closed(LimiterObject *self, void *Py_UNUSED(closure))
{
    int closed = 0;
    if (self->configured) {
        own_pool(self);
        Py_BEGIN_ALLOW_THREADS
        closed = self->cluster != NULL ? rl_cluster_is_closed(self->cluster)
                                       : rl_pool_is_closed(&self->pool);
        Py_END_ALLOW_THREADS
    }
    return PyBool_FromLong(closed);
}

static PyMethodDef Limiter_methods[] = {
    {"check", (PyCFunction)(void (*)(void))Limiter_check,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Limiter_check_doc},
    {"check_windows", (PyCFunction)(void (*)(void))Limiter_check_windows,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Limiter_check_windows_doc},
    {"check_windows_detailed", (PyCFunction)(void (*)(void))Limiter_check_windows_detailed,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Limiter_check_windows_detailed_doc},
    {"_reserve", (PyCFunction)(void (*)(void))Limiter_reserve,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Limiter_reserve_doc},
    {"_reconcile", (PyCFunction)(void (*)(void))Limiter_reconcile,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Limiter_reconcile_doc},
    {"_peek", (PyCFunction)(void (*)(void))Limiter_peek,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Limiter_peek_doc},
    {"_check_rate", (PyCFunction)(void (*)(void))Limiter_check_rate,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Limiter_check_rate_doc},
    {"_hold_budgets", (PyCFunction)(void (*)(void))Limiter_hold_budgets,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Limiter_hold_budgets_doc},
    {"_settle_budgets", (PyCFunction)(void (*)(void))Limiter_settle_budgets,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Limiter_settle_budgets_doc},
    {"_observe_upstream", (PyCFunction)(void (*)(void))Limiter_observe_upstream,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Limiter_observe_upstream_doc},
    {"_wait_queue", (PyCFunction)(void (*)(void))Limiter_wait_queue,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Limiter_wait_queue_doc},
    {"_reset", (PyCFunction)(void (*)(void))Limiter_reset,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Limiter_reset_doc},
    {"metrics", (PyCFunction)Limiter_get_metrics, METH_NOARGS, Limiter_metrics_doc},
    {"_record_outcome", (PyCFunction)(void (*)(void))Limiter_record_outcome, METH_FASTCALL,
     Limiter_record_outcome_doc},
    {"_acquire", (PyCFunction)(void (*)(void))Limiter_acquire,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Limiter_acquire_doc},
    {"_release", (PyCFunction)(void (*)(void))Limiter_release,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Limiter_release_doc},
    {"_renew", (PyCFunction)(void (*)(void))Limiter_renew,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Limiter_renew_doc},
    {"close", (PyCFunction)Limiter_close, METH_NOARGS, Limiter_close_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Limiter_getset[] = {
    {"key_prefix", (getter)Limiter_get_key_prefix, NULL, "The prefix of every key.", NULL},
    {"max_connections", (getter)Limiter_get_max_connections, NULL,
     "The most connections this limiter opens at once.", NULL},
    {"open_connections", (getter)Limiter_get_open_connections, NULL,
     "Connections open now (idle or in use).", NULL},
    {"closed", (getter)Limiter_get_closed, NULL, "True once close() was called.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Limiter_doc,
"Limiter(*, host=None, port=6379, unix_path=None, db=0, username=None, password=None,\n"
"        connect_timeout=1.0, socket_timeout=1.0, key_prefix='ratelimit',\n"
"        client_clock=False, max_connections=32, tls=False, ssl_verify=True,\n"
"        ssl_ca_certs=None, ssl_certfile=None, ssl_keyfile=None, metrics=True,\n"
"        cluster_nodes=None, sentinel_master=None, storage='zset', min_replicas=0,\n"
"        replica_timeout_ms=100)\n--\n\n"
"The C core of genai_ratelimit.RateLimiter; use that class, which takes a URL.");

static PyType_Slot Limiter_slots[] = {
    {Py_tp_doc, (void *)Limiter_doc},
    {Py_tp_new, Limiter_new},
    {Py_tp_init, Limiter_init},
    {Py_tp_dealloc, Limiter_dealloc},
    {Py_tp_methods, Limiter_methods},
    {Py_tp_getset, Limiter_getset},
    {0, NULL},
};

PyType_Spec rl_limiter_spec = {
    .name = "genai_ratelimit._native.Limiter",
    .basicsize = sizeof(LimiterObject),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Limiter_slots,
};
