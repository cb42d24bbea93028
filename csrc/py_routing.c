/*
 * py_routing.c - the asyncio limiter's face of the router (router.c): the types Router,
 * Route and RouteRead of genai_ratelimit._native, driven by aio.py the way cluster.c
 * drives the router over blocking sockets.
 *
 *   Router     the routing state of one AsyncRateLimiter (shared by its event loops).
 *   Route      one call: next() says what to do (send to a node, read the map, wait, give
 *              up); failed(exc) hands a failed try back.
 *   RouteRead  one read of the map or of the sentinels: step() says what to ask whom,
 *              and takes each reply (or the exception of a failed question).
 *
 * Replies and failures reach the router as C values, never through Python objects: the
 * Pipeline of py_codec.c hands a question's redisReply, or its rl_status and rl_error, to the
 * RouteRead that asked it (rl_routing_answer), and a routed decision's failure to its
 * Route (rl_routing_failed), both here. aio.py names the status of the failures it meets
 * itself (a connection it could not open, a question that timed out): Route.failed(status,
 * exc), RouteRead.failed(status, exc).
 *
 * GIL contract: every function here runs with the GIL held (the router's calls take its
 * own mutex briefly and never block). Nothing here does I/O.
 */
#include "native.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    rl_router router;
} RouterObject;

typedef struct {
    PyObject_HEAD
    RouterObject *owner; /* strong */
    rl_route route;
    int go_on; /* the failure of the try under way was handed over: the call goes on */
} RouteObject;

typedef struct {
    PyObject_HEAD
    RouterObject *owner; /* strong */
    RouteObject *call;   /* strong, or NULL: the call this read is for */
    rl_read read;
    int more;  /* rl_read_step left a question in read.q */
    int out;   /* that question was handed to a Pipeline, which answers it */
    int ended; /* rl_read_end was called */
} RouteReadObject;

/* ------------------------------------------------------------- failures */

/* The failure an aio.py exception reports, with the status its caller names (a STATUS_*
   constant) and the exception's text. 0, or -1 with TypeError / ValueError set. */
static int
named_failure(PyObject *status, PyObject *exc, rl_error *err)
{
    long kind = PyLong_AsLong(status);
    if (kind == -1 && PyErr_Occurred())
        return -1;
    if (kind <= RL_OK || kind > RL_ERR_REDIRECT) {
        PyErr_SetString(PyExc_ValueError, "status must be one of the STATUS_* constants");
        return -1;
    }
    if (!PyExceptionInstance_Check(exc)) {
        PyErr_SetString(PyExc_TypeError, "exc must be an exception instance");
        return -1;
    }
    rl_error_from(exc, (rl_status)kind, err);
    return 0;
}

/* ---------------------------------------------------------------- Router */

static PyObject *
Router_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"nodes", "tls", "master_name", "socket_timeout", NULL};
    PyObject *nodes;
    int tls = 0;
    const char *master_name = NULL;
    double socket_timeout = 1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|pzd", keywords, &nodes, &tls, &master_name,
                                     &socket_timeout))
        return NULL;
    if (rl_check_timeout("socket_timeout", socket_timeout) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(nodes, "nodes must be a sequence of (host, port)");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = rl_seq_size(seq);
    RouterObject *self = NULL;
    if (n < 1 || n > RL_CLUSTER_MAX_NODES) {
        PyErr_Format(PyExc_ValueError, "a router needs 1 to %d nodes", RL_CLUSTER_MAX_NODES);
        goto error;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    if ((self = (RouterObject *)alloc(type, 0)) == NULL)
        goto error;
    if (rl_router_init(&self->router, master_name, tls, socket_timeout) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto error;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *host;
        int port;
        if (!PyArg_ParseTuple(rl_seq_item(seq, i), "si;nodes holds (host, port) pairs", &host,
                              &port))
            goto error;
        if (port < 1 || port > 65535) {
            PyErr_Format(PyExc_ValueError, "port must be between 1 and 65535, got %d", port);
            goto error;
        }
        if (rl_router_add_seed(&self->router, host, port) < 0) {
            PyErr_Format(PyExc_ValueError, "cannot add the node %.200s:%d", host, port);
            goto error;
        }
    }
    Py_DECREF(seq);
    return (PyObject *)self;
error:
    Py_DECREF(seq);
    Py_XDECREF(self);
    return NULL;
}

static void
Router_dealloc(RouterObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    rl_router_destroy(&self->router);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(self);
    Py_DECREF(tp);
}

static PyObject *
address_tuple(RouterObject *self, int sentinel, int index)
{
    rl_address a;
    if (rl_router_address(&self->router, sentinel, index, &a) < 0) {
        PyErr_Format(PyExc_IndexError, "no %s %d", sentinel ? "sentinel" : "node", index);
        return NULL;
    }
    return Py_BuildValue("(si)", a.host, a.port);
}

PyDoc_STRVAR(Router_address_doc, "address($self, node, /)\n--\n\n"
                                 "The (host, port) of a node the router named.");

static PyObject *
Router_address(RouterObject *self, PyObject *arg)
{
    int index = (int)PyLong_AsLong(arg);
    if (index == -1 && PyErr_Occurred())
        return NULL;
    return address_tuple(self, 0, index);
}

PyDoc_STRVAR(Router_sentinel_doc, "sentinel($self, index, /)\n--\n\n"
                                  "The (host, port) of a sentinel of the URL.");

static PyObject *
Router_sentinel(RouterObject *self, PyObject *arg)
{
    int index = (int)PyLong_AsLong(arg);
    if (index == -1 && PyErr_Occurred())
        return NULL;
    return address_tuple(self, 1, index);
}

PyDoc_STRVAR(Router_destination_doc,
             "destination($self, slot, /)\n--\n\n"
             "The node a decision of this hash slot goes to now (Sentinel: the master), or -1.");

static PyObject *
Router_destination(RouterObject *self, PyObject *arg)
{
    int slot = (int)PyLong_AsLong(arg);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    return PyLong_FromLong(rl_router_destination(&self->router, slot));
}

PyDoc_STRVAR(Router_masters_doc, "masters($self, /)\n--\n\n"
                                 "The nodes that serve slots now (Sentinel: the master), once each.");

static PyObject *
Router_masters(RouterObject *self, PyObject *Py_UNUSED(ignored))
{
    int nodes[RL_CLUSTER_MAX_NODES];
    int n = rl_router_masters(&self->router, nodes, RL_CLUSTER_MAX_NODES);
    PyObject *list = PyList_New(n);
    for (int i = 0; list != NULL && i < n; i++) {
        PyObject *item = PyLong_FromLong(nodes[i]);
        if (item == NULL || PyList_SetItem(list, i, item) < 0) {
            Py_CLEAR(list);
        }
    }
    return list;
}

PyDoc_STRVAR(Router_route_doc,
             "route($self, slot, deadline, /)\n--\n\n"
             "A Route for one call of this hash slot, by deadline (time.monotonic() seconds).");

static PyObject *
Router_route(RouterObject *self, PyTypeObject *defining_class, PyObject *const *args,
             Py_ssize_t nargs, PyObject *kwnames)
{
    rl_module_state *state = PyType_GetModuleState(defining_class);
    if (nargs != 2 || (kwnames != NULL && PyTuple_Size(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "route(slot, deadline) takes 2 positional arguments");
        return NULL;
    }
    long slot = PyLong_AsLong(args[0]);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    double deadline = PyFloat_AsDouble(args[1]);
    if (deadline == -1 && PyErr_Occurred())
        return NULL;
    if (slot < -1 || slot >= RL_CLUSTER_SLOTS) { /* -1: no slot (Sentinel) */
        PyErr_Format(PyExc_ValueError, "slot must be between -1 and %d", RL_CLUSTER_SLOTS - 1);
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(state->RouteType, Py_tp_alloc);
    RouteObject *route = (RouteObject *)alloc(state->RouteType, 0);
    if (route == NULL)
        return NULL;
    route->owner = (RouterObject *)Py_NewRef(self);
    rl_route_begin(&route->route, (int)slot, deadline);
    return (PyObject *)route;
}

PyDoc_STRVAR(Router_read_doc,
             "read($self, deadline, route=None, /)\n--\n\n"
             "A RouteRead of the map (or of the sentinels) by deadline. Only after\n"
             "Route.next() answered ROUTE_READ, or to read outside any call: the read that a\n"
             "route asked for keeps its outcome for that route.");

static PyObject *
Router_read(RouterObject *self, PyTypeObject *defining_class, PyObject *const *args,
            Py_ssize_t nargs, PyObject *kwnames)
{
    rl_module_state *state = PyType_GetModuleState(defining_class);
    if (nargs < 1 || nargs > 2 || (kwnames != NULL && PyTuple_Size(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "read(deadline, route=None) takes 1 or 2 arguments");
        return NULL;
    }
    double deadline = PyFloat_AsDouble(args[0]);
    if (deadline == -1 && PyErr_Occurred())
        return NULL;
    PyObject *call = nargs == 2 ? args[1] : Py_None;
    if (call != Py_None && !Py_IS_TYPE(call, state->RouteType)) {
        PyErr_SetString(PyExc_TypeError, "route must be a Route or None");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(state->RouteReadType, Py_tp_alloc);
    RouteReadObject *read = (RouteReadObject *)alloc(state->RouteReadType, 0);
    if (read == NULL)
        return NULL;
    read->owner = (RouterObject *)Py_NewRef(self);
    read->call = call == Py_None ? NULL : (RouteObject *)Py_NewRef(call);
    rl_read_begin(&self->router, &read->read, deadline);
    return (PyObject *)read;
}

static PyObject *
Router_get_master_name(RouterObject *self, void *Py_UNUSED(closure))
{
    if (self->router.master_name == NULL)
        Py_RETURN_NONE;
    return PyUnicode_FromString(self->router.master_name);
}

static PyMethodDef Router_methods[] = {
    {"address", (PyCFunction)Router_address, METH_O, Router_address_doc},
    {"sentinel", (PyCFunction)Router_sentinel, METH_O, Router_sentinel_doc},
    {"destination", (PyCFunction)Router_destination, METH_O, Router_destination_doc},
    {"masters", (PyCFunction)Router_masters, METH_NOARGS, Router_masters_doc},
    {"route", (PyCFunction)(void (*)(void))Router_route,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Router_route_doc},
    {"read", (PyCFunction)(void (*)(void))Router_read, METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     Router_read_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Router_getset[] = {
    {"master_name", (getter)Router_get_master_name, NULL,
     "The sentinels' name of the master, or None for a Redis Cluster.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Router_slots[] = {
    {Py_tp_doc, "Router(nodes, tls=False, master_name=None, socket_timeout=1.0)\n--\n\n"
                "The routing of a Redis Cluster (nodes: seeds) or a Sentinel set (nodes: the\n"
                "sentinels, master_name set), with no I/O: csrc/router.c."},
    {Py_tp_new, Router_new},
    {Py_tp_dealloc, Router_dealloc},
    {Py_tp_methods, Router_methods},
    {Py_tp_getset, Router_getset},
    {0, NULL},
};

PyType_Spec rl_router_spec = {
    .name = "genai_ratelimit._native.Router",
    .basicsize = sizeof(RouterObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Router_slots,
};

/* ----------------------------------------------------------------- Route */

static void
Route_dealloc(RouteObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    Py_XDECREF(self->owner);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(self);
    Py_DECREF(tp);
}

PyDoc_STRVAR(Route_next_doc,
             "next($self, /)\n--\n\n"
             "What the call does next: (ROUTE_SEND, node, asking), (ROUTE_READ, deadline,\n"
             "False): read with Router.read(deadline, route), (ROUTE_WAIT, seconds, False), or\n"
             "(ROUTE_FAIL, 0, False): raise the error of the last try. Raises the router's\n"
             "own error when it says more (a cluster that stayed busy, a failover under way,\n"
             "no node for the slot, what the read for it met).");

static PyObject *
Route_next(RouteObject *self, PyTypeObject *defining_class, PyObject *const *Py_UNUSED(args),
           Py_ssize_t nargs, PyObject *kwnames)
{
    rl_module_state *state = PyType_GetModuleState(defining_class);
    if (nargs != 0 || (kwnames != NULL && PyTuple_Size(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "next() takes no arguments");
        return NULL;
    }
    rl_error err = {RL_OK, ""};
    rl_route *rt = &self->route;
    self->go_on = 0; /* a new try: its failure is yet to be handed over */
    switch (rl_route_next(&self->owner->router, rt, &err)) {
    case RL_ROUTE_SEND:
        return Py_BuildValue("(iiO)", (int)RL_ROUTE_SEND, rt->node,
                             rt->asking ? Py_True : Py_False);
    case RL_ROUTE_READ:
        return Py_BuildValue("(idO)", (int)RL_ROUTE_READ, rt->read_deadline, Py_False);
    case RL_ROUTE_WAIT:
        return Py_BuildValue("(idO)", (int)RL_ROUTE_WAIT, rt->seconds, Py_False);
    case RL_ROUTE_FAIL:
    default:
        if (err.kind != RL_OK)
            return rl_raise(state, &err);
        return Py_BuildValue("(iiO)", (int)RL_ROUTE_FAIL, 0, Py_False);
    }
}

int
rl_routing_failed(PyObject *route, rl_status st, rl_error *err)
{
    RouteObject *self = (RouteObject *)route;
    self->go_on = rl_route_failed(&self->owner->router, &self->route, st, err);
    if (self->go_on)
        return 1;
    return self->route.own_error ? -1 : 0;
}

PyDoc_STRVAR(Route_failed_doc,
             "failed($self, status, exc, /)\n--\n\n"
             "The try failed with exc before its request reached a Pipeline (no connection to\n"
             "send it on, or a replay that found none), status naming why (STATUS_*). True:\n"
             "ask next() again; False: raise exc; raises the router's own error when it says\n"
             "more. A failure the Pipeline met went to the route already (go_on).");

static PyObject *
Route_failed(RouteObject *self, PyTypeObject *defining_class, PyObject *const *args,
             Py_ssize_t nargs, PyObject *kwnames)
{
    rl_module_state *state = PyType_GetModuleState(defining_class);
    if (nargs != 2 || (kwnames != NULL && PyTuple_Size(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "failed(status, exc) takes 2 positional arguments");
        return NULL;
    }
    rl_error err;
    if (named_failure(args[0], args[1], &err) < 0)
        return NULL;
    int outcome = rl_routing_failed((PyObject *)self, err.kind, &err);
    if (outcome < 0)
        return rl_raise(state, &err); /* the router's own error */
    return PyBool_FromLong(outcome);
}

static PyObject *
Route_get_go_on(RouteObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->go_on);
}

static PyObject *
Route_get_deadline(RouteObject *self, void *Py_UNUSED(closure))
{
    return PyFloat_FromDouble(self->route.deadline);
}

static PyMethodDef Route_methods[] = {
    {"next", (PyCFunction)(void (*)(void))Route_next, METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     Route_next_doc},
    {"failed", (PyCFunction)(void (*)(void))Route_failed,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Route_failed_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Route_getset[] = {
    {"deadline", (getter)Route_get_deadline, NULL, "The call's deadline (time.monotonic()).", NULL},
    {"go_on", (getter)Route_get_go_on, NULL,
     "True when the failure of the try under way (since next()), handed to the route by a\n"
     "Pipeline or by failed(), lets the call go on: ask next() again.",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Route_slots[] = {
    {Py_tp_doc, "One call's route through a Router (Router.route)."},
    {Py_tp_dealloc, Route_dealloc},
    {Py_tp_methods, Route_methods},
    {Py_tp_getset, Route_getset},
    {0, NULL},
};

PyType_Spec rl_route_spec = {
    .name = "genai_ratelimit._native.Route",
    .basicsize = sizeof(RouteObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Route_slots,
};

/* ------------------------------------------------------------- RouteRead */

static void
read_end(RouteReadObject *self)
{
    if (!self->ended) {
        self->ended = 1;
        rl_read_end(&self->owner->router, &self->read,
                    self->call != NULL ? &self->call->route : NULL);
    }
}

static void
RouteRead_dealloc(RouteReadObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    if (self->owner != NULL)
        read_end(self); /* a read abandoned (a cancelled task): the single flight is free */
    Py_XDECREF(self->call);
    Py_XDECREF(self->owner);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(self);
    Py_DECREF(tp);
}

/* Hands the answer to the question out to the router: 1 when another question follows. */
static void
answer_read(RouteReadObject *self, rl_status st, const redisReply *reply, const rl_error *err)
{
    self->out = 0;
    if (self->ended || !self->more)
        return; /* the read moved on: nobody asked this any more */
    self->more = rl_read_step(&self->owner->router, &self->read, st, reply, err);
}

void
rl_routing_answer(PyObject *read, rl_status st, const redisReply *reply, const rl_error *err)
{
    answer_read((RouteReadObject *)read, st, reply, err);
}

const rl_question *
rl_routing_question(PyObject *read)
{
    RouteReadObject *self = (RouteReadObject *)read;
    if (self->ended || !self->read.started || !self->more || self->out)
        return NULL;
    self->out = 1;
    return &self->read.q;
}

PyDoc_STRVAR(RouteRead_question_doc,
             "question($self, /)\n--\n\n"
             "The question to ask now, (sentinel, index, deadline): sentinel True when index\n"
             "is a sentinel's, deadline its share (time.monotonic()); None when the read is\n"
             "over. Ask it with Pipeline.push_question(future, read): the reply goes to the\n"
             "router from there. The first call starts the read.");

static PyObject *
RouteRead_question(RouteReadObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->ended) {
        PyErr_SetString(PyExc_ValueError, "the read is over");
        return NULL;
    }
    if (!self->read.started) {
        rl_error err = {RL_OK, ""};
        self->more = rl_read_step(&self->owner->router, &self->read, RL_OK, NULL, &err);
    }
    if (!self->more)
        Py_RETURN_NONE;
    const rl_question *q = &self->read.q;
    return Py_BuildValue("(Oid)", q->sentinel ? Py_True : Py_False, q->target, q->deadline);
}

PyDoc_STRVAR(RouteRead_failed_doc,
             "failed($self, status, exc, /)\n--\n\n"
             "The question now was never answered, for a reason the driver met itself (no\n"
             "connection to ask it on, no answer within its share), status naming it\n"
             "(STATUS_*). Not for a question handed to a Pipeline: that one answers it.");

static PyObject *
RouteRead_failed(RouteReadObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    rl_error err;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "failed(status, exc) takes 2 positional arguments");
        return NULL;
    }
    if (named_failure(args[0], args[1], &err) < 0)
        return NULL;
    if (self->ended || !self->read.started || !self->more || self->out) {
        PyErr_SetString(PyExc_ValueError, "no question of this read waits for its answer here");
        return NULL;
    }
    answer_read(self, err.kind, NULL, &err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(RouteRead_end_doc,
             "end($self, /)\n--\n\n"
             "Ends the read (frees the single flight; always call it). Returns the node that\n"
             "was the master before a Sentinel switch (close its connections), or -1.");

static PyObject *
RouteRead_end(RouteReadObject *self, PyObject *Py_UNUSED(ignored))
{
    read_end(self);
    return PyLong_FromLong(self->read.replaced);
}

PyDoc_STRVAR(RouteRead_error_doc,
             "error($self, /)\n--\n\n"
             "None when the read succeeded, else the exception that says why (not raised).");

static PyObject *
RouteRead_error(RouteReadObject *self, PyTypeObject *defining_class,
                PyObject *const *Py_UNUSED(args), Py_ssize_t nargs, PyObject *kwnames)
{
    rl_module_state *state = PyType_GetModuleState(defining_class);
    if (nargs != 0 || (kwnames != NULL && PyTuple_Size(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "error() takes no arguments");
        return NULL;
    }
    if (self->read.status == RL_OK)
        Py_RETURN_NONE;
    return rl_exception(state, &self->read.error);
}

static PyMethodDef RouteRead_methods[] = {
    {"question", (PyCFunction)RouteRead_question, METH_NOARGS, RouteRead_question_doc},
    {"failed", (PyCFunction)(void (*)(void))RouteRead_failed, METH_FASTCALL, RouteRead_failed_doc},
    {"end", (PyCFunction)RouteRead_end, METH_NOARGS, RouteRead_end_doc},
    {"error", (PyCFunction)(void (*)(void))RouteRead_error,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, RouteRead_error_doc},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot RouteRead_slots[] = {
    {Py_tp_doc, "One read of a Router's map or sentinels (Router.read)."},
    {Py_tp_dealloc, RouteRead_dealloc},
    {Py_tp_methods, RouteRead_methods},
    {0, NULL},
};

PyType_Spec rl_route_read_spec = {
    .name = "genai_ratelimit._native.RouteRead",
    .basicsize = sizeof(RouteReadObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = RouteRead_slots,
};
