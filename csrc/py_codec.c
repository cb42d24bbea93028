/*
 * py_codec.c - the C half of the asyncio limiter (genai_ratelimit/aio.py).
 *
 *   Codec     validates a check and formats its EVALSHA exactly like the blocking limiter
 *             (py_request.c), returning either the kill switch's final answer or a Request.
 *   Request   one prepared decision: the command bytes and its windows.
 *   Pipeline  one asyncio connection's protocol: the engine of proto.c (handshake, FIFO,
 *             NOSCRIPT reload, reply classification, replay rule: the same code the
 *             blocking limiter runs) with a future per request. feed() resolves the
 *             futures in order.
 *
 * The event loop moves the bytes (an asyncio.Protocol in aio.py); nothing here does I/O,
 * blocks, or releases the GIL. Every function runs with the GIL held and raises Python
 * exceptions. A future that was cancelled keeps its place in the FIFO: its reply is read
 * and dropped, so the connection never falls out of step.
 */
#include "native.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ Request */

typedef struct {
    PyObject_HEAD
    rl_prepared prepared; /* windows + formatted command + replay form (owned) */
    PyObject *route;      /* the Route of its call (strong), or NULL: not routed */
} RequestObject;

static void
Request_dealloc(RequestObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    rl_prepared_clear(&self->prepared);
    Py_CLEAR(self->route);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(self);
    Py_DECREF(tp);
}

static PyObject *
Request_get_command(RequestObject *self, void *Py_UNUSED(closure))
{
    if (self->prepared.command == NULL)
        Py_RETURN_NONE;
    return PyBytes_FromStringAndSize(self->prepared.command,
                                     (Py_ssize_t)self->prepared.command_len);
}

static PyObject *
Request_get_replayed(RequestObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->prepared.replay != NULL);
}

static PyObject *
Request_get_slot(RequestObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->prepared.slot);
}

static PyObject *
Request_get_reloaded(RequestObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->prepared.reloaded);
}

static PyObject *
Request_get_route(RequestObject *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->route != NULL ? self->route : Py_None);
}

/* A Route (or None): every failure of the request on a Pipeline goes to it from then on. */
static int
Request_set_route(RequestObject *self, PyObject *value, void *Py_UNUSED(closure))
{
    rl_module_state *state = PyType_GetModuleState(Py_TYPE(self));
    if (value == NULL || value == Py_None) {
        Py_CLEAR(self->route);
        return 0;
    }
    if (state == NULL || !Py_IS_TYPE(value, (PyTypeObject *)state->RouteType)) {
        PyErr_SetString(PyExc_TypeError, "route must be a Route (Router.route) or None");
        return -1;
    }
    PyObject *old = self->route;
    self->route = Py_NewRef(value);
    Py_XDECREF(old);
    return 0;
}

static PyGetSetDef Request_getset[] = {
    {"route", (getter)Request_get_route, (setter)Request_set_route,
     "The Route of the call (cluster, Sentinel), or None. A failure of the request on a\n"
     "Pipeline is handed to it there (Route.go_on says whether the call goes on).",
     NULL},
    {"slot", (getter)Request_get_slot, NULL,
     "The Redis Cluster hash slot of the request's keys (-1 outside cluster mode).", NULL},
    {"command", (getter)Request_get_command, NULL, "The RESP-encoded EVALSHA.", NULL},
    {"replayed", (getter)Request_get_replayed, NULL,
     "True once the request was switched to its replay form (after a broken connection).", NULL},
    {"reloaded", (getter)Request_get_reloaded, NULL,
     "True when its last sending was sent again after NOSCRIPT (behind what followed it).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Request_slots[] = {
    {Py_tp_doc, "One formatted rate-limit decision, made by Codec."},
    {Py_tp_dealloc, Request_dealloc},
    {Py_tp_getset, Request_getset},
    {0, NULL},
};

PyType_Spec rl_request_spec = {
    .name = "genai_ratelimit._native.Request",
    .basicsize = sizeof(RequestObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Request_slots,
};

/* -------------------------------------------------------------------- Codec */

typedef struct {
    PyObject_HEAD
    char *key_prefix; /* UTF-8, owned */
    size_t key_prefix_len;
    int client_clock;
    int hash_tag;       /* cluster: keys carry the user id in a hash tag */
    rl_storage storage; /* where the windows are kept (sorted sets or strings) */
    int metrics_on;     /* count into metrics (metrics=True) */
    rl_metrics metrics; /* the async limiter's counters, updated by its pipelines */
} CodecObject;

static int
Codec_init(CodecObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"key_prefix", "client_clock", "metrics",
                               "hash_tag",   "storage",      NULL};
    const char *prefix, *storage = NULL;
    Py_ssize_t prefix_len;
    int client_clock = 0, metrics = 1, hash_tag = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s#|$pppz", keywords, &prefix, &prefix_len,
                                     &client_clock, &metrics, &hash_tag, &storage))
        return -1;
    if (rl_parse_storage(storage, &self->storage) < 0)
        return -1;
    if (rl_check_key_prefix(prefix_len) < 0)
        return -1;
    char *copy = PyMem_Malloc((size_t)prefix_len + 1);
    if (copy == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(copy, prefix, (size_t)prefix_len + 1);
    PyMem_Free(self->key_prefix);
    self->key_prefix = copy;
    self->key_prefix_len = (size_t)prefix_len;
    self->client_clock = client_clock;
    self->hash_tag = hash_tag;
    self->metrics_on = metrics;
    return 0;
}

static void
Codec_dealloc(CodecObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyMem_Free(self->key_prefix);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(self);
    Py_DECREF(tp);
}

/* Parses one method's arguments: the kill switch's final result, or a new Request. */
static PyObject *
encode(CodecObject *self, PyTypeObject *defining_class, rl_shape shape, PyObject *const *args,
       Py_ssize_t nargs, PyObject *kwnames)
{
    rl_module_state *state = PyType_GetModuleState(defining_class);
    RequestObject *req;
    rl_prepared p;
    PyObject *user_id;
    if (self->key_prefix == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the codec was not initialised");
        return NULL;
    }
    if (rl_parse_request(shape, args, nargs, kwnames, &p, &user_id) < 0)
        return NULL;
    p.hash_tag = self->hash_tag;
    p.storage = self->storage;
    if (rl_prepare(state, self->key_prefix, self->key_prefix_len, self->client_clock, user_id, &p) <
        0)
        return NULL;
    if (p.disabled)
        return rl_result_object(state, &p, &p.result);
    req = PyObject_New(RequestObject, state->RequestType);
    if (req == NULL) {
        rl_prepared_clear(&p);
        return NULL;
    }
    req->prepared = p; /* takes ownership of the command */
    req->route = NULL;
    return (PyObject *)req;
}

#define CODEC_METHOD(name, shape)                                                                  \
    static PyObject *Codec_##name(CodecObject *self, PyTypeObject *defining_class,                 \
                                  PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)      \
    {                                                                                              \
        return encode(self, defining_class, shape, args, nargs, kwnames);                          \
    }
CODEC_METHOD(check, RL_SHAPE_CHECK)
CODEC_METHOD(check_windows, RL_SHAPE_WINDOWS)
CODEC_METHOD(check_windows_detailed, RL_SHAPE_DETAILED)
CODEC_METHOD(reserve, RL_SHAPE_RESERVE)
CODEC_METHOD(reconcile, RL_SHAPE_RECONCILE)
CODEC_METHOD(peek, RL_SHAPE_PEEK)
CODEC_METHOD(reset, RL_SHAPE_RESET)
CODEC_METHOD(check_rate, RL_SHAPE_GCRA)
CODEC_METHOD(hold_budgets, RL_SHAPE_BUDGET_HOLD)
CODEC_METHOD(settle_budgets, RL_SHAPE_BUDGET_SETTLE)
CODEC_METHOD(observe_upstream, RL_SHAPE_OBSERVE)
CODEC_METHOD(wait_queue, RL_SHAPE_QUEUE)

static PyObject *
Codec_get_metrics(CodecObject *self, PyObject *Py_UNUSED(ignored))
{
    return rl_metrics_object(&self->metrics, self->metrics_on);
}

static PyObject *
Codec_record_outcome(CodecObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return rl_metrics_record(self->metrics_on ? &self->metrics : NULL, args, nargs);
}
CODEC_METHOD(acquire, RL_SHAPE_ACQUIRE)
CODEC_METHOD(release, RL_SHAPE_RELEASE)
CODEC_METHOD(renew, RL_SHAPE_RENEW)

static PyMethodDef Codec_methods[] = {
    {"check", (PyCFunction)(void (*)(void))Codec_check, METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     "check($self, /, user_id, limit, window_seconds, *, cost=1)\n--\n\n"
     "A Request, or the kill switch's final tuple."},
    {"check_windows", (PyCFunction)(void (*)(void))Codec_check_windows,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     "check_windows($self, /, user_id, windows, *, cost=1)\n--\n\n"
     "A Request, or the kill switch's final tuple."},
    {"check_windows_detailed", (PyCFunction)(void (*)(void))Codec_check_windows_detailed,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     "check_windows_detailed($self, /, user_id, windows, *, cost=1, gcra=None)\n--\n\n"
     "A Request, or the kill switch's final WindowDecision."},
    {"reserve", (PyCFunction)(void (*)(void))Codec_reserve,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     "reserve($self, /, user_id, windows, *, cost=1, token_windows=(), tokens=None,\n"
     "    scopes=(), in_flight=None, shares=None, ticket=None, probe=None)\n--\n\n"
     "A Request, or the kill switch's final tuple (Limiter._reserve's shape)."},
    {"reconcile", (PyCFunction)(void (*)(void))Codec_reconcile,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     "reconcile($self, /, user_id, windows, member, timestamp_ms, cost, *, tokens=False,\n"
     "    scopes=(), tie=0, release=False, shares=None)\n--\n\n"
     "A Request (the kill switch never answers it)."},
    {"peek", (PyCFunction)(void (*)(void))Codec_peek, METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     "peek($self, /, user_id, windows, *, cost=1, token_windows=(), tokens=None,\n"
     "    scopes=())\n--\n\n"
     "A Request, or the kill switch's final tuple (Limiter._peek's shape)."},
    {"check_rate", (PyCFunction)(void (*)(void))Codec_check_rate,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     "check_rate($self, /, user_id, rate, period_seconds, burst, *, cost=1)\n--\n\n"
     "A Request, or the kill switch's final tuple (Limiter._check_rate's shape)."},
    {"hold_budgets", (PyCFunction)(void (*)(void))Codec_hold_budgets,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     "hold_budgets($self, /, user_id, budgets, hold_ms)\n--\n\n"
     "A Request, or the kill switch's final tuple (Limiter._hold_budgets's shape)."},
    {"settle_budgets", (PyCFunction)(void (*)(void))Codec_settle_budgets,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     "settle_budgets($self, /, user_id, budgets, hold_id)\n--\n\n"
     "A Request (the kill switch never answers it)."},
    {"observe_upstream", (PyCFunction)(void (*)(void))Codec_observe_upstream,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     "observe_upstream($self, /, name, observation)\n--\n\n"
     "A Request, or the kill switch's final int (Limiter._observe_upstream's shape)."},
    {"wait_queue", (PyCFunction)(void (*)(void))Codec_wait_queue,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     "wait_queue($self, /, name, ticket, tenant, numbers, leases=False)\n--\n\n"
     "A Request (Limiter._wait_queue's shape; the kill switch never answers it)."},
    {"reset", (PyCFunction)(void (*)(void))Codec_reset, METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     "reset($self, /, user_id, windows=None, *, token_windows=None, cursor=None)\n--\n\n"
     "A Request (the kill switch never answers it)."},
    {"metrics", (PyCFunction)Codec_get_metrics, METH_NOARGS,
     "metrics($self, /)\n--\n\nThe counters of the async limiter (Limiter.metrics's shape)."},
    {"_record_outcome", (PyCFunction)(void (*)(void))Codec_record_outcome, METH_FASTCALL,
     "_record_outcome($self, kind, count=1, /)\n--\n\n"
     "Counts what only the caller knows (Limiter._record_outcome's kinds)."},
    {"acquire", (PyCFunction)(void (*)(void))Codec_acquire,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     "acquire($self, /, user_id, limit, lease_seconds, shares=None, ticket=None)\n--\n\n"
     "A Request, or the kill switch's final tuple (Limiter._acquire's shape)."},
    {"release", (PyCFunction)(void (*)(void))Codec_release,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     "release($self, /, user_id, lease_id)\n--\n\n"
     "A Request (the kill switch never answers it)."},
    {"renew", (PyCFunction)(void (*)(void))Codec_renew, METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     "renew($self, /, user_id, lease_id, lease_seconds)\n--\n\n"
     "A Request (the kill switch never answers it)."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Codec_slots[] = {
    {Py_tp_doc, "Codec(key_prefix, *, client_clock=False, metrics=True, hash_tag=False, "
                "storage='zset')\n--\n\n"
                "Validates checks and formats them, exactly like the blocking Limiter."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, Codec_init},
    {Py_tp_dealloc, Codec_dealloc},
    {Py_tp_methods, Codec_methods},
    {0, NULL},
};

PyType_Spec rl_codec_spec = {
    .name = "genai_ratelimit._native.Codec",
    .basicsize = sizeof(CodecObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Codec_slots,
};

/* ----------------------------------------------------------------- Pipeline */

/* Entries of the engine carry, as token, a strong reference to the waiting future (NULL
   for the engine's own SCRIPT LOAD and for handshake steps before the last), and as
   holder a strong reference to the Request whose prepared decision they point into. */
typedef struct {
    PyObject_HEAD
    rl_proto proto;     /* the engine; proto.reader == NULL before __init__ */
    double timeout;     /* seconds a reply may take */
    CodecObject *codec; /* whose counters this connection updates (owned), or NULL */
} PipelineObject;

/* The counters of the pipeline's limiter, or NULL when it has none or they are off. */
static rl_metrics *
metrics_of(PipelineObject *self)
{
    return self->codec != NULL && self->codec->metrics_on ? &self->codec->metrics : NULL;
}

static int
Pipeline_init(PipelineObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"timeout", "codec", NULL};
    double timeout;
    PyObject *codec = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "d|$O", keywords, &timeout, &codec))
        return -1;
    if (rl_check_timeout("timeout", timeout) < 0)
        return -1;
    if (codec == Py_None)
        codec = NULL;
    if (codec != NULL && PyType_GetSlot(Py_TYPE(codec), Py_tp_init) != (void *)Codec_init) {
        PyErr_SetString(PyExc_TypeError, "codec must be a Codec");
        return -1;
    }
    if (self->proto.reader == NULL && rl_proto_init(&self->proto) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    self->timeout = timeout;
    PyObject *old = (PyObject *)self->codec;
    self->codec = (CodecObject *)Py_XNewRef(codec);
    Py_XDECREF(old);
    self->proto.metrics = metrics_of(self);
    return 0;
}

static int
ready(PipelineObject *self)
{
    if (self->proto.reader != NULL)
        return 1;
    PyErr_SetString(PyExc_RuntimeError, "the pipeline was not initialised");
    return 0;
}

static int
Pipeline_traverse(PipelineObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT((PyObject *)self->codec);
    for (size_t i = 0; i < rl_proto_pending(&self->proto); i++) {
        const rl_entry *e = rl_proto_entry(&self->proto, i);
        Py_VISIT((PyObject *)e->token);
        Py_VISIT((PyObject *)e->holder);
    }
    return 0;
}

static void
release_entry(rl_entry *e)
{
    Py_XDECREF((PyObject *)e->token);
    Py_XDECREF((PyObject *)e->holder);
}

/* Removes every entry, dropping their references (the futures are left as they are). */
static void
drop_entries(PipelineObject *self)
{
    rl_entry e;
    while (self->proto.reader != NULL && rl_proto_pop(&self->proto, &e))
        release_entry(&e);
}

static int
Pipeline_clear(PipelineObject *self)
{
    drop_entries(self);
    self->proto.metrics = NULL;
    Py_CLEAR(self->codec);
    return 0;
}

static void
Pipeline_dealloc(PipelineObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    drop_entries(self);
    if (self->proto.reader != NULL)
        rl_proto_clear(&self->proto);
    Py_CLEAR(self->codec);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(self);
    Py_DECREF(tp);
}

/* Resolves a future unless it is already done (cancelled). Steals value. */
static int
resolve(rl_module_state *state, PyObject *future, PyObject *value, int is_exception)
{
    PyObject *done, *res;
    if (value == NULL) {
        /* Making the value failed: the future gets that exception rather than waiting
           forever. */
        PyObject *type, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (type == NULL)
            return -1;
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL)
            PyException_SetTraceback(value, tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
        if (value == NULL)
            return -1;
        is_exception = 1;
    }
    if (future == NULL) {
        Py_DECREF(value);
        return 0;
    }
    done = PyObject_CallMethodObjArgs(future, state->str_done, NULL);
    if (done == NULL) {
        Py_DECREF(value);
        return -1;
    }
    int already = PyObject_IsTrue(done);
    Py_DECREF(done);
    if (already) {
        Py_DECREF(value);
        return already < 0 ? -1 : 0;
    }
    /* ObjArgs, not CallMethod("O"): a tuple result must not be spread into arguments. */
    res = PyObject_CallMethodObjArgs(
        future, is_exception ? state->str_set_exception : state->str_set_result, value, NULL);
    Py_DECREF(value);
    if (res == NULL)
        return -1;
    Py_DECREF(res);
    return 0;
}

/* Plain conversion of a command's reply (peek-style commands, health checks). */
static PyObject *
reply_to_python(const redisReply *r)
{
    switch (r->type) {
    case REDIS_REPLY_STRING:
    case REDIS_REPLY_STATUS:
    case REDIS_REPLY_ERROR: /* inside an array: kept as its text */
        return PyBytes_FromStringAndSize(r->str, (Py_ssize_t)r->len);
    case REDIS_REPLY_INTEGER:
        return PyLong_FromLongLong(r->integer);
    case REDIS_REPLY_NIL:
        Py_RETURN_NONE;
    case REDIS_REPLY_ARRAY: {
        PyObject *list = PyList_New((Py_ssize_t)r->elements);
        if (list == NULL)
            return NULL;
        for (size_t i = 0; i < r->elements; i++) {
            PyObject *item = reply_to_python(r->element[i]);
            if (item == NULL || PyList_SetItem(list, (Py_ssize_t)i, item) < 0) {
                Py_DECREF(list);
                return NULL;
            }
        }
        return list;
    }
    default:
        PyErr_Format(PyExc_ValueError, "Redis answered %s, which this client does not decode",
                     rl_reply_type_name(r->type));
        return NULL;
    }
}

/* Hands one completed request to its future and drops the entry's references. */
static int
deliver(rl_module_state *state, rl_metrics *metrics, rl_event *ev)
{
    PyObject *future = (PyObject *)ev->entry.token;
    RequestObject *req = (RequestObject *)ev->entry.holder;
    PyObject *value;
    int rc;
    if (ev->entry.step == RL_STEP_COMMAND && ev->entry.holder != NULL) {
        /* A router's question: its reply, or its failure, goes to the read that asked. */
        rl_routing_answer((PyObject *)ev->entry.holder, ev->status, ev->reply, &ev->error);
        if (ev->reply != NULL)
            freeReplyObject(ev->reply);
        ev->reply = NULL;
        rc = resolve(state, future, Py_NewRef(Py_None), 0);
    } else if (ev->status != RL_OK) {
        if (metrics != NULL && ev->entry.step == RL_STEP_DECISION &&
            rl_script_decides(req->prepared.script))
            rl_metrics_count(&metrics->unavailable);
        if (ev->entry.step == RL_STEP_DECISION && req->route != NULL)
            (void)rl_routing_failed(req->route, ev->status, &ev->error);
        rc = resolve(state, future, rl_exception(state, &ev->error), 1);
    } else {
        switch (ev->entry.step) {
        case RL_STEP_DECISION:
            value = rl_result_object(state, &req->prepared, &ev->result);
            break;
        case RL_STEP_COMMAND:
            value = reply_to_python(ev->reply);
            freeReplyObject(ev->reply);
            ev->reply = NULL;
            break;
        default: /* the handshake is complete, or the replicas acknowledged (WAIT) */
            value = Py_NewRef(Py_None);
            break;
        }
        rc = resolve(state, future, value, 0);
    }
    release_entry(&ev->entry);
    return rc;
}

PyDoc_STRVAR(Pipeline_handshake_doc,
"handshake($self, future, /, username=None, password=None, db=0, ping=False)\n--\n\n"
"Queues the connection's handshake (AUTH, SELECT, or PING on TLS), judged by the same\n"
"engine as the blocking limiter's. Returns True when steps were queued: the future is\n"
"resolved with None when the last one succeeds, or fails like the connection does.\n"
"False: nothing to send, the connection is ready.");

static PyObject *
Pipeline_handshake(PipelineObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"", "username", "password", "db", "ping", NULL};
    PyObject *future;
    const char *username = NULL, *password = NULL;
    long long db = 0;
    int ping = 0;
    rl_error err = {RL_OK, ""};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|zzLp", keywords, &future, &username,
                                     &password, &db, &ping))
        return NULL;
    if (!ready(self))
        return NULL;
    if (db < 0) {
        PyErr_Format(PyExc_ValueError, "db must be >= 0, got %lld", db);
        return NULL;
    }
    rl_handshake h = {username, password, db, ping};
    /* The engine queues every step or none. The last step waited for holds the future:
       the one reference it takes, given back when nothing (or nothing waited for) was
       queued. */
    Py_INCREF(future);
    int steps = rl_proto_handshake(&self->proto, &h, rl_monotonic() + self->timeout, future, &err);
    if (steps <= 0)
        Py_DECREF(future);
    if (steps < 0)
        return rl_raise(PyType_GetModuleState(Py_TYPE(self)), &err);
    return PyBool_FromLong(steps > 0);
}

PyDoc_STRVAR(Pipeline_push_doc,
"push($self, future, request, extend=0.0, /)\n--\n\n"
"Queues the request's command for the next write and its reply's future in the FIFO. The\n"
"request's deadline is fixed when it is first pushed (now + timeout); a replay keeps it,\n"
"extended by `extend` seconds (the time spent opening the connection it is replayed on).");

static PyObject *
Pipeline_push(PipelineObject *self, PyTypeObject *defining_class, PyObject *const *args,
              Py_ssize_t nargs, PyObject *kwnames)
{
    rl_module_state *state = PyType_GetModuleState(defining_class);
    rl_error err = {RL_OK, ""};
    double extend = 0;
    if (nargs < 2 || nargs > 3 || (kwnames != NULL && PyTuple_Size(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "push(future, request, extend=0.0) takes 2 or 3 "
                                         "positional arguments");
        return NULL;
    }
    if (!ready(self))
        return NULL;
    if (!Py_IS_TYPE(args[1], state->RequestType)) {
        PyErr_SetString(PyExc_TypeError, "push() needs a Request made by Codec");
        return NULL;
    }
    if (nargs == 3) {
        extend = PyFloat_AsDouble(args[2]);
        if (extend == -1 && PyErr_Occurred())
            return NULL;
        if (!(extend >= 0 && extend <= RL_MAX_TIMEOUT_SECONDS)) {
            PyErr_SetString(PyExc_ValueError, "extend must be between 0 and one day");
            return NULL;
        }
    }
    RequestObject *req = (RequestObject *)args[1];
    double deadline =
        req->prepared.deadline ? req->prepared.deadline + extend : rl_monotonic() + self->timeout;
    if (rl_proto_push_decision(&self->proto, &req->prepared, deadline, args[0], req, &err) != RL_OK)
        return rl_raise(state, &err); /* nothing was queued */
    req->prepared.deadline = deadline;
    Py_INCREF(args[0]);
    Py_INCREF(args[1]);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Pipeline_push_command_doc,
"push_command($self, future, /, *words)\n--\n\n"
"Queues any Redis command (str or bytes words); its reply resolves the future as bytes,\n"
"int, None or a list, or as an exception for an error reply.");

static PyObject *
Pipeline_push_command(PipelineObject *self, PyTypeObject *defining_class, PyObject *const *args,
                      Py_ssize_t nargs, PyObject *kwnames)
{
    rl_module_state *state = PyType_GetModuleState(defining_class);
    const char *argv[8];
    size_t argvlen[8];
    rl_error err = {RL_OK, ""};
    if (nargs < 2 || nargs > 9 || (kwnames != NULL && PyTuple_Size(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "push_command(future, *words) takes 1 to 8 command words");
        return NULL;
    }
    if (!ready(self))
        return NULL;
    for (Py_ssize_t i = 1; i < nargs; i++) {
        Py_ssize_t n;
        if (PyBytes_Check(args[i])) {
            char *bytes;
            if (PyBytes_AsStringAndSize(args[i], &bytes, &n) < 0)
                return NULL;
            argv[i - 1] = bytes;
        } else if (PyUnicode_Check(args[i])) {
            argv[i - 1] = PyUnicode_AsUTF8AndSize(args[i], &n);
            if (argv[i - 1] == NULL)
                return NULL;
        } else {
            rl_type_error(args[i], "command words must be str or bytes, not ");
            return NULL;
        }
        argvlen[i - 1] = (size_t)n;
    }
    if (rl_proto_push_command(&self->proto, (int)(nargs - 1), argv, argvlen,
                              rl_monotonic() + self->timeout, args[0], &err) != RL_OK)
        return rl_raise(state, &err); /* nothing was queued */
    Py_INCREF(args[0]);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Pipeline_push_wait_doc,
"push_wait($self, future, replicas, timeout_ms, /)\n--\n\n"
"min_replicas: queues the engine's WAIT (the blocking limiter's, csrc/proto.c), which\n"
"covers every write queued before it. The future gets None when at least `replicas`\n"
"acknowledged within timeout_ms, else RateLimiterUnavailable (\"not replicated: ...\").\n"
"Its reply is due after timeout plus timeout_ms.");

static PyObject *
Pipeline_push_wait(PipelineObject *self, PyTypeObject *defining_class, PyObject *const *args,
                   Py_ssize_t nargs, PyObject *kwnames)
{
    rl_module_state *state = PyType_GetModuleState(defining_class);
    rl_error err = {RL_OK, ""};
    if (nargs != 3 || (kwnames != NULL && PyTuple_Size(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError,
                        "push_wait(future, replicas, timeout_ms) takes 3 positional arguments");
        return NULL;
    }
    if (!ready(self))
        return NULL;
    long replicas = PyLong_AsLong(args[1]);
    if (replicas == -1 && PyErr_Occurred())
        return NULL;
    long long timeout_ms = PyLong_AsLongLong(args[2]);
    if (timeout_ms == -1 && PyErr_Occurred())
        return NULL;
    if (replicas < 1 || replicas > RL_MAX_REPLICAS || timeout_ms < 1 ||
        timeout_ms > RL_MAX_REPLICA_TIMEOUT_MS) {
        PyErr_Format(PyExc_ValueError,
                     "replicas must be between 1 and %d and timeout_ms between 1 and %lld",
                     RL_MAX_REPLICAS, (long long)RL_MAX_REPLICA_TIMEOUT_MS);
        return NULL;
    }
    if (rl_proto_push_wait(&self->proto, (int)replicas, timeout_ms, rl_monotonic() + self->timeout,
                           args[0], &err) != RL_OK)
        return rl_raise(state, &err); /* nothing was queued */
    Py_INCREF(args[0]);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Pipeline_push_question_doc,
"push_question($self, future, read, /)\n--\n\n"
"Queues the question a RouteRead asks now (RouteRead.question). Its reply, or the failure\n"
"that cuts it off (this connection's, or one that keeps it from being queued), goes\n"
"straight to the read (the router parses it, csrc/router.c); the future then gets None,\n"
"and read.question() says what to ask next.");

static PyObject *
Pipeline_push_question(PipelineObject *self, PyTypeObject *defining_class, PyObject *const *args,
                       Py_ssize_t nargs, PyObject *kwnames)
{
    rl_module_state *state = PyType_GetModuleState(defining_class);
    rl_error err = {RL_OK, ""};
    if (nargs != 2 || (kwnames != NULL && PyTuple_Size(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError,
                        "push_question(future, read) takes 2 positional arguments");
        return NULL;
    }
    if (!ready(self))
        return NULL;
    if (!Py_IS_TYPE(args[1], (PyTypeObject *)state->RouteReadType)) {
        PyErr_SetString(PyExc_TypeError, "push_question() needs a RouteRead (Router.read)");
        return NULL;
    }
    const rl_question *q = rl_routing_question(args[1]);
    if (q == NULL) {
        PyErr_SetString(PyExc_ValueError, "the read asks nothing now (over, or asked already)");
        return NULL;
    }
    const char *argv[3];
    size_t argvlen[3];
    for (int i = 0; i < q->argc && i < 3; i++) {
        argv[i] = q->argv[i];
        argvlen[i] = q->argvlen[i];
    }
    if (rl_proto_push_held_command(&self->proto, q->argc < 3 ? q->argc : 3, argv, argvlen,
                                   rl_monotonic() + self->timeout, args[0], args[1],
                                   &err) != RL_OK) {
        /* Nothing was queued: the read hears why at once, as from a reply. */
        rl_routing_answer(args[1], err.kind, NULL, &err);
        if (resolve(state, args[0], Py_NewRef(Py_None), 0) < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    Py_INCREF(args[0]);
    Py_INCREF(args[1]);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Pipeline_take_doc,
"take($self, /)\n--\n\n"
"The bytes queued since the last take() (to be written now), or None. A bytearray when\n"
"they hold a password (the handshake's AUTH): the caller wipes it once the transport is\n"
"done with it (aio.py: when the handshake's last reply came, or the connection is lost).");

static PyObject *
Pipeline_take(PipelineObject *self, PyObject *Py_UNUSED(ignored))
{
    size_t len;
    if (!ready(self))
        return NULL;
    const char *out = rl_proto_output(&self->proto, &len);
    if (len == 0)
        Py_RETURN_NONE;
    PyObject *data = self->proto.sensitive ? PyByteArray_FromStringAndSize(out, (Py_ssize_t)len)
                                           : PyBytes_FromStringAndSize(out, (Py_ssize_t)len);
    if (data == NULL)
        return NULL;
    rl_proto_consume(&self->proto, len);
    return data;
}

PyDoc_STRVAR(Pipeline_feed_doc,
"feed($self, data, /)\n--\n\n"
"Parses the replies in data and resolves their futures in order. Returns True when bytes\n"
"were queued for writing (a NOSCRIPT reload). Raises RateLimiterUnavailable when the\n"
"connection is out of step (garbage, a reply nobody asked for, a refused handshake): the\n"
"caller must then fail_all() and close the connection.");

/* A bytes copy of a bytes-like object (bytearray, memoryview, ...), or NULL with the
   TypeError a non-buffer gets. New reference. */
static PyObject *
bytes_of(PyObject *obj)
{
    PyObject *view = PyMemoryView_FromObject(obj);
    if (view == NULL)
        return NULL;
    PyObject *copy = PyBytes_FromObject(view);
    Py_DECREF(view);
    return copy;
}

static PyObject *
Pipeline_feed(PipelineObject *self, PyTypeObject *defining_class, PyObject *const *args,
              Py_ssize_t nargs, PyObject *kwnames)
{
    rl_module_state *state = PyType_GetModuleState(defining_class);
    rl_error err = {RL_OK, ""};
    size_t out_before, out_after;

    if (nargs != 1 || (kwnames != NULL && PyTuple_Size(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "feed(data) takes 1 positional argument");
        return NULL;
    }
    if (!ready(self))
        return NULL;
    (void)rl_proto_output(&self->proto, &out_before);
    /* bytes (what asyncio hands data_received) is read in place; another bytes-like
       object is copied into bytes first: the Limited API of 3.10 has no buffer protocol. */
    PyObject *data = PyBytes_Check(args[0]) ? Py_NewRef(args[0]) : bytes_of(args[0]);
    char *buf;
    Py_ssize_t len;
    if (data == NULL || PyBytes_AsStringAndSize(data, &buf, &len) < 0) {
        Py_XDECREF(data);
        return NULL;
    }
    rl_status st = rl_proto_feed(&self->proto, buf, (size_t)len, &err);
    Py_DECREF(data);
    if (st != RL_OK)
        return rl_raise(state, &err);
    for (;;) {
        rl_event ev;
        int got = rl_proto_next(&self->proto, &ev, &err);
        if (got == 0)
            break;
        if (got < 0)
            return rl_raise(state, &err);
        int fatal = ev.fatal;
        if (fatal)
            err = ev.error;
        if (deliver(state, metrics_of(self), &ev) < 0)
            return NULL;
        if (fatal)
            return rl_raise(state, &err);
    }
    (void)rl_proto_output(&self->proto, &out_after);
    return PyBool_FromLong(out_after > out_before);
}

/* The failure of a WAIT cut off by exc, whose rl_status is cause: the engine's judgement
   (rl_proto_wait_failed), or exc itself. New reference, or NULL with an exception set. */
static PyObject *
wait_failure(rl_module_state *state, PyObject *exc, rl_status cause)
{
    rl_error err;
    rl_error_from(exc, cause, &err);
    if (rl_proto_wait_failed(cause, &err) == cause)
        return Py_NewRef(exc);
    return rl_exception(state, &err);
}

/* The failure of a routed decision cut off by exc (cause): handed to its route, which may
   give up with an error of its own (then that one), else exc. New reference, or NULL. */
static PyObject *
routed_failure(rl_module_state *state, PyObject *route, PyObject *exc, rl_status cause)
{
    rl_error err;
    rl_error_from(exc, cause, &err);
    if (rl_routing_failed(route, cause, &err) < 0)
        return rl_exception(state, &err);
    return Py_NewRef(exc);
}

/* Pops every entry. With replays != NULL, decisions that the replay rule sends again are
   appended to it as (future, request); every other waiting future fails with exc (whose
   rl_status is cause: a WAIT's failure is the engine's judgement of it). */
static int
pop_all(PipelineObject *self, rl_module_state *state, PyObject *exc, rl_status cause,
        PyObject *replays)
{
    int failed = 0;
    PyObject *first_type = NULL, *first_value = NULL, *first_tb = NULL;
    rl_entry e;
    while (rl_proto_pop(&self->proto, &e)) {
        PyObject *future = (PyObject *)e.token;
        int rc = 0;
        if (e.step == RL_STEP_COMMAND && e.holder != NULL) {
            /* A router's question: the read that asked hears why it got no answer. */
            rl_error err;
            rl_error_from(exc, cause, &err);
            rl_routing_answer((PyObject *)e.holder, cause, NULL, &err);
        }
        if (future != NULL) {
            int replay = 0, waiting = 0; /* waiting: a caller still awaits this decision */
            if (e.step == RL_STEP_DECISION) {
                PyObject *done = PyObject_CallMethodObjArgs(future, state->str_done, NULL);
                int is_done = done == NULL ? -1 : PyObject_IsTrue(done);
                Py_XDECREF(done);
                waiting = is_done == 0;
                if (replays != NULL && waiting)
                    replay = rl_proto_replay(RL_ERR_IO, e.decision);
                if (is_done < 0 || replay < 0) {
                    if (replay < 0)
                        PyErr_NoMemory();
                    rc = -1;
                    replay = 0;
                } else if (replay == 1) {
                    PyObject *pair = PyTuple_Pack(2, future, (PyObject *)e.holder);
                    if (pair == NULL || PyList_Append(replays, pair) < 0) {
                        rc = -1;
                        replay = 0; /* not handed out: fail it below rather than lose it */
                    }
                    Py_XDECREF(pair);
                }
            }
            rl_metrics *metrics = metrics_of(self);
            if (metrics != NULL && replay == 1)
                rl_metrics_count(&metrics->replays);
            else if (metrics != NULL && waiting && rl_script_decides(e.decision->script))
                rl_metrics_count(&metrics->unavailable); /* its caller hears of the failure */
            if (replay != 1) {
                if (rc < 0) {
                    /* Keep the first error; the future still hears of the broken connection. */
                    PyObject *t, *v, *tb;
                    PyErr_Fetch(&t, &v, &tb);
                    (void)resolve(state, future, Py_NewRef(exc), 1);
                    PyErr_Clear();
                    PyErr_Restore(t, v, tb);
                } else if (e.step == RL_STEP_WAIT) {
                    rc = resolve(state, future, wait_failure(state, exc, cause), 1);
                } else if (e.step == RL_STEP_COMMAND && e.holder != NULL) {
                    rc = resolve(state, future, Py_NewRef(Py_None), 0); /* the read took it */
                } else if (e.step == RL_STEP_DECISION && waiting &&
                           ((RequestObject *)e.holder)->route != NULL) {
                    rc = resolve(
                        state, future,
                        routed_failure(state, ((RequestObject *)e.holder)->route, exc, cause), 1);
                } else {
                    rc = resolve(state, future, Py_NewRef(exc), 1);
                }
            }
        }
        if (rc < 0) {
            /* Keep failing the others: report the first error at the end. */
            if (!failed)
                PyErr_Fetch(&first_type, &first_value, &first_tb);
            else
                PyErr_Clear();
            failed = 1;
        }
        release_entry(&e);
    }
    if (failed) {
        PyErr_Restore(first_type, first_value, first_tb);
        return -1;
    }
    return 0;
}

/* Checks (exception, status) at args[first]; *cause: the status. 0, or -1 with TypeError
   or ValueError. */
static int
exception_and_status(const char *name, Py_ssize_t nargs, PyObject *kwnames, PyObject *const *args,
                     Py_ssize_t first, rl_status *cause)
{
    if (nargs != first + 2 || (kwnames != NULL && PyTuple_Size(kwnames) != 0)) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd positional arguments", name, first + 2);
        return -1;
    }
    if (!PyExceptionInstance_Check(args[first])) {
        PyErr_Format(PyExc_TypeError, "%s() needs an exception instance", name);
        return -1;
    }
    long status = PyLong_AsLong(args[first + 1]);
    if (status == -1 && PyErr_Occurred())
        return -1;
    if (status <= RL_OK || status > RL_ERR_REDIRECT) {
        PyErr_Format(PyExc_ValueError, "%s(): status must be one of the STATUS_* constants", name);
        return -1;
    }
    *cause = (rl_status)status;
    return 0;
}

PyDoc_STRVAR(Pipeline_fail_all_doc,
"fail_all($self, exception, status, /)\n--\n\n"
"Fails every pending future with the exception (those not done yet) and forgets them;\n"
"the queued bytes are dropped too. status: why (a STATUS_* constant); a WAIT's future\n"
"gets the engine's judgement of that failure (fail_wait).");

static PyObject *
Pipeline_fail_all(PipelineObject *self, PyTypeObject *defining_class, PyObject *const *args,
                  Py_ssize_t nargs, PyObject *kwnames)
{
    rl_status cause;
    if (exception_and_status("fail_all", nargs, kwnames, args, 0, &cause) < 0 || !ready(self))
        return NULL;
    if (pop_all(self, PyType_GetModuleState(defining_class), args[0], cause, NULL) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Pipeline_fail_wait_doc,
"fail_wait($self, future, exception, status, /)\n--\n\n"
"Fails the future of a WAIT that was never sent (push_wait) as the engine judges a WAIT\n"
"cut off by exception, whose rl_status is status: a broken connection is \"not\n"
"replicated\", anything else (a timeout, a closed limiter) is the exception itself.");

static PyObject *
Pipeline_fail_wait(PipelineObject *self, PyTypeObject *defining_class, PyObject *const *args,
                   Py_ssize_t nargs, PyObject *kwnames)
{
    rl_module_state *state = PyType_GetModuleState(defining_class);
    rl_status cause;
    if (exception_and_status("fail_wait", nargs, kwnames, args, 1, &cause) < 0 || !ready(self))
        return NULL;
    if (resolve(state, args[0], wait_failure(state, args[1], cause), 1) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Pipeline_take_replays_doc,
"take_replays($self, exception, /)\n--\n\n"
"For a connection that broke (STATUS_IO): empties the FIFO, switches each waiting decision\n"
"that the replay rule sends again (once, marked) to its replay form and returns those as\n"
"[(future, request)], oldest first; every other waiting future fails with exception (a\n"
"WAIT's with the engine's judgement of it).");

static PyObject *
Pipeline_take_replays(PipelineObject *self, PyTypeObject *defining_class, PyObject *const *args,
                      Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs != 1 || (kwnames != NULL && PyTuple_Size(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "take_replays(exception) takes 1 positional argument");
        return NULL;
    }
    if (!PyExceptionInstance_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "take_replays() needs an exception instance");
        return NULL;
    }
    if (!ready(self))
        return NULL;
    PyObject *replays = PyList_New(0);
    if (replays == NULL)
        return NULL;
    if (pop_all(self, PyType_GetModuleState(defining_class), args[0], RL_ERR_IO, replays) < 0) {
        Py_DECREF(replays);
        return NULL;
    }
    return replays;
}

PyDoc_STRVAR(Pipeline_oldest_deadline_doc,
"oldest_deadline($self, /)\n--\n\n"
"The time.monotonic() by which the oldest pending reply is due, or None when nothing is\n"
"pending. Replies come in order, so it is the first to expire.");

static PyObject *
Pipeline_oldest_deadline(PipelineObject *self, PyObject *Py_UNUSED(ignored))
{
    if (!ready(self))
        return NULL;
    if (rl_proto_pending(&self->proto) == 0)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(rl_proto_oldest_deadline(&self->proto));
}

PyDoc_STRVAR(Pipeline_idle_is_stale_doc,
"idle_is_stale($self, fd, /)\n--\n\n"
"True when the connection is idle (nothing pending) yet bytes nobody asked for wait on it:\n"
"buffered here, or readable on fd (a stray reply, a server's EOF); then it must be\n"
"dropped before a check could take them for its answer. fd < 0 skips the poll(). The\n"
"blocking limiter applies the same test to its pooled connections.");

static PyObject *
Pipeline_idle_is_stale(PipelineObject *self, PyObject *arg)
{
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (fd > 1L << 30)
        fd = -1; /* not a descriptor this process can have */
    if (!ready(self))
        return NULL;
    return PyBool_FromLong(rl_proto_idle_is_stale(&self->proto, (int)fd));
}

static PyObject *
Pipeline_get_eviction_warning(PipelineObject *self, void *Py_UNUSED(closure))
{
    char warning[RL_WARNING_LEN];
    if (self->proto.reader == NULL || !self->proto.info_answered)
        Py_RETURN_NONE;
    rl_proto_eviction_warning(&self->proto, warning, sizeof(warning));
    return PyUnicode_FromString(warning);
}

static PyObject *
Pipeline_get_pending(PipelineObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(self->proto.reader != NULL ? rl_proto_pending(&self->proto) : 0);
}

#ifdef RL_DEBUG_HOOKS
PyDoc_STRVAR(Pipeline_debug_fail_allocation_doc,
"_debug_fail_allocation($self, n, /)\n--\n\n"
"Debug and sanitized builds only: the n-th allocation of the engine from now fails as if\n"
"memory ran out (0: none), so that the tests can drive every out-of-memory path.");

static PyObject *
Pipeline_debug_fail_allocation(PipelineObject *self, PyObject *arg)
{
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0 || n > 1000000) {
        PyErr_SetString(PyExc_ValueError, "n must be between 0 and 1000000");
        return NULL;
    }
    if (!ready(self))
        return NULL;
    self->proto.fail_allocation = (int)n;
    Py_RETURN_NONE;
}
#endif

static PyMethodDef Pipeline_methods[] = {
    {"handshake", (PyCFunction)(void (*)(void))Pipeline_handshake, METH_VARARGS | METH_KEYWORDS,
     Pipeline_handshake_doc},
    {"push", (PyCFunction)(void (*)(void))Pipeline_push,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Pipeline_push_doc},
    {"push_command", (PyCFunction)(void (*)(void))Pipeline_push_command,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Pipeline_push_command_doc},
    {"take", (PyCFunction)Pipeline_take, METH_NOARGS, Pipeline_take_doc},
    {"feed", (PyCFunction)(void (*)(void))Pipeline_feed,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Pipeline_feed_doc},
    {"push_question", (PyCFunction)(void (*)(void))Pipeline_push_question,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Pipeline_push_question_doc},
    {"push_wait", (PyCFunction)(void (*)(void))Pipeline_push_wait,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Pipeline_push_wait_doc},
    {"fail_all", (PyCFunction)(void (*)(void))Pipeline_fail_all,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Pipeline_fail_all_doc},
    {"fail_wait", (PyCFunction)(void (*)(void))Pipeline_fail_wait,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Pipeline_fail_wait_doc},
    {"take_replays", (PyCFunction)(void (*)(void))Pipeline_take_replays,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Pipeline_take_replays_doc},
    {"oldest_deadline", (PyCFunction)Pipeline_oldest_deadline, METH_NOARGS,
     Pipeline_oldest_deadline_doc},
    {"idle_is_stale", (PyCFunction)Pipeline_idle_is_stale, METH_O, Pipeline_idle_is_stale_doc},
#ifdef RL_DEBUG_HOOKS
    {"_debug_fail_allocation", (PyCFunction)Pipeline_debug_fail_allocation, METH_O,
     Pipeline_debug_fail_allocation_doc},
#endif
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Pipeline_getset[] = {
    {"pending", (getter)Pipeline_get_pending, NULL, "Replies still due.", NULL},
    {"eviction_warning", (getter)Pipeline_get_eviction_warning, NULL,
     "None until INFO memory was answered; then the warning to log once when Redis may "
     "evict the limiter's keys, or \"\".",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Pipeline_slots[] = {
    {Py_tp_doc, "Pipeline(timeout, *, codec=None)\n--\n\n"
                "The protocol state of one asyncio connection; codec: whose counters it "
                "updates."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, Pipeline_init},
    {Py_tp_dealloc, Pipeline_dealloc},
    {Py_tp_traverse, Pipeline_traverse},
    {Py_tp_clear, Pipeline_clear},
    {Py_tp_methods, Pipeline_methods},
    {Py_tp_getset, Pipeline_getset},
    {0, NULL},
};

PyType_Spec rl_pipeline_spec = {
    .name = "genai_ratelimit._native.Pipeline",
    .basicsize = sizeof(PipelineObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Pipeline_slots,
};
