/*
 * py_metrics.c - the counters of one limiter: decisions by outcome, rejections by the window
 * that refused (its length, resource and scope), tokens reserved, charged and refunded,
 * leases taken and given back, Redis round-trip latency in fixed buckets per op, replays and
 * connection errors.
 *
 * The counters live in the limiter object (Limiter, or the Codec of an async limiter);
 * the protocol engine (proto.c) counts answered scripts and the latency of every round
 * trip on the path both drivers share, the drivers count what only they see (a call that
 * failed, a replay, a connection that broke), and the Python layer what only it knows
 * (a reservation's tokens, the FastAPI layer's outcomes) through rl_metrics_record.
 *
 * Every label value comes from a fixed set or from the first RL_REJECT_SLOTS distinct
 * rejecting windows (later ones share "other"): no user id, no scope name, nothing that
 * grows with the traffic, so the exported series are bounded.
 *
 * GIL contract: the counting functions touch no Python object and may run without the
 * GIL (the blocking driver's threads count at once): every update is a relaxed atomic
 * add, so a reader sees each counter exact, if not a snapshot of all at one instant.
 * rl_metrics_object and rl_metrics_record hold the GIL.
 */
#include "native.h"

#include <string.h>
#include <strings.h>

/* Upper bounds of the latency buckets, microseconds (Prometheus's default buckets from
   0.1 ms up: a local Redis answers in about 50 us, a remote one in about a millisecond). */
static const unsigned long long latency_bounds_us[RL_LATENCY_BUCKETS] = {
    100,   250,    500,    1000,   2500,    5000,    10000,   25000,
    50000, 100000, 250000, 500000, 1000000, 2500000, 5000000, 10000000,
};

/* The `op` label of each rl_op, and the rl_op of each decision shape. */
static const char *const op_names[RL_OP_COUNT] = {
    [RL_OP_CHECK] = "check",
    [RL_OP_CHECK_WINDOWS] = "check_windows",
    [RL_OP_CHECK_WINDOWS_DETAILED] = "check_windows_detailed",
    [RL_OP_RESERVE] = "reserve",
    [RL_OP_RECONCILE] = "reconcile",
    [RL_OP_PEEK] = "peek",
    [RL_OP_RESET] = "reset",
    [RL_OP_ACQUIRE] = "acquire",
    [RL_OP_RELEASE] = "release",
    [RL_OP_RENEW] = "renew",
    [RL_OP_PING] = "ping",
    [RL_OP_COMMAND] = "command",
};

static const int shape_ops[] = {
    [RL_SHAPE_CHECK] = RL_OP_CHECK,
    [RL_SHAPE_WINDOWS] = RL_OP_CHECK_WINDOWS,
    [RL_SHAPE_DETAILED] = RL_OP_CHECK_WINDOWS_DETAILED,
    [RL_SHAPE_RESERVE] = RL_OP_RESERVE,
    [RL_SHAPE_RECONCILE] = RL_OP_RECONCILE,
    [RL_SHAPE_PEEK] = RL_OP_PEEK,
    [RL_SHAPE_RESET] = RL_OP_RESET,
    [RL_SHAPE_ACQUIRE] = RL_OP_ACQUIRE,
    [RL_SHAPE_RELEASE] = RL_OP_RELEASE,
    [RL_SHAPE_RENEW] = RL_OP_RENEW,
    [RL_SHAPE_GCRA] = RL_OP_CHECK, /* check_rate: a check's latency, outcome and rejections */
    [RL_SHAPE_BUDGET_HOLD] = RL_OP_RESERVE,     /* hold_budgets: a reservation's latency */
    [RL_SHAPE_BUDGET_SETTLE] = RL_OP_RECONCILE, /* settle_budgets: a reconcile's */
};

/* The `scope` label of each rl_scope_kind. */
static const char *const scope_names[RL_SCOPE_KINDS] = {
    [RL_SCOPE_USER] = "user",         [RL_SCOPE_ROUTE] = "route", [RL_SCOPE_MODEL] = "model",
    [RL_SCOPE_UPSTREAM] = "upstream", [RL_SCOPE_OTHER] = "other",
};

int
rl_metrics_op(rl_shape shape)
{
    return (size_t)shape < sizeof(shape_ops) / sizeof(shape_ops[0]) ? shape_ops[shape]
                                                                    : RL_OP_COMMAND;
}

int
rl_metrics_command_op(const char *name, size_t len)
{
    return len == 4 && strncasecmp(name, "PING", 4) == 0 ? RL_OP_PING : RL_OP_COMMAND;
}

int
rl_metrics_scope_kind(const char *name, size_t len, int shared)
{
    if (shared)
        return RL_SCOPE_UPSTREAM;
    if (len >= 6 && memcmp(name, "route:", 6) == 0)
        return RL_SCOPE_ROUTE;
    if (len >= 6 && memcmp(name, "model:", 6) == 0)
        return RL_SCOPE_MODEL;
    return RL_SCOPE_OTHER;
}

void
rl_metrics_count(unsigned long long *counter)
{
    __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
}

void
rl_metrics_latency(rl_metrics *m, int op, double seconds)
{
    unsigned long long ns = seconds > 0 ? (unsigned long long)(seconds * 1e9) : 0;
    unsigned long long us = ns / 1000;
    rl_latency *l = &m->latency[op >= 0 && op < RL_OP_COUNT ? op : RL_OP_COMMAND];
    int i = 0;
    while (i < RL_LATENCY_BUCKETS && us > latency_bounds_us[i])
        i++;
    __atomic_fetch_add(&l->count[i], 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&l->sum_ns, ns, __ATOMIC_RELAXED);
}

/* The slot of a rejecting window: found, or claimed (compare-and-swap on a free one), or
   NULL when every slot holds another window. */
static unsigned long long *
reject_counter(rl_metrics *m, long long window)
{
    for (int i = 0; i < RL_REJECT_SLOTS; i++) {
        long long seen = __atomic_load_n(&m->reject_window[i], __ATOMIC_ACQUIRE);
        if (seen == 0) {
            long long expected = 0;
            if (__atomic_compare_exchange_n(&m->reject_window[i], &expected, window, 0,
                                            __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                return &m->rejected[i];
            seen = expected; /* another thread claimed it first: for which window? */
        }
        if (seen == window)
            return &m->rejected[i];
    }
    return NULL;
}

void
rl_metrics_decision(rl_metrics *m, const rl_prepared *d, const rl_result *r)
{
    if (d->script == RL_SCRIPT_LEASE) {
        if (d->shape == RL_SHAPE_ACQUIRE)
            rl_metrics_count(r->allowed ? &m->leases_acquired : &m->leases_refused);
        else if (d->shape == RL_SHAPE_RELEASE)
            rl_metrics_count(r->allowed ? &m->leases_released : &m->releases_not_held);
        return;
    }
    if (d->script == RL_SCRIPT_RECONCILE_RELEASE ||
        d->script == RL_SCRIPT_COMPACT_RECONCILE_RELEASE) { /* reconcile's release: release's */
        rl_metrics_count(r->slot == 1 ? &m->leases_released : &m->releases_not_held);
        return;
    }
    if ((d->script == RL_SCRIPT_IN_FLIGHT || d->script == RL_SCRIPT_COMPACT_IN_FLIGHT) &&
        (r->slot == 1 || r->window < 0)) /* reserve's in-flight slot: acquire's counters */
        rl_metrics_count(r->slot == 1 ? &m->leases_acquired : &m->leases_refused);
    if (!rl_script_decides(d->script))
        return; /* peek, reset and reconcile are not decisions */
    if (r->allowed) {
        rl_metrics_count(&m->allowed);
        return;
    }
    if (r->window < 0)
        return; /* an in-flight slot refused it, no window: the lease's answer, as acquire's */
    const rl_windows *w = &d->windows;
    int i = r->window >= 0 && r->window < w->count ? r->window : 0;
    int scope = w->scope[i] > 0 && w->scope[i] <= d->nscopes ? d->scopes[w->scope[i] - 1].kind
                                                             : RL_SCOPE_USER;
    if (scope < 0 || scope >= RL_SCOPE_KINDS)
        scope = RL_SCOPE_OTHER;
    long long window = (w->seconds[i] * 2 + (w->tokens[i] ? 1 : 0)) * RL_SCOPE_KINDS + scope + 1;
    unsigned long long *counter = reject_counter(m, window);
    rl_metrics_count(counter != NULL ? counter : &m->rejected_other[w->tokens[i] ? 1 : 0][scope]);
}

static unsigned long long
load(const unsigned long long *counter)
{
    return __atomic_load_n(counter, __ATOMIC_RELAXED);
}

/* Sets d[name] = value (an unsigned counter). 0, or -1 with an exception. */
static int
set_count(PyObject *d, const char *name, unsigned long long value)
{
    PyObject *v = PyLong_FromUnsignedLongLong(value);
    int rc = v == NULL ? -1 : PyDict_SetItemString(d, name, v);
    Py_XDECREF(v);
    return rc;
}

/* Sets d[name] = item and drops the reference to item (stolen even on failure). */
static int
set_item(PyObject *d, const char *name, PyObject *item)
{
    int rc = item == NULL ? -1 : PyDict_SetItemString(d, name, item);
    Py_XDECREF(item);
    return rc;
}

/* Appends (window_seconds or None, resource, scope, count) to list. 0, or -1. */
static int
append_rejection(PyObject *list, long long seconds, int tokens, int scope, unsigned long long n)
{
    PyObject *row = seconds > 0 ? Py_BuildValue("(LssK)", seconds, tokens ? "tokens" : "requests",
                                                scope_names[scope], n)
                                : Py_BuildValue("(OssK)", Py_None, tokens ? "tokens" : "requests",
                                                scope_names[scope], n);
    int rc = row == NULL ? -1 : PyList_Append(list, row);
    Py_XDECREF(row);
    return rc;
}

/* rejected_by_window ({"60": n, "60:tokens": n, "other": n}: every scope together) and
   rejections (a tuple of (window_seconds | None, resource, scope, count)) into d; the
   total of every rejection into *total. 0, or -1 with an exception. */
static int
set_rejections(PyObject *d, rl_metrics *m, unsigned long long *total)
{
    long long windows[RL_REJECT_SLOTS]; /* seconds * 2 + is_token, once each */
    unsigned long long sums[RL_REJECT_SLOTS], other = 0;
    int nwindows = 0;
    PyObject *by_window = NULL, *rows = PyList_New(0);
    char name[48];
    *total = 0;
    if (rows == NULL)
        return -1;
    for (int i = 0; i < RL_REJECT_SLOTS; i++) {
        long long key = __atomic_load_n(&m->reject_window[i], __ATOMIC_ACQUIRE);
        if (key == 0)
            break;
        unsigned long long n = load(&m->rejected[i]);
        long long window = (key - 1) / RL_SCOPE_KINDS;
        int scope = (int)((key - 1) % RL_SCOPE_KINDS), j = 0;
        if (append_rejection(rows, window / 2, (int)(window % 2), scope, n) < 0)
            goto error;
        while (j < nwindows && windows[j] != window)
            j++;
        if (j == nwindows) {
            windows[nwindows] = window;
            sums[nwindows++] = 0;
        }
        sums[j] += n;
        *total += n;
    }
    for (int tokens = 0; tokens < 2; tokens++) {
        for (int scope = 0; scope < RL_SCOPE_KINDS; scope++) {
            unsigned long long n = load(&m->rejected_other[tokens][scope]);
            if (n > 0 && append_rejection(rows, 0, tokens, scope, n) < 0)
                goto error;
            other += n;
        }
    }
    *total += other;
    if ((by_window = PyDict_New()) == NULL)
        goto error;
    for (int j = 0; j < nwindows; j++) {
        snprintf(name, sizeof(name), "%lld%s", windows[j] / 2, windows[j] % 2 ? ":tokens" : "");
        if (set_count(by_window, name, sums[j]) < 0)
            goto error;
    }
    if (other > 0 && set_count(by_window, "other", other) < 0)
        goto error;
    if (PyDict_SetItemString(d, "rejected_by_window", by_window) < 0)
        goto error;
    Py_CLEAR(by_window);
    int rc = set_item(d, "rejections", PyList_AsTuple(rows));
    Py_DECREF(rows);
    return rc;
error:
    Py_XDECREF(by_window);
    Py_DECREF(rows);
    return -1;
}

/* ((upper bound in seconds or None for the last, count in that bucket alone), ...).
   New reference. */
static PyObject *
buckets_object(const unsigned long long *counts)
{
    PyObject *item = PyTuple_New(RL_LATENCY_BUCKETS + 1);
    if (item == NULL)
        return NULL;
    for (int i = 0; i <= RL_LATENCY_BUCKETS; i++) {
        PyObject *pair = i < RL_LATENCY_BUCKETS
                             ? Py_BuildValue("(dK)", (double)latency_bounds_us[i] / 1e6, counts[i])
                             : Py_BuildValue("(OK)", Py_None, counts[i]);
        if (pair == NULL || PyTuple_SetItem(item, i, pair) < 0) { /* SetItem steals pair */
            Py_DECREF(item);
            return NULL;
        }
    }
    return item;
}

/* {"buckets": ..., "sum_s": float, "count": int} of counts and their sum. New reference. */
static PyObject *
histogram_object(const unsigned long long *counts, unsigned long long sum_ns)
{
    unsigned long long total = 0;
    for (int i = 0; i <= RL_LATENCY_BUCKETS; i++)
        total += counts[i];
    PyObject *h = PyDict_New();
    if (h == NULL)
        return NULL;
    if (set_item(h, "buckets", buckets_object(counts)) < 0 ||
        set_item(h, "sum_s", PyFloat_FromDouble((double)sum_ns / 1e9)) < 0 ||
        set_count(h, "count", total) < 0) {
        Py_DECREF(h);
        return NULL;
    }
    return h;
}

/* latency_by_op ({op: histogram}, every op) and the scripts' round trips together
   (latency_buckets, latency_sum_s, latency_count: what a limiter reported before ops had a
   histogram each). 0, or -1 with an exception. */
static int
set_latency(PyObject *d, rl_metrics *m)
{
    unsigned long long scripts[RL_LATENCY_BUCKETS + 1] = {0}, scripts_ns = 0, scripts_n = 0;
    PyObject *by_op = PyDict_New();
    if (by_op == NULL)
        return -1;
    for (int op = 0; op < RL_OP_COUNT; op++) {
        unsigned long long counts[RL_LATENCY_BUCKETS + 1];
        unsigned long long ns = __atomic_load_n(&m->latency[op].sum_ns, __ATOMIC_RELAXED);
        for (int i = 0; i <= RL_LATENCY_BUCKETS; i++) {
            counts[i] = load(&m->latency[op].count[i]);
            if (op < RL_OP_PING) {
                scripts[i] += counts[i];
                scripts_n += counts[i];
            }
        }
        if (op < RL_OP_PING)
            scripts_ns += ns;
        if (set_item(by_op, op_names[op], histogram_object(counts, ns)) < 0) {
            Py_DECREF(by_op);
            return -1;
        }
    }
    if (set_item(d, "latency_by_op", by_op) < 0 ||
        set_item(d, "latency_buckets", buckets_object(scripts)) < 0 ||
        set_item(d, "latency_sum_s", PyFloat_FromDouble((double)scripts_ns / 1e9)) < 0 ||
        set_count(d, "latency_count", scripts_n) < 0)
        return -1;
    return 0;
}

PyObject *
rl_metrics_object(rl_metrics *m, int enabled)
{
    static const struct {
        const char *name;
        size_t offset;
    } counters[] = {
        {"allowed", offsetof(rl_metrics, allowed)},
        {"unavailable", offsetof(rl_metrics, unavailable)},
        {"fail_open", offsetof(rl_metrics, fail_open)},
        {"shadow", offsetof(rl_metrics, shadow)},
        {"replays", offsetof(rl_metrics, replays)},
        {"connection_errors", offsetof(rl_metrics, connection_errors)},
        {"reserved_tokens", offsetof(rl_metrics, reserved_tokens)},
        {"charged_tokens", offsetof(rl_metrics, charged_tokens)},
        {"refunded_tokens", offsetof(rl_metrics, refunded_tokens)},
        {"leases_acquired", offsetof(rl_metrics, leases_acquired)},
        {"leases_refused", offsetof(rl_metrics, leases_refused)},
        {"leases_released", offsetof(rl_metrics, leases_released)},
        {"releases_not_held", offsetof(rl_metrics, releases_not_held)},
    };
    PyObject *d = PyDict_New();
    unsigned long long rejected = 0;
    if (d == NULL)
        return NULL;
    if (PyDict_SetItemString(d, "enabled", enabled ? Py_True : Py_False) < 0)
        goto error;
    for (size_t i = 0; i < sizeof(counters) / sizeof(counters[0]); i++) {
        if (set_count(d, counters[i].name,
                      load((const unsigned long long *)((char *)m + counters[i].offset))) < 0)
            goto error;
    }
    if (set_rejections(d, m, &rejected) < 0 || set_count(d, "rejected", rejected) < 0 ||
        set_latency(d, m) < 0)
        goto error;
    return d;
error:
    Py_DECREF(d);
    return NULL;
}

PyObject *
rl_metrics_record(rl_metrics *m, PyObject *const *args, Py_ssize_t nargs)
{
    static const struct {
        const char *name;
        size_t offset;
    } kinds[] = {
        {"fail_open", offsetof(rl_metrics, fail_open)},
        {"shadow", offsetof(rl_metrics, shadow)},
        {"unavailable", offsetof(rl_metrics, unavailable)},
        {"connection_error", offsetof(rl_metrics, connection_errors)},
        {"reserved_tokens", offsetof(rl_metrics, reserved_tokens)},
        {"charged_tokens", offsetof(rl_metrics, charged_tokens)},
        {"refunded_tokens", offsetof(rl_metrics, refunded_tokens)},
    };
    long long count = 1;
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError,
                     "_record_outcome takes a kind and an optional count (%zd "
                     "arguments given)",
                     nargs);
        return NULL;
    }
    PyObject *kind = args[0];
    if (!PyUnicode_Check(kind)) {
        rl_type_error(kind, "kind must be a str, not ");
        return NULL;
    }
    if (nargs == 2) {
        if (!PyLong_Check(args[1]) || PyBool_Check(args[1])) {
            rl_type_error(args[1], "count must be an int, not ");
            return NULL;
        }
        count = PyLong_AsLongLong(args[1]);
        if (count == -1 && PyErr_Occurred())
            return NULL;
        if (count < 0) {
            PyErr_Format(PyExc_ValueError, "count must be >= 0, got %lld", count);
            return NULL;
        }
    }
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
        if (PyUnicode_CompareWithASCIIString(kind, kinds[i].name) == 0) {
            if (m != NULL)
                __atomic_fetch_add((unsigned long long *)((char *)m + kinds[i].offset),
                                   (unsigned long long)count, __ATOMIC_RELAXED);
            Py_RETURN_NONE;
        }
    }
    PyErr_Format(PyExc_ValueError,
                 "kind must be 'fail_open', 'shadow', 'unavailable', 'connection_error', "
                 "'reserved_tokens', 'charged_tokens' or 'refunded_tokens', got %R",
                 kind);
    return NULL;
}
