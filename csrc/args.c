/*
 * args.c - everything a decision needs before any I/O: argument validation, the kill
 * switch, the member, the clock and the formatted EVALSHA; and the result tuples after.
 * Shared by the blocking limiter (limiter.c) and the asyncio codec (codec.c), so both
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
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", name,
                     Py_TYPE(value)->tp_name);
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
add_window(rl_windows *w, PyObject *limit, PyObject *seconds)
{
    long long l, s;
    if (w->count >= RL_MAX_WINDOWS) {
        PyErr_Format(PyExc_ValueError, "at most %d windows can be checked at once", RL_MAX_WINDOWS);
        return -1;
    }
    if (positive_int(limit, "limit", RL_MAX_LIMIT, &l) < 0 ||
        positive_int(seconds, "window_seconds", RL_MAX_WINDOW_SECONDS, &s) < 0)
        return -1;
    /* Insert keeping the windows sorted, shortest first (stable for equal lengths). */
    int i = w->count;
    while (i > 0 && w->seconds[i - 1] > s) {
        w->seconds[i] = w->seconds[i - 1];
        w->limit[i] = w->limit[i - 1];
        i--;
    }
    if (i > 0 && w->seconds[i - 1] == s) {
        PyErr_Format(PyExc_ValueError,
                     "window_seconds %lld appears twice: each window needs its own length", s);
        /* Undo the shift so the struct stays consistent for the caller. */
        for (int j = i; j < w->count; j++) {
            w->seconds[j] = w->seconds[j + 1];
            w->limit[j] = w->limit[j + 1];
        }
        return -1;
    }
    w->seconds[i] = s;
    w->limit[i] = l;
    w->count++;
    return 0;
}

int
rl_windows_from_pair(rl_windows *w, PyObject *limit, PyObject *seconds)
{
    w->count = 0;
    return add_window(w, limit, seconds);
}

int
rl_windows_from_sequence(rl_windows *w, PyObject *windows)
{
    PyObject *seq;
    Py_ssize_t n;
    int rc = -1;
    w->count = 0;
    if (PyUnicode_Check(windows) || PyBytes_Check(windows) || PyByteArray_Check(windows) ||
        !PySequence_Check(windows)) {
        PyErr_Format(PyExc_TypeError,
                     "windows must be a sequence of (limit, window_seconds) pairs, not %.100s",
                     Py_TYPE(windows)->tp_name);
        return -1;
    }
    seq = PySequence_Fast(windows, "windows must be a sequence of (limit, window_seconds) pairs");
    if (seq == NULL)
        return -1;
    n = PySequence_Fast_GET_SIZE(seq);
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError,
                        "windows must hold at least one (limit, window_seconds) pair");
        goto done;
    }
    if (n > RL_MAX_WINDOWS) {
        PyErr_Format(PyExc_ValueError, "at most %d windows can be checked at once, got %zd",
                     RL_MAX_WINDOWS, n);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(seq, i); /* borrowed */
        if (!(PyTuple_Check(pair) || PyList_Check(pair)) || PySequence_Fast_GET_SIZE(pair) != 2) {
            PyErr_Format(PyExc_TypeError,
                         "windows[%zd] must be a (limit, window_seconds) pair, got %.100s", i,
                         Py_TYPE(pair)->tp_name);
            goto done;
        }
        if (add_window(w, PySequence_Fast_GET_ITEM(pair, 0), PySequence_Fast_GET_ITEM(pair, 1)) < 0)
            goto done;
    }
    rc = 0;
done:
    Py_DECREF(seq);
    return rc;
}

const char *
rl_user_id_utf8(PyObject *user_id, Py_ssize_t *len)
{
    const char *text;
    if (!PyUnicode_Check(user_id)) {
        PyErr_Format(PyExc_TypeError, "user_id must be a str, not %.100s",
                     Py_TYPE(user_id)->tp_name);
        return NULL;
    }
    if (PyUnicode_GET_LENGTH(user_id) == 0) {
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
                          "and nothing is sent to Redis");
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

int
rl_prepare(rl_module_state *state, const char *prefix, size_t prefix_len, int client_clock,
           PyObject *user_id, rl_prepared *out)
{
    Py_ssize_t user_len;
    const char *user;
    char member[RL_MEMBER_LEN + 1];

    out->command = NULL;
    out->command_len = 0;
    out->replay = NULL;
    out->replay_len = 0;
    out->deadline = 0;
    out->disabled = 0;
    user = rl_user_id_utf8(user_id, &user_len);
    if (user == NULL)
        return -1;
    if (kill_switch_on()) {
        /* The tightest window is the one with the smallest limit (ties: the shorter). */
        int best = 0;
        for (int i = 1; i < out->windows.count; i++) {
            if (out->windows.limit[i] < out->windows.limit[best])
                best = i;
        }
        out->disabled = 1;
        out->result.allowed = 1;
        out->result.remaining = out->windows.limit[best];
        out->result.retry_after_s = 0;
        out->result.window = best;
        return warn_kill_switch(state);
    }
    if (rl_member_uuid4(state->random, member) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    out->command_len = rl_script_format(prefix, prefix_len, user, (size_t)user_len, &out->windows,
                                        member, client_clock ? rl_clock_ms() : -1, &out->command);
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

PyObject *
rl_result_tuple(const rl_windows *w, const rl_result *r, int with_window)
{
    PyObject *t = PyTuple_New(with_window ? 4 : 3);
    PyObject *item;
    if (t == NULL)
        return NULL;
    PyTuple_SET_ITEM(t, 0, Py_NewRef(r->allowed ? Py_True : Py_False));
    if ((item = PyLong_FromLongLong(r->remaining)) == NULL)
        goto error;
    PyTuple_SET_ITEM(t, 1, item);
    if ((item = PyLong_FromLongLong(r->retry_after_s)) == NULL)
        goto error;
    PyTuple_SET_ITEM(t, 2, item);
    if (with_window) {
        if ((item = PyLong_FromLongLong(w->seconds[r->window])) == NULL)
            goto error;
        PyTuple_SET_ITEM(t, 3, item);
    }
    return t;
error:
    Py_DECREF(t);
    return NULL;
}

/* Matches vectorcall arguments to names. Fills out[] with borrowed references. */
int
rl_parse_args(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
              const char *const *names, int n, PyObject **out)
{
    for (int i = 0; i < n; i++)
        out[i] = NULL;
    if (nargs > n) {
        PyErr_Format(PyExc_TypeError, "%s() takes %d arguments (%zd given)", fname, n, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        out[i] = args[i];
    if (kwnames != NULL) {
        Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t k = 0; k < nkw; k++) {
            PyObject *key = PyTuple_GET_ITEM(kwnames, k);
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
    for (int i = 0; i < n; i++) {
        if (out[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fname, names[i]);
            return -1;
        }
    }
    return 0;
}
