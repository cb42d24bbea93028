/*
 * metrics.c - the counters of one limiter: decisions by outcome, Redis round-trip
 * latency in fixed buckets, replays and connection errors.
 *
 * The counters live in the limiter object (Limiter, or the Codec of an async limiter);
 * the protocol engine (proto.c) counts answered decisions and their latency on the path
 * both drivers share, the drivers count what only they see (a call that failed, a
 * replay, a connection that broke).
 *
 * GIL contract: the counting functions touch no Python object and may run without the
 * GIL (the blocking driver's threads count at once): every update is a relaxed atomic
 * add, so a reader sees each counter exact, if not a snapshot of all at one instant.
 * rl_metrics_object and rl_metrics_record hold the GIL.
 */
#include "native.h"

#include <string.h>

/* Upper bounds of the latency buckets, microseconds (Prometheus's default buckets from
   0.1 ms up: a local Redis answers in about 50 us, a remote one in about a millisecond). */
static const unsigned long long latency_bounds_us[RL_LATENCY_BUCKETS] = {
    100,   250,    500,    1000,   2500,    5000,    10000,   25000,
    50000, 100000, 250000, 500000, 1000000, 2500000, 5000000, 10000000,
};

void
rl_metrics_count(unsigned long long *counter)
{
    __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
}

void
rl_metrics_latency(rl_metrics *m, double seconds)
{
    unsigned long long us = seconds > 0 ? (unsigned long long)(seconds * 1e6) : 0;
    int i = 0;
    while (i < RL_LATENCY_BUCKETS && us > latency_bounds_us[i])
        i++;
    __atomic_fetch_add(&m->latency[i], 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&m->latency_sum_us, us, __ATOMIC_RELAXED);
}

/* The slot of a rejecting window: found, or claimed (compare-and-swap on a free one). */
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
    return &m->rejected_other;
}

void
rl_metrics_decision(rl_metrics *m, const rl_prepared *d, const rl_result *r)
{
    if (d->script != RL_SCRIPT_WINDOW)
        return; /* peek, reset and reconcile are not decisions */
    if (r->allowed) {
        __atomic_fetch_add(&m->allowed, 1, __ATOMIC_RELAXED);
        return;
    }
    const rl_windows *w = &d->windows;
    long long window = w->seconds[r->window] * 2 + w->tokens[r->window] + 1;
    __atomic_fetch_add(reject_counter(m, window), 1, __ATOMIC_RELAXED);
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

/* {"60": n, "60:tokens": n, "other": n}: the rejections of each window. New reference. */
static PyObject *
rejected_object(rl_metrics *m)
{
    PyObject *d = PyDict_New();
    char name[48];
    if (d == NULL)
        return NULL;
    for (int i = 0; i < RL_REJECT_SLOTS; i++) {
        long long window = __atomic_load_n(&m->reject_window[i], __ATOMIC_ACQUIRE);
        if (window == 0)
            break;
        snprintf(name, sizeof(name), "%lld%s", (window - 1) / 2, (window - 1) % 2 ? ":tokens" : "");
        if (set_count(d, name, load(&m->rejected[i])) < 0)
            goto error;
    }
    if (load(&m->rejected_other) > 0 && set_count(d, "other", load(&m->rejected_other)) < 0)
        goto error;
    return d;
error:
    Py_DECREF(d);
    return NULL;
}

PyObject *
rl_metrics_object(rl_metrics *m, int enabled)
{
    PyObject *d = PyDict_New(), *item = NULL;
    unsigned long long rejected = load(&m->rejected_other), latency_count = 0;
    if (d == NULL)
        return NULL;
    for (int i = 0; i < RL_REJECT_SLOTS; i++)
        rejected += load(&m->rejected[i]);
    if (PyDict_SetItemString(d, "enabled", enabled ? Py_True : Py_False) < 0 ||
        set_count(d, "allowed", load(&m->allowed)) < 0 || set_count(d, "rejected", rejected) < 0 ||
        set_count(d, "unavailable", load(&m->unavailable)) < 0 ||
        set_count(d, "fail_open", load(&m->fail_open)) < 0 ||
        set_count(d, "shadow", load(&m->shadow)) < 0 ||
        set_count(d, "replays", load(&m->replays)) < 0 ||
        set_count(d, "connection_errors", load(&m->connection_errors)) < 0)
        goto error;
    if ((item = rejected_object(m)) == NULL ||
        PyDict_SetItemString(d, "rejected_by_window", item) < 0)
        goto error;
    Py_CLEAR(item);
    /* Buckets: (upper bound in seconds or None for the last, count in it alone). */
    if ((item = PyTuple_New(RL_LATENCY_BUCKETS + 1)) == NULL)
        goto error;
    for (int i = 0; i <= RL_LATENCY_BUCKETS; i++) {
        unsigned long long n = load(&m->latency[i]);
        PyObject *pair = i < RL_LATENCY_BUCKETS
                             ? Py_BuildValue("(dK)", (double)latency_bounds_us[i] / 1e6, n)
                             : Py_BuildValue("(OK)", Py_None, n);
        if (pair == NULL || PyTuple_SetItem(item, i, pair) < 0)
            goto error;
        latency_count += n;
    }
    if (PyDict_SetItemString(d, "latency_buckets", item) < 0)
        goto error;
    Py_CLEAR(item);
    if ((item = PyFloat_FromDouble((double)load(&m->latency_sum_us) / 1e6)) == NULL ||
        PyDict_SetItemString(d, "latency_sum_s", item) < 0)
        goto error;
    Py_CLEAR(item);
    if (set_count(d, "latency_count", latency_count) < 0)
        goto error;
    return d;
error:
    Py_XDECREF(item);
    Py_DECREF(d);
    return NULL;
}

PyObject *
rl_metrics_record(rl_metrics *m, PyObject *kind)
{
    static const struct {
        const char *name;
        size_t offset;
    } kinds[] = {
        {"fail_open", offsetof(rl_metrics, fail_open)},
        {"shadow", offsetof(rl_metrics, shadow)},
        {"unavailable", offsetof(rl_metrics, unavailable)},
        {"connection_error", offsetof(rl_metrics, connection_errors)},
    };
    if (!PyUnicode_Check(kind)) {
        rl_type_error(kind, "kind must be a str, not ");
        return NULL;
    }
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
        if (PyUnicode_CompareWithASCIIString(kind, kinds[i].name) == 0) {
            if (m != NULL)
                rl_metrics_count((unsigned long long *)((char *)m + kinds[i].offset));
            Py_RETURN_NONE;
        }
    }
    PyErr_Format(PyExc_ValueError,
                 "kind must be 'fail_open', 'shadow', 'unavailable' or 'connection_error', "
                 "got %R",
                 kind);
    return NULL;
}
