/*
 * py_request.c - a Python face, BEFORE any I/O: everything a decision needs from its Python
 * arguments (validation, the kill switch, the member, the clock, the formatted EVALSHA:
 * rl_parse_request, rl_prepare) and the limiters' constructor options, validated here once
 * for both limiters (rl_check_options, rl_check_limiter_values). After the I/O, the answer
 * becomes Python objects in py_result.c.
 * Shared by the blocking limiter (py_limiter.c) and the asyncio codec (py_codec.c), so both
 * answer exactly alike.
 *
 * GIL contract: every function here is called with the GIL held and reports errors as
 * Python exceptions (returning -1 or NULL).
 */
#include "native.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* Parses one int argument that must lie in [1, max]. bool is not an int here. */
static int
positive_int(PyObject *value, const char *name, long long max, long long *out)
{
    int overflow = 0;
    long long v;
    if (!PyLong_Check(value) || PyBool_Check(value)) {
        rl_type_error(value, "%s must be an int, not ", name);
        return -1;
    }
    v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow > 0 || v > max) {
        PyErr_Format(PyExc_ValueError, "%s must be at most %lld, got %S", name, max, value);
        return -1;
    }
    if (overflow < 0 || v < 1) {
        PyErr_Format(PyExc_ValueError, "%s must be >= 1, got %S", name, value);
        return -1;
    }
    *out = v;
    return 0;
}

static int
add_window(rl_windows *w, PyObject *limit, PyObject *seconds, int tokens, int scope)
{
    long long l, s;
    if (w->count >= RL_MAX_WINDOWS) {
        PyErr_Format(PyExc_ValueError, "at most %d windows can be checked at once", RL_MAX_WINDOWS);
        return -1;
    }
    if (positive_int(limit, "limit", RL_MAX_LIMIT, &l) < 0 ||
        positive_int(seconds, "window_seconds", RL_MAX_WINDOW_SECONDS, &s) < 0)
        return -1;
    for (int j = 0; j < w->count; j++) {
        if (w->seconds[j] == s && w->tokens[j] == tokens && w->scope[j] == scope) {
            PyErr_Format(PyExc_ValueError,
                         "%swindow_seconds %lld appears twice: each window needs its own length",
                         tokens ? "token " : "", s);
            return -1;
        }
    }
    /* Insert keeping the windows sorted, shortest first, requests before tokens for one
       length, the user's own before its scopes' (stable otherwise). */
    int i = w->count;
    while (i > 0 &&
           (w->seconds[i - 1] > s ||
            (w->seconds[i - 1] == s && (w->tokens[i - 1] > tokens || (w->tokens[i - 1] == tokens &&
                                                                      w->scope[i - 1] > scope))))) {
        w->seconds[i] = w->seconds[i - 1];
        w->limit[i] = w->limit[i - 1];
        w->cost[i] = w->cost[i - 1];
        w->tokens[i] = w->tokens[i - 1];
        w->scope[i] = w->scope[i - 1];
        i--;
    }
    w->seconds[i] = s;
    w->limit[i] = l;
    w->cost[i] = 1;
    w->tokens[i] = (unsigned char)tokens;
    w->scope[i] = (unsigned char)scope;
    w->count++;
    return 0;
}

/* Adds every (limit, window_seconds) pair of `windows` (named `name` in errors) to w.
   An empty sequence is refused unless allow_empty. */
static int
add_windows(rl_windows *w, PyObject *windows, const char *name, int tokens, int allow_empty,
            int scope)
{
    PyObject *seq;
    Py_ssize_t n;
    int rc = -1;
    if (PyUnicode_Check(windows) || PyBytes_Check(windows) || PyByteArray_Check(windows) ||
        !PySequence_Check(windows)) {
        rl_type_error(windows, "%s must be a sequence of (limit, window_seconds) pairs, not ",
                      name);
        return -1;
    }
    seq = PySequence_Fast(windows, "windows must be a sequence of (limit, window_seconds) pairs");
    if (seq == NULL)
        return -1;
    n = rl_seq_size(seq);
    if (n == 0 && !allow_empty) {
        PyErr_Format(PyExc_ValueError, "%s must hold at least one (limit, window_seconds) pair",
                     name);
        goto done;
    }
    if (n > RL_MAX_WINDOWS - w->count) {
        PyErr_Format(PyExc_ValueError, "at most %d windows can be checked at once, got %zd",
                     RL_MAX_WINDOWS, n + w->count);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = rl_seq_item(seq, i); /* borrowed */
        if (!(PyTuple_Check(pair) || PyList_Check(pair)) || rl_seq_size(pair) != 2) {
            rl_type_error(pair, "%s[%zd] must be a (limit, window_seconds) pair, got ", name, i);
            goto done;
        }
        if (add_window(w, rl_seq_item(pair, 0), rl_seq_item(pair, 1), tokens, scope) < 0)
            goto done;
    }
    rc = 0;
done:
    Py_DECREF(seq);
    return rc;
}

/* Sets the cost of every window of one resource; a cost no window of it could ever allow
   is refused before any I/O (the caller knows both numbers). */
static int
set_cost(rl_prepared *d, PyObject *value, const char *name, int tokens)
{
    rl_windows *w = &d->windows;
    long long cost = 1;
    if (value != NULL && positive_int(value, name, RL_MAX_LIMIT, &cost) < 0)
        return -1;
    for (int i = 0; i < w->count; i++) {
        if (w->tokens[i] != tokens)
            continue;
        if (cost > w->limit[i]) {
            if (w->scope[i] == 0) {
                PyErr_Format(PyExc_ValueError,
                             "%s %lld can never be allowed: the %swindow of %lld s allows at most "
                             "%lld",
                             name, cost, tokens ? "token " : "", w->seconds[i], w->limit[i]);
                return -1;
            }
            /* PyErr_Format has no %.*s: the name (not NUL-terminated) goes as a str. */
            const rl_scope *scope = &d->scopes[w->scope[i] - 1];
            PyObject *shown =
                PyUnicode_DecodeUTF8(scope->name, (Py_ssize_t)scope->name_len, "replace");
            if (shown == NULL)
                return -1;
            PyErr_Format(PyExc_ValueError,
                         "%s %lld can never be allowed: the %swindow of %lld s of scope %R allows "
                         "at most %lld",
                         name, cost, tokens ? "token " : "", w->seconds[i], shown, w->limit[i]);
            Py_DECREF(shown);
            return -1;
        }
        w->cost[i] = cost;
    }
    return 0;
}

/* Adds the windows of `scopes`: a tuple of (name, shared, windows, token_windows) tuples
   for reserve (reconcile_tokens < 0), of (name, shared, windows) for reconcile, whose
   windows are then token windows when reconcile_tokens is 1. Tuples only: the names are
   borrowed (rl_scope) and a tuple cannot drop them while the decision is prepared. */
static int
add_scopes(rl_prepared *d, PyObject *scopes, int reconcile_tokens)
{
    Py_ssize_t n, size = reconcile_tokens < 0 ? 4 : 3;
    if (!PyTuple_Check(scopes)) {
        rl_type_error(scopes, "scopes must be a tuple, not ");
        return -1;
    }
    n = PyTuple_Size(scopes);
    if (n > RL_MAX_SCOPES) {
        PyErr_Format(PyExc_ValueError, "at most %d scopes can be decided at once, got %zd",
                     RL_MAX_SCOPES, n);
        return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *t = PyTuple_GetItem(scopes, k);
        Py_ssize_t len;
        const char *name;
        int shared;
        if (!PyTuple_Check(t) || PyTuple_Size(t) != size) {
            rl_type_error(t, "scopes[%zd] must be a tuple of %zd items, got ", k, size);
            return -1;
        }
        if (!PyUnicode_Check(PyTuple_GetItem(t, 0))) {
            rl_type_error(PyTuple_GetItem(t, 0), "a scope's name must be a str, not ");
            return -1;
        }
        name = PyUnicode_AsUTF8AndSize(PyTuple_GetItem(t, 0), &len);
        if (name == NULL)
            return -1;
        if (len == 0 || len > RL_MAX_SCOPE_NAME) {
            PyErr_Format(PyExc_ValueError,
                         "a scope's name must hold 1 to %d bytes of UTF-8, got %zd",
                         RL_MAX_SCOPE_NAME, len);
            return -1;
        }
        for (Py_ssize_t j = 0; j < k; j++) {
            if (d->scopes[j].name_len == (size_t)len && memcmp(d->scopes[j].name, name, len) == 0) {
                PyErr_Format(PyExc_ValueError, "scope %R appears twice", PyTuple_GetItem(t, 0));
                return -1;
            }
        }
        if (!PyBool_Check(PyTuple_GetItem(t, 1))) {
            rl_type_error(PyTuple_GetItem(t, 1), "a scope's shared flag must be a bool, not ");
            return -1;
        }
        shared = PyTuple_GetItem(t, 1) == Py_True;
        d->scopes[k].name = name;
        d->scopes[k].name_len = (size_t)len;
        d->scopes[k].shared = shared;
        d->scopes[k].kind = rl_metrics_scope_kind(name, (size_t)len, shared);
        d->nscopes = (int)k + 1;
        if (reconcile_tokens < 0) {
            if (add_windows(&d->windows, PyTuple_GetItem(t, 2), "a scope's windows", 0, 1,
                            (int)k + 1) < 0 ||
                add_windows(&d->windows, PyTuple_GetItem(t, 3), "a scope's token_windows", 1, 1,
                            (int)k + 1) < 0)
                return -1;
        } else if (add_windows(&d->windows, PyTuple_GetItem(t, 2), "a scope's windows",
                               reconcile_tokens, 1, (int)k + 1) < 0) {
            return -1;
        }
    }
    return 0;
}

/* 1 when some window of the decision counts tokens. */
static int
has_token_windows(const rl_windows *w)
{
    for (int i = 0; i < w->count; i++) {
        if (w->tokens[i])
            return 1;
    }
    return 0;
}

/* A spec the Python layer built for a script ("S ...", "C class", "P ..." in ASCII), given
   as the keyword `what`: a str of 3 to RL_MAX_SHARES_SPEC bytes starting with `lead` and a
   space; None leaves *text NULL. Refused with in_flight (`in_flight_error`). *text is
   borrowed from the str until rl_prepare ends. Returns 0, or -1 with an exception set. */
static int
parse_spec(PyObject *value, const rl_prepared *d, const char *what, char lead,
           const char *in_flight_error, const char **text, size_t *text_len)
{
    Py_ssize_t len;
    const char *utf8;
    if (value == Py_None)
        return 0;
    if (!PyUnicode_Check(value)) {
        rl_type_error(value, "%s must be a str, not ", what);
        return -1;
    }
    utf8 = PyUnicode_AsUTF8AndSize(value, &len);
    if (utf8 == NULL)
        return -1;
    if (len < 3 || len > RL_MAX_SHARES_SPEC || utf8[0] != lead || utf8[1] != ' ') {
        PyErr_Format(PyExc_ValueError, "%s must be a spec of 3 to %d bytes starting \"%c \"", what,
                     RL_MAX_SHARES_SPEC, lead);
        return -1;
    }
    if (d->script == RL_SCRIPT_IN_FLIGHT) {
        PyErr_SetString(PyExc_ValueError, in_flight_error);
        return -1;
    }
    *text = utf8;
    *text_len = (size_t)len;
    return 0;
}

/* reserve(..., shares=spec): the reserved-shares spec of a shared scope, built by
   genai_ratelimit/shares.py and read by lua/lib/shares.lua ("S ..."); reconcile(...,
   shares="C class"): the entry's class, whose logs lua/lib/set_cost.lua moves too. */
static int
parse_shares(PyObject *value, rl_prepared *d, char lead)
{
    return parse_spec(value, d, "shares", lead, "reserved shares do not go with in_flight yet",
                      &d->shares, &d->shares_len);
}

/* reserve(..., probe=spec): the probes of the shared scopes that follow their provider
   (lib/upstream.lua's "P p_1 t_1 ...", built by genai_ratelimit/reservation.py). */
static int
parse_probe(PyObject *value, rl_prepared *d)
{
    return parse_spec(value, d, "probe", 'P', "a probe does not go with in_flight yet", &d->probe,
                      &d->probe_len);
}

static int
parse_member(PyObject *value, const char *what, char out[RL_MEMBER_LEN + 1])
{
    Py_ssize_t len;
    const char *text;
    if (!PyUnicode_Check(value)) {
        rl_type_error(value, "%s must be a str, not ", what[0] == 'l' ? "lease_id" : "member");
        return -1;
    }
    text = PyUnicode_AsUTF8AndSize(value, &len);
    if (text == NULL)
        return -1;
    if (len != RL_MEMBER_LEN) {
        PyErr_Format(PyExc_ValueError, "%s must be a %s 36-character UUID, got %R",
                     what[0] == 'l' ? "lease_id" : "member", what, value);
        return -1;
    }
    memcpy(out, text, RL_MEMBER_LEN + 1);
    return 0;
}

/* An int in [0, max]; bool is not an int here. */
static int
non_negative_int(PyObject *value, const char *name, long long max, long long *out)
{
    if (PyLong_Check(value) && !PyBool_Check(value)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (overflow == 0 && v == 0) {
            *out = 0;
            return 0;
        }
    }
    return positive_int(value, name, max, out);
}

/* _observe_upstream(name, (requests, requests_reset_ms, requests_limit, tokens,
   tokens_reset_ms, tokens_limit, close_ms, bound_ms)): a provider response's numbers
   (genai_ratelimit/provider_limits.py), each -1 (not said) or a count (up to RL_MAX_LIMIT)
   or a wait in ms (up to RL_MAX_UPSTREAM_MS); the bound is a wait of at least 1 ms. 0, or -1
   with an exception. */
static int
parse_upstream(PyObject *value, rl_prepared *d)
{
    static const char *const names[RL_UPSTREAM_FIELDS] = {
        "requests left",   "requests reset ms", "requests limit", "tokens left",
        "tokens reset ms", "tokens limit",      "close ms",       "bound ms"};
    static const long long maxima[RL_UPSTREAM_FIELDS] = {
        RL_MAX_LIMIT,       RL_MAX_UPSTREAM_MS, RL_MAX_LIMIT,       RL_MAX_LIMIT,
        RL_MAX_UPSTREAM_MS, RL_MAX_LIMIT,       RL_MAX_UPSTREAM_MS, RL_MAX_UPSTREAM_MS};
    if (!PyTuple_Check(value) || PyTuple_Size(value) != RL_UPSTREAM_FIELDS) {
        rl_type_error(value, "an upstream observation must be a tuple of 8 ints, not ");
        return -1;
    }
    for (int i = 0; i < RL_UPSTREAM_FIELDS; i++) {
        PyObject *item = PyTuple_GetItem(value, i);
        if (i < RL_UPSTREAM_FIELDS - 1 && PyLong_Check(item) && !PyBool_Check(item)) {
            int overflow = 0;
            long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (v == -1 && PyErr_Occurred())
                return -1;
            if (overflow == 0 && v == -1) {
                d->upstream[i] = -1;
                continue;
            }
        }
        if ((i == RL_UPSTREAM_FIELDS - 1
                 ? positive_int(item, names[i], maxima[i], &d->upstream[i])
                 : non_negative_int(item, names[i], maxima[i], &d->upstream[i])) < 0)
            return -1;
    }
    return 0;
}

/* _wait_queue(name, ticket, tenant, (wait_ms, max_queue, max_tenant[, weight, class])): the
   tenant 1 to RL_TENANT_LEN hex digits (a digest made by genai_ratelimit/wait_queue.py), the
   wait 0 (leave) to RL_MAX_QUEUE_WAIT_MS, the bounds 1 to RL_MAX_QUEUE_LENGTH, the weight
   (the ticket's class's reserved share in basis points, lib/queue.lua's queue_round) 0 (no
   shares, the default) to RL_MAX_QUEUE_WEIGHT, the class's index 0 to RL_MAX_QUEUE_CLASS.
   0, or -1 with an exception. */
static int
parse_queue(PyObject *tenant, PyObject *numbers, rl_prepared *d)
{
    static const char *const names[RL_QUEUE_FIELDS] = {"wait ms", "max queue", "max tenant",
                                                       "weight", "class"};
    static const long long maxima[RL_QUEUE_FIELDS] = {RL_MAX_QUEUE_WAIT_MS, RL_MAX_QUEUE_LENGTH,
                                                      RL_MAX_QUEUE_LENGTH, RL_MAX_QUEUE_WEIGHT,
                                                      RL_MAX_QUEUE_CLASS};
    Py_ssize_t len, count;
    const char *text;
    if (!PyUnicode_Check(tenant)) {
        rl_type_error(tenant, "a wait queue's tenant must be a str, not ");
        return -1;
    }
    if ((text = PyUnicode_AsUTF8AndSize(tenant, &len)) == NULL)
        return -1;
    if (len < 1 || len > RL_TENANT_LEN || (Py_ssize_t)strspn(text, "0123456789abcdef") != len) {
        PyErr_Format(PyExc_ValueError, "a wait queue's tenant must be 1 to %d hex digits",
                     RL_TENANT_LEN);
        return -1;
    }
    memcpy(d->tenant, text, (size_t)len + 1);
    if (!PyTuple_Check(numbers) ||
        ((count = PyTuple_Size(numbers)) != RL_QUEUE_FIELDS && count != RL_QUEUE_FIELDS - 2)) {
        rl_type_error(numbers, "a wait queue's numbers must be a tuple of 3 or 5 ints, not ");
        return -1;
    }
    d->queue[RL_QUEUE_FIELDS - 2] = d->queue[RL_QUEUE_FIELDS - 1] = 0; /* no weight: step 1 */
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyTuple_GetItem(numbers, i);
        if ((i == 0 || i >= RL_QUEUE_FIELDS - 2
                 ? non_negative_int(item, names[i], maxima[i], &d->queue[i])
                 : positive_int(item, names[i], maxima[i], &d->queue[i])) < 0)
            return -1;
    }
    return 0;
}

/* reserve's in_flight=(limit, lease_seconds): the slot taken with the reservation, in the
   same script (lua/reserve_in_flight.lua). 0, or -1 with an exception. */
static int
parse_in_flight(PyObject *value, rl_prepared *d)
{
    long long seconds = 0;
    if (!PyTuple_Check(value) || PyTuple_Size(value) != 2) {
        rl_type_error(value, "in_flight must be a (limit, lease_seconds) tuple, not ");
        return -1;
    }
    if (positive_int(PyTuple_GetItem(value, 0), "in_flight's limit", RL_MAX_LIMIT,
                     &d->lease_limit) < 0 ||
        positive_int(PyTuple_GetItem(value, 1), "in_flight's lease_seconds", RL_MAX_WINDOW_SECONDS,
                     &seconds) < 0)
        return -1;
    d->lease_ms = seconds * 1000;
    d->script = RL_SCRIPT_IN_FLIGHT;
    return 0;
}

/* reset's SCAN cursor: None (start), or a str of 1 to 20 digits. */
static int
parse_cursor(PyObject *value, rl_prepared *d)
{
    Py_ssize_t len;
    const char *text;
    if (value == NULL || value == Py_None) {
        memcpy(d->cursor, "0", 2);
        return 0;
    }
    if (!PyUnicode_Check(value)) {
        rl_type_error(value, "cursor must be a str, not ");
        return -1;
    }
    text = PyUnicode_AsUTF8AndSize(value, &len);
    if (text == NULL)
        return -1;
    if (len < 1 || len > 20 || strspn(text, "0123456789") != (size_t)len) {
        PyErr_Format(PyExc_ValueError, "cursor must be a SCAN cursor (digits), got %R", value);
        return -1;
    }
    memcpy(d->cursor, text, (size_t)len + 1);
    return 0;
}

static int gcra_bucket(rl_prepared *d, long long rate, long long seconds, long long burst,
                       long long cost);

/* check_rate(user_id, rate, period_seconds, burst, *, cost=1): one GCRA decision. The
   windows hold its one bucket (limit: burst, seconds: the period, cost), read by the kill
   switch and the metrics as check's window; the emission interval period / rate is sent as
   interval / scale ms, both integers (lib/gcra.lua). 0, or -1 with an exception. */
static int
parse_gcra(PyObject *const *v, rl_prepared *d)
{
    long long rate, seconds, burst, cost = 1;
    if (positive_int(v[1], "rate", RL_MAX_LIMIT, &rate) < 0 ||
        positive_int(v[2], "period_seconds", RL_MAX_WINDOW_SECONDS, &seconds) < 0 ||
        positive_int(v[3], "burst", RL_MAX_LIMIT, &burst) < 0 ||
        (v[4] != NULL && positive_int(v[4], "cost", RL_MAX_LIMIT, &cost) < 0))
        return -1;
    d->windows.count = 0;
    return gcra_bucket(d, rate, seconds, burst, cost);
}

/* check_windows_detailed's gcra=(rate, period_seconds, burst): the bucket becomes window 0,
   before the logged windows (already parsed, with their cost), decided with them in one
   script (lua/gcra_windows.lua). 0, or -1 with an exception. */
static int
parse_gcra_windows(PyObject *value, PyObject *cost_value, rl_prepared *d)
{
    long long rate, seconds, burst, cost = 1;
    rl_windows *w = &d->windows;
    if (!PyTuple_Check(value) || PyTuple_Size(value) != 3) {
        rl_type_error(value, "gcra must be a (rate, period_seconds, burst) tuple, not ");
        return -1;
    }
    if (positive_int(PyTuple_GetItem(value, 0), "gcra's rate", RL_MAX_LIMIT, &rate) < 0 ||
        positive_int(PyTuple_GetItem(value, 1), "gcra's period_seconds", RL_MAX_WINDOW_SECONDS,
                     &seconds) < 0 ||
        positive_int(PyTuple_GetItem(value, 2), "gcra's burst", RL_MAX_LIMIT, &burst) < 0 ||
        (cost_value != NULL && positive_int(cost_value, "cost", RL_MAX_LIMIT, &cost) < 0))
        return -1;
    if (w->count >= RL_MAX_WINDOWS) {
        PyErr_Format(PyExc_ValueError,
                     "at most %d windows can be checked at once, the bucket "
                     "included, got %d",
                     RL_MAX_WINDOWS, w->count + 1);
        return -1;
    }
    for (int i = w->count; i > 0; i--) {
        w->seconds[i] = w->seconds[i - 1];
        w->limit[i] = w->limit[i - 1];
        w->cost[i] = w->cost[i - 1];
        w->tokens[i] = w->tokens[i - 1];
        w->scope[i] = w->scope[i - 1];
    }
    w->count++;
    if (gcra_bucket(d, rate, seconds, burst, cost) < 0)
        return -1;
    d->script = RL_SCRIPT_GCRA_WINDOWS;
    return 0;
}

/* Window 0 of d: a GCRA bucket of `rate` per `seconds`, `burst` at once, for a request of
   `cost` (d->windows.count already counts it). 0, or -1 with an exception. */
static int
gcra_bucket(rl_prepared *d, long long rate, long long seconds, long long burst, long long cost)
{
    rl_windows *w = &d->windows;
    if (cost > burst) {
        PyErr_Format(PyExc_ValueError,
                     "cost %lld can never be allowed: a burst of %lld admits at most %lld at once",
                     cost, burst, burst);
        return -1;
    }
    long long a = rate, b = seconds * 1000; /* gcd(rate, period_ms), Euclid */
    while (b != 0) {
        long long t = a % b;
        a = b;
        b = t;
    }
    d->gcra_scale = rate / a;
    d->gcra_units = seconds * 1000 / a;
    /* Every value the script computes stays under 2^53 (lib/gcra.lua): twice the bucket's
       depth burst * interval, and twice the scale, in units of 1/scale ms. */
    const long long room = (RL_MAX_LIMIT >> 1) - d->gcra_scale;
    if (room < 0 || burst > room / d->gcra_units) {
        PyErr_Format(PyExc_ValueError,
                     "rate %lld per %lld s with a burst of %lld is out of range: burst * period / "
                     "rate must stay below 2^52 units of 1/%lld ms (lower the burst)",
                     rate, seconds, burst, d->gcra_scale);
        return -1;
    }
    if (w->count == 0)
        w->count = 1;
    w->limit[0] = burst;
    w->seconds[0] = seconds;
    w->cost[0] = cost;
    w->tokens[0] = 0;
    w->scope[0] = 0;
    return 0;
}

/* _hold_budgets's budgets: a tuple of (owner, name, limit, amount, previous_start, start,
   end, next_end, thresholds) tuples (hold), or _settle_budgets's: of (owner, name, start,
   actual, limit, thresholds) (settle); thresholds: the soft limits packed (periods.py). genai_ratelimit/periods.py computes the periods; here they are checked to be
   in order, so the script only picks one. Tuples only: owners and names are borrowed
   (rl_budget). 0, or -1 with an exception. */
static int
add_budgets(rl_prepared *d, PyObject *budgets, int hold)
{
    static const char *const bound_names[] = {"previous_start", "start", "end", "next_end"};
    Py_ssize_t n, size = hold ? 9 : 6;
    if (!PyTuple_Check(budgets)) {
        rl_type_error(budgets, "budgets must be a tuple, not ");
        return -1;
    }
    n = PyTuple_Size(budgets);
    if (n < 1 || n > RL_MAX_BUDGETS) {
        PyErr_Format(PyExc_ValueError, "1 to %d budgets can be decided at once, got %zd",
                     RL_MAX_BUDGETS, n);
        return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *t = PyTuple_GetItem(budgets, k);
        rl_budget *b = &d->budgets[k];
        Py_ssize_t len;
        if (!PyTuple_Check(t) || PyTuple_Size(t) != size) {
            rl_type_error(t, "budgets[%zd] must be a tuple of %zd items, got ", k, size);
            return -1;
        }
        b->owner = rl_user_id_utf8(PyTuple_GetItem(t, 0), &len);
        if (b->owner == NULL)
            return -1;
        b->owner_len = (size_t)len;
        if (!PyUnicode_Check(PyTuple_GetItem(t, 1))) {
            rl_type_error(PyTuple_GetItem(t, 1), "a budget's name must be a str, not ");
            return -1;
        }
        b->name = PyUnicode_AsUTF8AndSize(PyTuple_GetItem(t, 1), &len);
        if (b->name == NULL)
            return -1;
        if (len == 0 || len > RL_MAX_SCOPE_NAME) {
            PyErr_Format(PyExc_ValueError,
                         "a budget's name must hold 1 to %d bytes of UTF-8, got %zd",
                         RL_MAX_SCOPE_NAME, len);
            return -1;
        }
        b->name_len = (size_t)len;
        d->nbudgets = (int)k + 1;
        if (!hold) {
            if (non_negative_int(PyTuple_GetItem(t, 2), "a budget's start", RL_MAX_UNIX_MS,
                                 &b->bounds[0]) < 0 ||
                non_negative_int(PyTuple_GetItem(t, 3), "actual", RL_MAX_LIMIT, &b->amount) < 0 ||
                positive_int(PyTuple_GetItem(t, 4), "a budget's limit", RL_MAX_LIMIT, &b->limit) <
                    0 ||
                non_negative_int(PyTuple_GetItem(t, 5), "thresholds", RL_MAX_THRESHOLDS,
                                 &b->thresholds) < 0)
                return -1;
            continue;
        }
        if (positive_int(PyTuple_GetItem(t, 2), "a budget's limit", RL_MAX_LIMIT, &b->limit) < 0 ||
            non_negative_int(PyTuple_GetItem(t, 3), "amount", RL_MAX_LIMIT, &b->amount) < 0 ||
            non_negative_int(PyTuple_GetItem(t, 8), "thresholds", RL_MAX_THRESHOLDS,
                             &b->thresholds) < 0)
            return -1;
        for (int j = 0; j < 4; j++) {
            if (non_negative_int(PyTuple_GetItem(t, 4 + j), bound_names[j], RL_MAX_UNIX_MS,
                                 &b->bounds[j]) < 0)
                return -1;
            if (j > 0 && b->bounds[j] <= b->bounds[j - 1]) {
                PyErr_Format(PyExc_ValueError, "budgets[%zd]: %s must come after %s", k,
                             bound_names[j], bound_names[j - 1]);
                return -1;
            }
        }
    }
    for (int k = 0; k < d->nbudgets; k++) { /* one key per budget and period */
        for (int j = 0; j < k; j++) {
            const rl_budget *a = &d->budgets[j], *b = &d->budgets[k];
            if (a->owner_len == b->owner_len && a->name_len == b->name_len &&
                memcmp(a->owner, b->owner, a->owner_len) == 0 &&
                memcmp(a->name, b->name, a->name_len) == 0) {
                PyErr_Format(PyExc_ValueError, "budget %R of %R appears twice",
                             PyTuple_GetItem(PyTuple_GetItem(budgets, k), 1),
                             PyTuple_GetItem(PyTuple_GetItem(budgets, k), 0));
                return -1;
            }
        }
    }
    return 0;
}

int
rl_parse_request(rl_shape shape, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                 rl_prepared *d, PyObject **user_id)
{
    static const char *const check_names[] = {"user_id", "limit", "window_seconds", "cost"};
    static const char *const windows_names[] = {"user_id", "windows", "cost", "gcra"};
    static const char *const reserve_names[] = {"user_id", "windows", "cost",      "token_windows",
                                                "tokens",  "scopes",  "in_flight", "shares",
                                                "ticket",  "probe"};
    static const char *const reconcile_names[] = {"user_id", "windows", "member", "timestamp_ms",
                                                  "cost",    "tokens",  "scopes", "tie",
                                                  "release", "shares"};
    static const char *const reset_names[] = {"user_id", "windows", "token_windows", "cursor"};
    static const char *const acquire_names[] = {"user_id", "limit", "lease_seconds", "shares",
                                                "ticket"};
    static const char *const release_names[] = {"user_id", "lease_id"};
    static const char *const renew_names[] = {"user_id", "lease_id", "lease_seconds"};
    static const char *const gcra_names[] = {"user_id", "rate", "period_seconds", "burst", "cost"};
    static const char *const hold_names[] = {"user_id", "budgets", "hold_ms"};
    static const char *const settle_names[] = {"user_id", "budgets", "hold_id"};
    static const char *const observe_names[] = {"name", "observation"};
    static const char *const queue_names[] = {"name", "ticket", "tenant", "numbers", "leases"};
    static const rl_script_id scripts[] = {
        [RL_SHAPE_CHECK] = RL_SCRIPT_WINDOW,
        [RL_SHAPE_WINDOWS] = RL_SCRIPT_WINDOW,
        [RL_SHAPE_RESERVE] = RL_SCRIPT_WINDOW,
        [RL_SHAPE_RECONCILE] = RL_SCRIPT_RECONCILE,
        [RL_SHAPE_PEEK] = RL_SCRIPT_PEEK,
        [RL_SHAPE_RESET] = RL_SCRIPT_RESET,
        [RL_SHAPE_DETAILED] = RL_SCRIPT_WINDOW,
        [RL_SHAPE_ACQUIRE] = RL_SCRIPT_LEASE,
        [RL_SHAPE_RELEASE] = RL_SCRIPT_LEASE,
        [RL_SHAPE_RENEW] = RL_SCRIPT_LEASE,
        [RL_SHAPE_GCRA] = RL_SCRIPT_GCRA,
        [RL_SHAPE_BUDGET_HOLD] = RL_SCRIPT_BUDGET_HOLD,
        [RL_SHAPE_BUDGET_SETTLE] = RL_SCRIPT_BUDGET_SETTLE,
        [RL_SHAPE_OBSERVE] = RL_SCRIPT_OBSERVE,
        [RL_SHAPE_QUEUE] = RL_SCRIPT_QUEUE,
    };
    PyObject *v[10] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    Py_ssize_t unused;
    long long seconds = 0;

    d->shape = shape;
    d->shares = NULL;
    d->shares_len = 0;
    d->probe = NULL;
    d->probe_len = 0;
    d->script = scripts[shape];
    d->windows.count = 0;
    d->nscopes = 0;
    d->member[0] = '\0';
    d->member_given = 0;
    d->queue_leases = 0;
    d->score_ms = 0;
    d->new_cost = 0;
    d->tie = 0;
    d->hash_tag = 0;              /* the limiter sets it after parsing, in cluster mode */
    d->storage = RL_STORAGE_ZSET; /* and this, for a limiter of the compact storage */
    d->scan = 0;
    d->cursor[0] = '\0';
    d->lease_limit = 0;
    d->lease_ms = 0;
    d->gcra_units = 0;
    d->gcra_scale = 0;
    d->nbudgets = 0;
    d->hold_ms = 0;
    for (int i = 0; i < RL_UPSTREAM_FIELDS; i++)
        d->upstream[i] = -1;
    switch (shape) {
    case RL_SHAPE_BUDGET_HOLD:
        if (rl_parse_args("_hold_budgets", args, nargs, kwnames, hold_names, 3, 3, 3, v) < 0 ||
            rl_user_id_utf8(v[0], &unused) == NULL || add_budgets(d, v[1], 1) < 0 ||
            non_negative_int(v[2], "hold_ms", RL_MAX_UNIX_MS, &d->hold_ms) < 0)
            return -1;
        break;
    case RL_SHAPE_BUDGET_SETTLE:
        if (rl_parse_args("_settle_budgets", args, nargs, kwnames, settle_names, 3, 3, 3, v) < 0 ||
            rl_user_id_utf8(v[0], &unused) == NULL || add_budgets(d, v[1], 0) < 0 ||
            parse_member(v[2], "hold's", d->member) < 0)
            return -1;
        break;
    case RL_SHAPE_QUEUE:
        if (rl_parse_args("_wait_queue", args, nargs, kwnames, queue_names, 5, 4, 4, v) < 0 ||
            rl_user_id_utf8(v[0], &unused) == NULL ||
            parse_member(v[1], "ticket's", d->member) < 0 || parse_queue(v[2], v[3], d) < 0)
            return -1;
        if (v[4] != NULL && (d->queue_leases = PyObject_IsTrue(v[4])) < 0)
            return -1;
        if (unused > RL_MAX_SCOPE_NAME) {
            PyErr_Format(PyExc_ValueError, "an upstream's name holds 1 to %d bytes of UTF-8",
                         RL_MAX_SCOPE_NAME);
            return -1;
        }
        break;
    case RL_SHAPE_OBSERVE:
        if (rl_parse_args("observe_upstream", args, nargs, kwnames, observe_names, 2, 2, 2, v) <
                0 ||
            rl_user_id_utf8(v[0], &unused) == NULL || parse_upstream(v[1], d) < 0)
            return -1;
        if (unused > RL_MAX_SCOPE_NAME) {
            PyErr_Format(PyExc_ValueError, "an upstream's name holds 1 to %d bytes of UTF-8",
                         RL_MAX_SCOPE_NAME);
            return -1;
        }
        break;
    case RL_SHAPE_GCRA:
        if (rl_parse_args("check_rate", args, nargs, kwnames, gcra_names, 5, 4, 4, v) < 0 ||
            rl_user_id_utf8(v[0], &unused) == NULL || parse_gcra(v, d) < 0)
            return -1;
        break;
    case RL_SHAPE_ACQUIRE:
        if (rl_parse_args("acquire", args, nargs, kwnames, acquire_names, 5, 4, 3, v) < 0 ||
            rl_user_id_utf8(v[0], &unused) == NULL ||
            positive_int(v[1], "limit", RL_MAX_LIMIT, &d->lease_limit) < 0 ||
            positive_int(v[2], "lease_seconds", RL_MAX_WINDOW_SECONDS, &seconds) < 0 ||
            (v[3] != NULL && parse_shares(v[3], d, 'L') < 0)) /* lua/lib/shares.lua's */
            return -1;
        d->lease_ms = seconds * 1000;
        if (v[4] != NULL && v[4] != Py_None) { /* the in-flight queue's ticket is the lease id */
            if (parse_member(v[4], "ticket's", d->member) < 0)
                return -1;
            d->member_given = 1;
        }
        break;
    case RL_SHAPE_RELEASE:
        if (rl_parse_args("release", args, nargs, kwnames, release_names, 2, 2, 2, v) < 0 ||
            rl_user_id_utf8(v[0], &unused) == NULL || parse_member(v[1], "lease's", d->member) < 0)
            return -1;
        break;
    case RL_SHAPE_RENEW:
        if (rl_parse_args("renew", args, nargs, kwnames, renew_names, 3, 3, 3, v) < 0 ||
            rl_user_id_utf8(v[0], &unused) == NULL ||
            parse_member(v[1], "lease's", d->member) < 0 ||
            positive_int(v[2], "lease_seconds", RL_MAX_WINDOW_SECONDS, &seconds) < 0)
            return -1;
        d->lease_ms = seconds * 1000;
        break;
    case RL_SHAPE_CHECK:
        if (rl_parse_args("check", args, nargs, kwnames, check_names, 4, 3, 3, v) < 0 ||
            rl_user_id_utf8(v[0], &unused) == NULL ||
            add_window(&d->windows, v[1], v[2], 0, 0) < 0 || set_cost(d, v[3], "cost", 0) < 0)
            return -1;
        break;
    case RL_SHAPE_WINDOWS:
    case RL_SHAPE_DETAILED:
        if (rl_parse_args(shape == RL_SHAPE_WINDOWS ? "check_windows" : "check_windows_detailed",
                          args, nargs, kwnames, windows_names, shape == RL_SHAPE_WINDOWS ? 3 : 4, 2,
                          2, v) < 0 ||
            rl_user_id_utf8(v[0], &unused) == NULL ||
            add_windows(&d->windows, v[1], "windows", 0, v[3] != NULL && v[3] != Py_None, 0) < 0 ||
            set_cost(d, v[2], "cost", 0) < 0 ||
            (v[3] != NULL && v[3] != Py_None && parse_gcra_windows(v[3], v[2], d) < 0))
            return -1;
        break;
    case RL_SHAPE_RESERVE:
    case RL_SHAPE_PEEK: /* answers what reserve would, with the same arguments */
        if (rl_parse_args(shape == RL_SHAPE_PEEK ? "peek" : "reserve", args, nargs, kwnames,
                          reserve_names, shape == RL_SHAPE_PEEK ? 6 : 10, 2, 2, v) < 0 ||
            rl_user_id_utf8(v[0], &unused) == NULL ||
            add_windows(&d->windows, v[1], "windows", 0, 1, 0) < 0 ||
            (v[3] != NULL && add_windows(&d->windows, v[3], "token_windows", 1, 1, 0) < 0) ||
            (v[5] != NULL && add_scopes(d, v[5], -1) < 0) || set_cost(d, v[2], "cost", 0) < 0)
            return -1;
        if (d->windows.count == 0) {
            PyErr_Format(PyExc_ValueError, "%s needs at least one window or token window",
                         shape == RL_SHAPE_PEEK ? "peek" : "reserve");
            return -1;
        }
        if (has_token_windows(&d->windows) != (v[4] != NULL)) {
            PyErr_SetString(PyExc_ValueError,
                            v[4] == NULL ? "token_windows need tokens= (the estimated tokens)"
                                         : "tokens= needs token_windows to count them in");
            return -1;
        }
        if (set_cost(d, v[4], "tokens", 1) < 0 || (v[6] != NULL && parse_in_flight(v[6], d) < 0) ||
            (v[7] != NULL && parse_shares(v[7], d, 'S') < 0) ||
            (v[9] != NULL && parse_probe(v[9], d) < 0))
            return -1;
        if (v[8] != NULL && v[8] != Py_None) { /* the wait queue's ticket is the member */
            if (parse_member(v[8], "ticket's", d->member) < 0)
                return -1;
            d->member_given = 1;
        }
        break;
    case RL_SHAPE_RECONCILE:
        if (rl_parse_args("reconcile", args, nargs, kwnames, reconcile_names, 10, 5, 5, v) < 0 ||
            rl_user_id_utf8(v[0], &unused) == NULL)
            return -1;
        int tokens = v[5] != NULL ? PyObject_IsTrue(v[5]) : 0;
        if (tokens < 0 || add_windows(&d->windows, v[1], "windows", tokens, v[6] != NULL, 0) < 0 ||
            (v[6] != NULL && add_scopes(d, v[6], tokens) < 0) ||
            parse_member(v[2], "reservation's", d->member) < 0 ||
            positive_int(v[3], "timestamp_ms", RL_MAX_LIMIT, &d->score_ms) < 0 ||
            non_negative_int(v[4], "cost", RL_MAX_LIMIT, &d->new_cost) < 0 ||
            (v[7] != NULL && non_negative_int(v[7], "tie", RL_MAX_TIE, &d->tie) < 0) ||
            (v[9] != NULL && parse_shares(v[9], d, 'C') < 0))
            return -1;
        if (v[8] != NULL) {
            int release = PyObject_IsTrue(v[8]);
            if (release < 0)
                return -1;
            if (release)
                d->script = RL_SCRIPT_RECONCILE_RELEASE; /* the lease id is the member */
        }
        if (d->windows.count == 0) {
            PyErr_SetString(PyExc_ValueError, "reconcile needs at least one window");
            return -1;
        }
        break;
    case RL_SHAPE_RESET:
        if (rl_parse_args("reset", args, nargs, kwnames, reset_names, 4, 2, 1, v) < 0 ||
            rl_user_id_utf8(v[0], &unused) == NULL || parse_cursor(v[3], d) < 0)
            return -1;
        if ((v[1] == NULL || v[1] == Py_None) && (v[2] == NULL || v[2] == Py_None)) {
            d->scan = 1; /* every window of the user */
            break;
        }
        if (v[3] != NULL && v[3] != Py_None) {
            PyErr_SetString(PyExc_ValueError, "cursor= goes with windows=None only");
            return -1;
        }
        if ((v[1] != NULL && v[1] != Py_None &&
             add_windows(&d->windows, v[1], "windows", 0, 1, 0) < 0) ||
            (v[2] != NULL && v[2] != Py_None &&
             add_windows(&d->windows, v[2], "token_windows", 1, 1, 0) < 0))
            return -1;
        break;
    }
    *user_id = v[0];
    return 0;
}

const char *
rl_user_id_utf8(PyObject *user_id, Py_ssize_t *len)
{
    const char *text;
    if (!PyUnicode_Check(user_id)) {
        rl_type_error(user_id, "user_id must be a str, not ");
        return NULL;
    }
    if (PyUnicode_GetLength(user_id) == 0) {
        PyErr_SetString(PyExc_ValueError, "user_id must not be empty");
        return NULL;
    }
    /* Raises UnicodeEncodeError (a ValueError) for lone surrogates: such a str has no
       UTF-8 form, and a lossy one could make two users share a key. */
    text = PyUnicode_AsUTF8AndSize(user_id, len);
    return text;
}

/* True when RATE_LIMIT_DISABLED is true, 1, yes or on (any case, spaces ignored). */
static int
kill_switch_on(void)
{
    static const char *const truthy[] = {"true", "1", "yes", "on"};
    const char *v = getenv("RATE_LIMIT_DISABLED");
    size_t n;
    if (v == NULL)
        return 0;
    while (isspace((unsigned char)*v))
        v++;
    n = strlen(v);
    while (n > 0 && isspace((unsigned char)v[n - 1]))
        n--;
    for (size_t i = 0; i < sizeof(truthy) / sizeof(truthy[0]); i++) {
        if (n == strlen(truthy[i]) && strncasecmp(v, truthy[i], n) == 0)
            return 1;
    }
    return 0;
}

static int
warn_kill_switch(rl_module_state *state)
{
    if (state->kill_switch_warned)
        return 0;
    state->kill_switch_warned = 1;
    return rl_log_warning("RATE_LIMIT_DISABLED is on: every rate-limit check is allowed "
                          "and none is sent to Redis (releases, renewals, reconciles and "
                          "resets still are)");
}

int
rl_log_warning(const char *message)
{
    PyObject *logging, *logger, *res;
    logging = PyImport_ImportModule("logging");
    if (logging == NULL)
        return -1;
    logger = PyObject_CallMethod(logging, "getLogger", "s", "genai_ratelimit");
    Py_DECREF(logging);
    if (logger == NULL)
        return -1;
    /* "%s": the message is data, never a format string. */
    res = PyObject_CallMethod(logger, "warning", "ss", "%s", message);
    Py_DECREF(logger);
    if (res == NULL)
        return -1;
    Py_DECREF(res);
    return 0;
}

/* The scope names are borrowed: once the command holds them they are dropped, so no later
   step (the asyncio Request keeps its rl_prepared) can read a name its str no longer backs. */
static void
forget_scope_names(rl_prepared *p)
{
    for (int k = 0; k < p->nscopes; k++) {
        p->scopes[k].name = NULL;
        p->scopes[k].name_len = 0;
    }
    p->shares = NULL; /* shares_len stays: the reply has one element more (script.c) */
    p->probe = NULL;
    p->probe_len = 0;
    for (int k = 0; k < p->nbudgets; k++) {
        p->budgets[k].owner = p->budgets[k].name = NULL;
        p->budgets[k].owner_len = p->budgets[k].name_len = 0;
    }
}

/* Cluster mode: the one hash slot of d's keys, into d->slot. A window's keys carry its
   owner in their hash tag: the user, or a shared scope's name (write_user_key). One script
   reaches one slot, so a decision whose owners hash to different slots is refused before
   any I/O. 0, or -1 with an exception. */
static int
cluster_slot(rl_prepared *d, const char *user, size_t user_len)
{
    int user_slot = rl_user_slot(user, user_len);
    d->slot = user_slot;
    for (int i = 0; i < d->windows.count && user_slot >= 0; i++) {
        const rl_scope *scope = d->windows.scope[i] ? &d->scopes[d->windows.scope[i] - 1] : NULL;
        int slot =
            scope != NULL && scope->shared ? rl_user_slot(scope->name, scope->name_len) : user_slot;
        if (slot < 0) { /* no memory for a long name's tag */
            d->slot = -1;
            break;
        }
        if (i == 0) {
            d->slot = slot;
        } else if (slot != d->slot) {
            PyErr_SetString(PyExc_ValueError,
                            "on a Redis Cluster one decision's keys must share a hash slot: a "
                            "shared scope's windows cannot be decided with the user's own or "
                            "another shared scope's (their keys live in different slots)");
            return -1;
        }
    }
    for (int k = 0; k < d->nbudgets && d->slot >= 0; k++) {
        int slot = rl_user_slot(d->budgets[k].owner, d->budgets[k].owner_len);
        if (slot >= 0 && slot != d->slot) {
            PyErr_SetString(PyExc_ValueError,
                            "on a Redis Cluster one hold's budgets must share a hash slot: "
                            "budgets of owners whose keys live in different slots cannot be "
                            "held in one script (hold them in one owner's keys, or apart)");
            return -1;
        }
        if (slot < 0)
            d->slot = -1;
    }
    if (user_slot < 0 || d->slot < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

int
rl_prepare(rl_module_state *state, const char *prefix, size_t prefix_len, int client_clock,
           PyObject *user_id, rl_prepared *out)
{
    Py_ssize_t user_len;
    const char *user;

    out->command = NULL;
    out->command_len = 0;
    out->replay = NULL;
    out->replay_len = 0;
    out->deadline = 0;
    out->disabled = 0;
    out->slot = -1;
    user = rl_user_id_utf8(user_id, &user_len);
    if (user == NULL)
        return -1;
    if (out->hash_tag && cluster_slot(out, user, (size_t)user_len) < 0)
        return -1;
    /* The switch answers new decisions only. What Redis already holds (a lease, a logged
       entry, a window) is always given back, renewed, corrected or forgotten there: a
       release skipped while the switch is on would keep the slot until its lease expired,
       and refuse the user once the switch went off. */
    int disabled = out->shape != RL_SHAPE_RECONCILE && out->shape != RL_SHAPE_RESET &&
                   out->shape != RL_SHAPE_RELEASE && out->shape != RL_SHAPE_RENEW &&
                   out->shape != RL_SHAPE_BUDGET_SETTLE && out->shape != RL_SHAPE_QUEUE &&
                   kill_switch_on();
    if (disabled && out->shape == RL_SHAPE_BUDGET_HOLD) {
        /* Allowed and nothing held: the hold has no id, so its settle sends nothing
           (periods.py); each budget's remaining is its limit, in the period the client's
           clock falls in. */
        rl_result *r = &out->result;
        memset(r, 0, sizeof(*r));
        out->disabled = 1;
        out->member[0] = '\0';
        r->allowed = 1;
        r->window = -1;
        r->now_ms = rl_clock_ms();
        for (int k = 0; k < out->nbudgets; k++) {
            r->remaining_of[k] = out->budgets[k].limit;
            r->start_of[k] = out->budgets[k].bounds[1];
            r->end_of[k] = out->budgets[k].bounds[2];
        }
        forget_scope_names(out);
        return warn_kill_switch(state);
    }
    if (disabled && out->shape == RL_SHAPE_ACQUIRE) {
        /* The lease is granted and nothing is held: it has no id, so its release and renew
           send nothing (lease.py). */
        memset(&out->result, 0, sizeof(out->result));
        out->disabled = 1;
        out->result.allowed = 1;
        out->result.now_ms = rl_clock_ms();
        out->result.expires_ms = out->result.now_ms + out->lease_ms;
        out->member[0] = '\0';
        return warn_kill_switch(state);
    }
    if (disabled) {
        /* The tightest window is the one with the smallest limit (ties: the shorter). Nothing
           is logged, so a reservation has no member and its reconcile sends nothing. */
        rl_result *r = &out->result;
        int best = 0;
        if (out->windows.count == 0) /* e.g. reserve(user, (), in_flight=...): no window */
            out->windows.limit[0] = out->windows.seconds[0] = 0;
        for (int i = 0; i < out->windows.count; i++) {
            r->remaining_of[i] = out->windows.limit[i];
            if (out->windows.limit[i] < out->windows.limit[best])
                best = i;
        }
        out->disabled = 1;
        if (out->script == RL_SCRIPT_WINDOW || out->script == RL_SCRIPT_IN_FLIGHT ||
            out->script == RL_SCRIPT_GCRA_WINDOWS)
            out->member[0] = '\0';
        r->allowed = 1;
        r->remaining = out->windows.limit[best];
        r->retry_after_s = 0;
        r->retry_after_ms = 0;
        r->window = best;
        r->now_ms = rl_clock_ms();
        r->evaluated = out->windows.count;
        r->found = 0;
        r->expires_ms = 0;
        r->tie = 0;
        /* An in-flight slot is granted and nothing is held (acquire's answer): no lease id. */
        r->slot = out->script == RL_SCRIPT_IN_FLIGHT ? 1 : out->shape == RL_SHAPE_RESERVE ? -1 : 0;
        r->slot_held = 0;
        r->slot_retry_ms = 0;
        r->retry_bound_ms = 0;
        if (r->slot == 1)
            r->expires_ms = r->now_ms + out->lease_ms;
        for (int i = 0; i < out->windows.count; i++) {
            r->used_of[i] = 0;
            r->oldest_of[i] = -1;
        }
        forget_scope_names(out);
        return warn_kill_switch(state);
    }
    if ((out->script == RL_SCRIPT_WINDOW || out->script == RL_SCRIPT_IN_FLIGHT ||
         out->script == RL_SCRIPT_GCRA_WINDOWS || out->shape == RL_SHAPE_ACQUIRE ||
         out->shape == RL_SHAPE_BUDGET_HOLD) &&
        !out->member_given && rl_member_uuid4(state->random, out->member) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    out->script = rl_script_of(out->script, out->storage);
    long long now_ms = -1; /* the server's clock */
    if (client_clock)
        now_ms = state->client_clock_ms >= 0 ? state->client_clock_ms : rl_clock_ms();
    out->command_len =
        rl_script_format(prefix, prefix_len, user, (size_t)user_len, out, now_ms, &out->command);
    forget_scope_names(out);
    if (out->command_len < 0) {
        out->command = NULL;
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

void
rl_prepared_clear(rl_prepared *p)
{
    if (p->command != NULL) {
        redisFreeCommand(p->command);
        p->command = NULL;
    }
    free(p->replay);
    p->replay = NULL;
}

PyObject *
rl_set_client_clock(PyObject *module, PyObject *ms)
{
    rl_module_state *state = PyModule_GetState(module);
    long long value = -1;
    if (state == NULL)
        return NULL;
    if (ms != Py_None && positive_int(ms, "ms", RL_MAX_LIMIT, &value) < 0)
        return NULL;
    state->client_clock_ms = value;
    Py_RETURN_NONE;
}

int
rl_parse_storage(const char *name, rl_storage *out)
{
    if (name == NULL || strcmp(name, "zset") == 0) {
        *out = RL_STORAGE_ZSET;
        return 0;
    }
    if (strcmp(name, "compact") == 0) {
        *out = RL_STORAGE_COMPACT;
        return 0;
    }
    PyErr_Format(PyExc_ValueError, "storage must be 'zset' or 'compact', got '%.100s'", name);
    return -1;
}

int
rl_check_key_prefix(Py_ssize_t len)
{
    if (len > 0)
        return 0;
    PyErr_SetString(PyExc_ValueError, "key_prefix must not be empty");
    return -1;
}

/* ValueError "name must be between low and high, got value" unless it is. */
static int
check_range(const char *name, long long value, long long low, long long high)
{
    if (value >= low && value <= high)
        return 0;
    PyErr_Format(PyExc_ValueError, "%s must be between %lld and %lld, got %lld", name, low, high,
                 value);
    return -1;
}

int
rl_check_limiter_values(double connect_timeout, double socket_timeout, Py_ssize_t key_prefix_len,
                        long long max_connections, long long min_replicas,
                        long long replica_timeout_ms)
{
    if (rl_check_timeout("connect_timeout", connect_timeout) < 0 ||
        rl_check_timeout("socket_timeout", socket_timeout) < 0 ||
        rl_check_key_prefix(key_prefix_len) < 0 ||
        check_range("max_connections", max_connections, 1, RL_MAX_CONNECTIONS) < 0 ||
        check_range("min_replicas", min_replicas, 0, RL_MAX_REPLICAS) < 0 ||
        check_range("replica_timeout_ms", replica_timeout_ms, 1, RL_MAX_REPLICA_TIMEOUT_MS) < 0)
        return -1;
    return 0;
}

/* A number of seconds (int or float, not bool) into *out; an int too large for a double
   is +inf (refused by the range check). 0, or -1 with TypeError. */
static int
seconds_of(PyObject *value, const char *name, double *out)
{
    if (PyBool_Check(value) || !(PyLong_Check(value) || PyFloat_Check(value))) {
        rl_type_error(value, "%s must be a number of seconds, not ", name);
        return -1;
    }
    *out = PyFloat_AsDouble(value);
    if (*out == -1.0 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
        *out = PyObject_RichCompareBool(value, Py_False, Py_GT) == 1 ? Py_HUGE_VAL : -Py_HUGE_VAL;
        PyErr_Clear();
    }
    return 0;
}

/* An int option (not bool) into *out. 0, or -1 with TypeError, or with check_range's
   ValueError for one beyond the long long range (low..high: the option's range). */
static int
int_option_of(PyObject *value, const char *name, long long low, long long high, long long *out)
{
    int overflow = 0;
    if (PyBool_Check(value) || !PyLong_Check(value)) {
        rl_type_error(value, "%s must be an int, not ", name);
        return -1;
    }
    *out = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (*out == -1 && PyErr_Occurred())
        return -1;
    if (overflow != 0) {
        PyErr_Format(PyExc_ValueError, "%s must be between %lld and %lld, got %S", name, low, high,
                     value);
        return -1;
    }
    return 0;
}

PyObject *
rl_check_options(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {
        "key_prefix", "clock",        "connect_timeout",    "socket_timeout", "max_connections",
        "storage",    "min_replicas", "replica_timeout_ms", "hash_tag",       NULL};
    PyObject *prefix, *clock, *connect, *socket, *connections, *storage, *replicas, *wait_ms;
    int hash_tag = 0;
    double connect_timeout, socket_timeout;
    long long max_connections, min_replicas, replica_timeout_ms;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOOO|p", keywords, &prefix, &clock,
                                     &connect, &socket, &connections, &storage, &replicas, &wait_ms,
                                     &hash_tag))
        return NULL;
    if (!PyUnicode_Check(prefix))
        return rl_type_error(prefix, "key_prefix must be a str, not ");
    if (rl_check_key_prefix(PyUnicode_GetLength(prefix)) < 0)
        return NULL;
    if (hash_tag) {
        /* Cluster: the user id's hash tag follows the prefix; a brace in it would move it. */
        for (int i = 0; i < 2; i++) {
            PyObject *brace = PyUnicode_FromString(i == 0 ? "{" : "}");
            int found = brace != NULL ? PySequence_Contains(prefix, brace) : -1;
            Py_XDECREF(brace);
            if (found < 0)
                return NULL;
            if (found) {
                PyErr_SetString(PyExc_ValueError,
                                "key_prefix must not contain '{' or '}' with a Redis Cluster "
                                "URL: the user id's hash tag follows the prefix");
                return NULL;
            }
        }
    }
    if (!PyUnicode_Check(clock) || (PyUnicode_CompareWithASCIIString(clock, "server") != 0 &&
                                    PyUnicode_CompareWithASCIIString(clock, "client") != 0)) {
        PyErr_Format(PyExc_ValueError, "clock must be 'server' or 'client', got %R", clock);
        return NULL;
    }
    if (storage != Py_None) {
        rl_storage parsed;
        const char *name = PyUnicode_Check(storage) ? PyUnicode_AsUTF8AndSize(storage, NULL) : NULL;
        if (name == NULL) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "storage must be 'zset' or 'compact', got %R", storage);
            return NULL;
        }
        if (rl_parse_storage(name, &parsed) < 0)
            return NULL;
    }
    if (seconds_of(connect, "connect_timeout", &connect_timeout) < 0 ||
        seconds_of(socket, "socket_timeout", &socket_timeout) < 0 ||
        int_option_of(connections, "max_connections", 1, RL_MAX_CONNECTIONS, &max_connections) <
            0 ||
        int_option_of(replicas, "min_replicas", 0, RL_MAX_REPLICAS, &min_replicas) < 0 ||
        int_option_of(wait_ms, "replica_timeout_ms", 1, RL_MAX_REPLICA_TIMEOUT_MS,
                      &replica_timeout_ms) < 0)
        return NULL;
    if (rl_check_limiter_values(connect_timeout, socket_timeout, PyUnicode_GetLength(prefix),
                                max_connections, min_replicas, replica_timeout_ms) < 0)
        return NULL;
    Py_RETURN_NONE;
}

int
rl_check_timeout(const char *name, double seconds)
{
    if (!(seconds > 0) || !(seconds <= RL_MAX_TIMEOUT_SECONDS)) {
        /* NaN fails both comparisons; inf and huge values fail the second. */
        char shown[64];
        PyOS_snprintf(shown, sizeof(shown), "%g", seconds);
        PyErr_Format(PyExc_ValueError,
                     "%s must be a positive number of seconds, at most %d "
                     "(one day), got %s",
                     name, (int)RL_MAX_TIMEOUT_SECONDS, shown);
        return -1;
    }
    return 0;
}

/* Matches vectorcall arguments to names. Fills out[] with borrowed references. */
int
rl_parse_args(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
              const char *const *names, int n, int positional, int required, PyObject **out)
{
    for (int i = 0; i < n; i++)
        out[i] = NULL;
    if (nargs > positional) {
        PyErr_Format(PyExc_TypeError, "%s() takes %d positional arguments (%zd given)", fname,
                     positional, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        out[i] = args[i];
    if (kwnames != NULL) {
        Py_ssize_t nkw = PyTuple_Size(kwnames);
        for (Py_ssize_t k = 0; k < nkw; k++) {
            PyObject *key = PyTuple_GetItem(kwnames, k);
            int found = -1;
            for (int i = 0; i < n; i++) {
                if (PyUnicode_CompareWithASCIIString(key, names[i]) == 0) {
                    found = i;
                    break;
                }
            }
            if (found < 0) {
                PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%S'", fname,
                             key);
                return -1;
            }
            if (out[found] != NULL) {
                PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fname,
                             names[found]);
                return -1;
            }
            out[found] = args[nargs + k];
        }
    }
    for (int i = 0; i < required; i++) {
        if (out[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fname, names[i]);
            return -1;
        }
    }
    return 0;
}
