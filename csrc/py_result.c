/*
 * py_result.c - a Python face, AFTER the I/O: a decision's C result (rl_result, read from
 * the reply by script.c) as the Python objects the limiters answer: WindowDecision, the
 * peek and reserve reports (rl_result_object). Before the I/O, the arguments are read in
 * py_request.c. Shared by the blocking limiter (py_limiter.c) and the asyncio codec
 * (py_codec.c), so both answer exactly alike.
 *
 * GIL contract: every function here is called with the GIL held and reports errors as
 * Python exceptions (returning NULL).
 */
#include "native.h"

/* (limit, window_seconds, is_token_window, remaining or None, scope) of each window, where
   scope is 0 for the user's own windows and k for the k-th of the call's scopes. */
static PyObject *
windows_report(const rl_windows *w, const rl_result *r)
{
    PyObject *all = PyTuple_New(w->count);
    if (all == NULL)
        return NULL;
    for (int i = 0; i < w->count; i++) {
        PyObject *item;
        if (i < r->evaluated)
            item =
                Py_BuildValue("(LLNLi)", w->limit[i], w->seconds[i], PyBool_FromLong(w->tokens[i]),
                              r->remaining_of[i], (int)w->scope[i]);
        else
            item = Py_BuildValue("(LLNOi)", w->limit[i], w->seconds[i],
                                 PyBool_FromLong(w->tokens[i]), Py_None, (int)w->scope[i]);
        if (item == NULL || PyTuple_SetItem(all, i, item) < 0) {
            Py_DECREF(all);
            return NULL;
        }
    }
    return all;
}

/* peek: (allowed, remaining, retry_after_s, window_seconds, is_token_window, now_ms,
   ((limit, window_seconds, is_token_window, used, oldest_ms or None), ...), retry_after_ms). */
static PyObject *
peek_object(const rl_windows *w, const rl_result *r)
{
    PyObject *all = PyTuple_New(w->count);
    if (all == NULL)
        return NULL;
    for (int i = 0; i < w->count; i++) {
        PyObject *oldest =
            r->oldest_of[i] < 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(r->oldest_of[i]);
        PyObject *item = oldest == NULL
                             ? NULL
                             : Py_BuildValue("(LLNLN)", w->limit[i], w->seconds[i],
                                             PyBool_FromLong(w->tokens[i]), r->used_of[i], oldest);
        if (item == NULL || PyTuple_SetItem(all, i, item) < 0) {
            Py_DECREF(all);
            return NULL;
        }
    }
    return Py_BuildValue("(OLLLNLNL)", r->allowed ? Py_True : Py_False, r->remaining,
                         r->retry_after_s, w->seconds[r->window],
                         PyBool_FromLong(w->tokens[r->window]), r->now_ms, all, r->retry_after_ms);
}

/* check_windows_detailed's answer: a WindowDecision, which unpacks and compares as
   check_windows' 4-tuple and also carries the exact wait in ms and the decision's time. Returns a new
   reference. */
static PyObject *
window_decision(rl_module_state *state, const rl_windows *w, const rl_result *r)
{
    PyObject *t = PyStructSequence_New(state->WindowDecisionType);
    PyObject *item;
    if (t == NULL)
        return NULL;
    PyStructSequence_SetItem(t, 0, Py_NewRef(r->allowed ? Py_True : Py_False));
    if ((item = PyLong_FromLongLong(r->remaining)) == NULL)
        goto error;
    PyStructSequence_SetItem(t, 1, item);
    if ((item = PyLong_FromLongLong(r->retry_after_s)) == NULL)
        goto error;
    PyStructSequence_SetItem(t, 2, item);
    if ((item = PyLong_FromLongLong(w->seconds[r->window])) == NULL)
        goto error;
    PyStructSequence_SetItem(t, 3, item);
    if ((item = PyLong_FromLongLong(r->retry_after_ms)) == NULL)
        goto error;
    PyStructSequence_SetItem(t, 4, item);
    if ((item = PyLong_FromLongLong(r->now_ms)) == NULL)
        goto error;
    PyStructSequence_SetItem(t, 5, item);
    return t;
error:
    Py_DECREF(t);
    return NULL;
}

/* reserve with in_flight: acquire's tuple (allowed, held, retry_after_s, retry_after_ms,
   lease_id, expires_at_ms, now_ms, retry_bound_ms) when the slot decided (granted and held now, or refused),
   None when a window refused the request (no slot is held) or without in_flight. New
   reference, or NULL. */
static PyObject *
slot_object(const rl_prepared *d, const rl_result *r)
{
    if (r->slot < 0 || (r->slot == 0 && r->window >= 0))
        Py_RETURN_NONE;
    return Py_BuildValue("(NLLLsLLL)", PyBool_FromLong(r->slot), r->slot_held,
                         (r->slot_retry_ms + 999) / 1000, r->slot_retry_ms,
                         r->slot ? d->member : "", r->expires_ms, r->now_ms, r->retry_bound_ms);
}

/* A budget hold's answer: (allowed, refused index (-1 on allow), kind (0 allowed,
   1 permanent, 2 until_reset, 3 in_flight, -1 periods stale), now_ms, hold id ("" when
   nothing was held), ((remaining, period_start_ms, period_end_ms, fired_before,
   fired_after) per budget)). New reference, or NULL. */
static PyObject *
budget_hold_object(const rl_prepared *d, const rl_result *r)
{
    const Py_ssize_t n = r->kind < 0 ? 0 : d->nbudgets;
    PyObject *periods = PyTuple_New(n);
    if (periods == NULL)
        return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        /* PyTuple_SetItem steals item even when it fails (it cannot on a fresh tuple). */
        PyObject *item = Py_BuildValue("(LLLii)", r->remaining_of[k], r->start_of[k], r->end_of[k],
                                       r->fired_before[k], r->fired_after[k]);
        if (item == NULL || PyTuple_SetItem(periods, k, item) < 0) {
            Py_DECREF(periods);
            return NULL;
        }
    }
    /* "N" steals periods, also when building the tuple fails. */
    return Py_BuildValue("(NiiLsN)", PyBool_FromLong(r->allowed), r->window, r->kind, r->now_ms,
                         r->allowed ? d->member : "", periods);
}

/* A budget settle's answer: (found, ((fired_before, fired_after) per budget)). New
   reference, or NULL. */
static PyObject *
budget_settle_object(const rl_prepared *d, const rl_result *r)
{
    PyObject *fired = PyTuple_New(d->nbudgets);
    if (fired == NULL)
        return NULL;
    for (Py_ssize_t k = 0; k < d->nbudgets; k++) {
        /* PyTuple_SetItem steals item even when it fails (it cannot on a fresh tuple). */
        PyObject *item = Py_BuildValue("(ii)", r->fired_before[k], r->fired_after[k]);
        if (item == NULL || PyTuple_SetItem(fired, k, item) < 0) {
            Py_DECREF(fired);
            return NULL;
        }
    }
    return Py_BuildValue("(LN)", r->found, fired); /* "N" steals fired, also on failure */
}

PyObject *
rl_result_object(rl_module_state *state, const rl_prepared *d, const rl_result *r)
{
    const rl_windows *w = &d->windows;
    PyObject *t, *item;
    Py_ssize_t size;
    if (d->shape == RL_SHAPE_BUDGET_HOLD)
        return budget_hold_object(d, r);
    if (d->shape == RL_SHAPE_BUDGET_SETTLE)
        return budget_settle_object(d, r);
    if (d->shape == RL_SHAPE_RECONCILE)
        return PyLong_FromLongLong(r->found); /* with release: the lease's answer is not told */
    if (d->shape == RL_SHAPE_OBSERVE)
        return PyLong_FromLongLong(r->expires_ms);
    if (d->shape == RL_SHAPE_QUEUE)
        return PyLong_FromLongLong(r->found);
    if (d->shape == RL_SHAPE_RESET)
        return Py_BuildValue("(Ls)", r->found, r->cursor);
    if (d->shape == RL_SHAPE_PEEK)
        return peek_object(w, r);
    if (d->shape == RL_SHAPE_RELEASE)
        return PyBool_FromLong(r->allowed);
    if (d->shape == RL_SHAPE_RENEW)
        return Py_BuildValue("(NL)", PyBool_FromLong(r->allowed), r->expires_ms);
    if (d->shape == RL_SHAPE_ACQUIRE)
        return Py_BuildValue("(NLLLsLLLL)", PyBool_FromLong(r->allowed), r->remaining,
                             r->retry_after_s, r->retry_after_ms, r->allowed ? d->member : "",
                             r->expires_ms, r->now_ms, r->retry_bound_ms,
                             r->allowed ? 0 : r->share_rule);
    if (d->shape == RL_SHAPE_DETAILED)
        return window_decision(state, w, r);
    if (d->shape == RL_SHAPE_GCRA)
        return Py_BuildValue("(NLLLL)", PyBool_FromLong(r->allowed), r->remaining, r->retry_after_s,
                             r->retry_after_ms, r->now_ms);
    size = d->shape == RL_SHAPE_CHECK ? 3 : d->shape == RL_SHAPE_WINDOWS ? 4 : 13;
    t = PyTuple_New(size);
    if (t == NULL)
        return NULL;
    /* PyTuple_SetItem steals item even when it fails (it cannot on a fresh tuple). */
    if (PyTuple_SetItem(t, 0, Py_NewRef(r->allowed ? Py_True : Py_False)) < 0)
        goto error;
    if ((item = PyLong_FromLongLong(r->remaining)) == NULL || PyTuple_SetItem(t, 1, item) < 0)
        goto error;
    if ((item = PyLong_FromLongLong(r->retry_after_s)) == NULL || PyTuple_SetItem(t, 2, item) < 0)
        goto error;
    if (size == 3)
        return t;
    /* window -1: an in-flight slot refused it before any window was decided */
    if ((item = PyLong_FromLongLong(r->window >= 0 ? w->seconds[r->window] : 0)) == NULL ||
        PyTuple_SetItem(t, 3, item) < 0)
        goto error;
    if (size == 4)
        return t;
    /* reserve: is the deciding window a token window, the member ("" when nothing was
       logged), the decision's time, every window's report, the wait in ms and the deciding
       window's scope. */
    if (PyTuple_SetItem(t, 4, PyBool_FromLong(r->window >= 0 && w->tokens[r->window])) < 0)
        goto error;
    if ((item = PyUnicode_FromString(r->allowed ? d->member : "")) == NULL ||
        PyTuple_SetItem(t, 5, item) < 0)
        goto error;
    if ((item = PyLong_FromLongLong(r->now_ms)) == NULL || PyTuple_SetItem(t, 6, item) < 0)
        goto error;
    if ((item = windows_report(w, r)) == NULL || PyTuple_SetItem(t, 7, item) < 0)
        goto error;
    if ((item = PyLong_FromLongLong(r->retry_after_ms)) == NULL || PyTuple_SetItem(t, 8, item) < 0)
        goto error;
    /* The deciding window's scope (0: the user's own). */
    if ((item = PyLong_FromLong(r->window >= 0 ? w->scope[r->window] : 0)) == NULL ||
        PyTuple_SetItem(t, 9, item) < 0)
        goto error;
    /* The entry's tie (compact storage; 0 otherwise): with its time it names the entry. */
    if (PyTuple_SetItem(t, 10, PyLong_FromLongLong(r->allowed ? r->tie : 0)) < 0 ||
        PyTuple_SetItem(t, 11, slot_object(d, r)) < 0)
        goto error;
    /* reserve with shares: the reserved-share rule that refused it (0: none) */
    if (PyTuple_SetItem(t, 12, PyLong_FromLongLong(r->allowed ? 0 : r->share_rule)) < 0)
        goto error;
    return t;
error:
    Py_DECREF(t);
    return NULL;
}
