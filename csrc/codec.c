/*
 * codec.c - the C half of the asyncio limiter (genai_ratelimit/aio.py).
 *
 *   Codec     validates a check and formats its EVALSHA exactly like the blocking limiter
 *             (args.c), returning either the kill switch's final answer or a Request.
 *   Request   one formatted decision: the command bytes and its windows.
 *   Pipeline  the protocol state of one connection: the bytes waiting to be written and
 *             the FIFO of requests whose replies are due, each with its future. feed()
 *             parses replies (hiredis redisReader) and resolves the futures in order;
 *             NOSCRIPT is answered by queueing SCRIPT LOAD and the same command again.
 *
 * The event loop moves the bytes (an asyncio.Protocol in aio.py); nothing here does I/O,
 * blocks, or releases the GIL. Every function runs with the GIL held and raises Python
 * exceptions. A future that was cancelled keeps its place in the FIFO: its reply is read
 * and dropped, so the connection never falls out of step.
 */
#include "native.h"
#include "script_source.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------ Request */

typedef struct {
    PyObject_HEAD
    rl_prepared prepared;        /* windows + formatted command (owned) */
    int with_window;             /* result has 4 items (check_windows) or 3 (check) */
    char *replay;                /* the command with the replay marker, once replayed */
    size_t replay_len;
} RequestObject;

/* The bytes to send for this request: the replay form once it was marked for replay. */
static const char *
request_bytes(const RequestObject *req, size_t *len)
{
    if (req->replay != NULL) {
        *len = req->replay_len;
        return req->replay;
    }
    *len = (size_t)req->prepared.command_len;
    return req->prepared.command;
}

PyDoc_STRVAR(Request_mark_replay_doc,
"mark_replay() -> bool\n\nSwitches the request to its replay form (the script answers "
"\"already counted\" if the first attempt logged it). False when it was replayed already: "
"a request is replayed at most once.");

static PyObject *
Request_mark_replay(RequestObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->replay != NULL)
        Py_RETURN_FALSE;
    self->replay = rl_script_replay_command(self->prepared.command,
                                            (size_t)self->prepared.command_len, &self->replay_len);
    if (self->replay == NULL)
        return PyErr_NoMemory();
    Py_RETURN_TRUE;
}

static PyMethodDef Request_methods[] = {
    {"mark_replay", (PyCFunction)Request_mark_replay, METH_NOARGS, Request_mark_replay_doc},
    {NULL, NULL, 0, NULL},
};

static void
Request_dealloc(RequestObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    free(self->replay);
    rl_prepared_clear(&self->prepared);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *
Request_get_command(RequestObject *self, void *Py_UNUSED(closure))
{
    if (self->prepared.command == NULL)
        Py_RETURN_NONE;
    return PyBytes_FromStringAndSize(self->prepared.command, (Py_ssize_t)self->prepared.command_len);
}

static PyGetSetDef Request_getset[] = {
    {"command", (getter)Request_get_command, NULL, "The RESP-encoded EVALSHA.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Request_slots[] = {
    {Py_tp_doc, "One formatted rate-limit decision, made by Codec."},
    {Py_tp_dealloc, Request_dealloc},
    {Py_tp_getset, Request_getset},
    {Py_tp_methods, Request_methods},
    {0, NULL},
};

PyType_Spec rl_request_spec = {
    .name = "genai_ratelimit._native.Request",
    .basicsize = sizeof(RequestObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Request_slots,
};

/* -------------------------------------------------------------------- Codec */

typedef struct {
    PyObject_HEAD
    char *key_prefix;            /* UTF-8, owned */
    size_t key_prefix_len;
    int client_clock;
} CodecObject;

static int
Codec_init(CodecObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"key_prefix", "client_clock", NULL};
    const char *prefix;
    Py_ssize_t prefix_len;
    int client_clock = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s#|$p", keywords, &prefix, &prefix_len,
                                     &client_clock))
        return -1;
    if (prefix_len == 0) {
        PyErr_SetString(PyExc_ValueError, "key_prefix must not be empty");
        return -1;
    }
    char *copy = PyMem_RawMalloc((size_t)prefix_len + 1);
    if (copy == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(copy, prefix, (size_t)prefix_len + 1);
    PyMem_RawFree(self->key_prefix);
    self->key_prefix = copy;
    self->key_prefix_len = (size_t)prefix_len;
    self->client_clock = client_clock;
    return 0;
}

static void
Codec_dealloc(CodecObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyMem_RawFree(self->key_prefix);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* Returns the kill switch's result tuple, or a new Request. */
static PyObject *
encode(CodecObject *self, PyTypeObject *defining_class, PyObject *user_id, rl_windows *windows,
       int with_window)
{
    rl_module_state *state = PyType_GetModuleState(defining_class);
    RequestObject *req;
    rl_prepared p;
    if (self->key_prefix == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the codec was not initialised");
        return NULL;
    }
    p.windows = *windows;
    if (rl_prepare(state, self->key_prefix, self->key_prefix_len, self->client_clock, user_id, &p) < 0)
        return NULL;
    if (p.disabled)
        return rl_result_tuple(&p.windows, &p.result, with_window);
    req = PyObject_New(RequestObject, state->RequestType);
    if (req == NULL) {
        rl_prepared_clear(&p);
        return NULL;
    }
    req->prepared = p; /* takes ownership of the command */
    req->with_window = with_window;
    req->replay = NULL;
    req->replay_len = 0;
    return (PyObject *)req;
}

static PyObject *
Codec_check(CodecObject *self, PyTypeObject *defining_class, PyObject *const *args,
            Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"user_id", "limit", "window_seconds"};
    PyObject *values[3];
    rl_windows w;
    Py_ssize_t unused;
    if (rl_parse_args("check", args, nargs, kwnames, names, 3, values) < 0)
        return NULL;
    if (rl_user_id_utf8(values[0], &unused) == NULL)
        return NULL;
    if (rl_windows_from_pair(&w, values[1], values[2]) < 0)
        return NULL;
    return encode(self, defining_class, values[0], &w, 0);
}

static PyObject *
Codec_check_windows(CodecObject *self, PyTypeObject *defining_class, PyObject *const *args,
                    Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"user_id", "windows"};
    PyObject *values[2];
    rl_windows w;
    Py_ssize_t unused;
    if (rl_parse_args("check_windows", args, nargs, kwnames, names, 2, values) < 0)
        return NULL;
    if (rl_user_id_utf8(values[0], &unused) == NULL)
        return NULL;
    if (rl_windows_from_sequence(&w, values[1]) < 0)
        return NULL;
    return encode(self, defining_class, values[0], &w, 1);
}

static PyMethodDef Codec_methods[] = {
    {"check", (PyCFunction)(void (*)(void))Codec_check, METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     "check(user_id, limit, window_seconds) -> Request, or the kill switch's final tuple"},
    {"check_windows", (PyCFunction)(void (*)(void))Codec_check_windows,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     "check_windows(user_id, windows) -> Request, or the kill switch's final tuple"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Codec_slots[] = {
    {Py_tp_doc, "Codec(key_prefix, *, client_clock=False): validates checks and formats them."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, Codec_init},
    {Py_tp_dealloc, Codec_dealloc},
    {Py_tp_methods, Codec_methods},
    {0, NULL},
};

PyType_Spec rl_codec_spec = {
    .name = "genai_ratelimit._native.Codec",
    .basicsize = sizeof(CodecObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = Codec_slots,
};

/* ----------------------------------------------------------------- Pipeline */

enum { ENTRY_DECISION, ENTRY_SCRIPT_LOAD, ENTRY_COMMAND };

typedef struct {
    int kind;                    /* ENTRY_* */
    int attempts;                /* NOSCRIPT retries done for a decision */
    double deadline;             /* monotonic seconds by which the reply is due */
    PyObject *future;            /* strong; NULL for an internal SCRIPT LOAD */
    RequestObject *request;      /* strong; decisions only */
} pl_entry;

typedef struct {
    PyObject_HEAD
    redisReader *reader;         /* RESP parser of this connection's replies */
    pl_entry *ring;              /* FIFO of replies due, in send order */
    size_t capacity, head, count;
    size_t unsent;               /* trailing entries whose bytes take() has not handed out */
    char *out;                   /* bytes queued for the next write */
    size_t out_len, out_capacity;
    double timeout;              /* seconds a reply may take */
} PipelineObject;

static int
Pipeline_init(PipelineObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"timeout", NULL};
    double timeout;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "d", keywords, &timeout))
        return -1;
    if (!(timeout > 0)) {
        PyErr_SetString(PyExc_ValueError, "timeout must be a positive number of seconds");
        return -1;
    }
    if (self->reader == NULL && (self->reader = rl_reader_create()) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->timeout = timeout;
    return 0;
}

static int
Pipeline_traverse(PipelineObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    for (size_t i = 0; i < self->count; i++) {
        pl_entry *e = &self->ring[(self->head + i) % self->capacity];
        Py_VISIT(e->future);
        Py_VISIT((PyObject *)e->request);
    }
    return 0;
}

/* Removes every entry, dropping their references. */
static void
drop_entries(PipelineObject *self)
{
    while (self->count > 0) {
        pl_entry e = self->ring[self->head];
        self->head = (self->head + 1) % self->capacity;
        self->count--;
        Py_XDECREF(e.future);
        Py_XDECREF((PyObject *)e.request);
    }
    self->head = 0;
    self->unsent = 0;
}

static int
Pipeline_clear(PipelineObject *self)
{
    drop_entries(self);
    return 0;
}

static void
Pipeline_dealloc(PipelineObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    drop_entries(self);
    PyMem_Free(self->ring);
    PyMem_Free(self->out);
    if (self->reader != NULL)
        redisReaderFree(self->reader);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int
append_out(PipelineObject *self, const char *data, size_t len)
{
    if (self->out_len + len > self->out_capacity) {
        size_t cap = self->out_capacity ? self->out_capacity : 4096;
        while (cap < self->out_len + len)
            cap *= 2;
        char *grown = PyMem_Realloc(self->out, cap);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->out = grown;
        self->out_capacity = cap;
    }
    memcpy(self->out + self->out_len, data, len);
    self->out_len += len;
    return 0;
}

/* Appends an entry, stealing the references in e. On failure they are released. */
static int
push_entry(PipelineObject *self, pl_entry e)
{
    if (self->count == self->capacity) {
        size_t cap = self->capacity ? self->capacity * 2 : 64;
        pl_entry *ring = PyMem_Malloc(cap * sizeof(pl_entry));
        if (ring == NULL) {
            Py_XDECREF(e.future);
            Py_XDECREF((PyObject *)e.request);
            PyErr_NoMemory();
            return -1;
        }
        for (size_t i = 0; i < self->count; i++)
            ring[i] = self->ring[(self->head + i) % self->capacity];
        PyMem_Free(self->ring);
        self->ring = ring;
        self->capacity = cap;
        self->head = 0;
    }
    self->ring[(self->head + self->count) % self->capacity] = e;
    self->count++;
    self->unsent++;
    return 0;
}

PyDoc_STRVAR(Pipeline_push_doc,
"push(future, request)\n\nQueues the request's command for the next write and its reply's "
"future in the FIFO.");

static PyObject *
Pipeline_push(PipelineObject *self, PyTypeObject *defining_class, PyObject *const *args,
              Py_ssize_t nargs, PyObject *kwnames)
{
    rl_module_state *state = PyType_GetModuleState(defining_class);
    PyObject *future, *request;
    if (nargs != 2 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "push(future, request) takes 2 positional arguments");
        return NULL;
    }
    future = args[0];
    request = args[1];
    if (!Py_IS_TYPE(request, state->RequestType)) {
        PyErr_SetString(PyExc_TypeError, "push() needs a Request made by Codec");
        return NULL;
    }
    RequestObject *req = (RequestObject *)request;
    size_t len;
    const char *bytes = request_bytes(req, &len);
    if (append_out(self, bytes, len) < 0)
        return NULL;
    pl_entry e = {ENTRY_DECISION, 0, rl_monotonic() + self->timeout, Py_NewRef(future),
                  (RequestObject *)Py_NewRef(request)};
    if (push_entry(self, e) < 0) {
        self->out_len -= len;
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Pipeline_push_command_doc,
"push_command(future, *args)\n\nQueues any Redis command (str or bytes arguments); its reply "
"resolves the future as bytes, int, None or a list, or as an exception for an error reply.");

static PyObject *
Pipeline_push_command(PipelineObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *argv[8];
    size_t argvlen[8];
    char *command = NULL;
    long long len;
    if (nargs < 2 || nargs > 9) {
        PyErr_SetString(PyExc_TypeError, "push_command(future, *args) takes 1 to 8 command words");
        return NULL;
    }
    for (Py_ssize_t i = 1; i < nargs; i++) {
        Py_ssize_t n;
        if (PyBytes_Check(args[i])) {
            argv[i - 1] = PyBytes_AS_STRING(args[i]);
            n = PyBytes_GET_SIZE(args[i]);
        } else if (PyUnicode_Check(args[i])) {
            argv[i - 1] = PyUnicode_AsUTF8AndSize(args[i], &n);
            if (argv[i - 1] == NULL)
                return NULL;
        } else {
            PyErr_Format(PyExc_TypeError, "command words must be str or bytes, not %.100s",
                         Py_TYPE(args[i])->tp_name);
            return NULL;
        }
        argvlen[i - 1] = (size_t)n;
    }
    len = redisFormatCommandArgv(&command, (int)(nargs - 1), argv, argvlen);
    if (len < 0 || command == NULL)
        return PyErr_NoMemory();
    int rc = append_out(self, command, (size_t)len);
    /* The command may hold a password: wipe it before it goes back to the allocator. */
    memset(command, 0, (size_t)len);
    redisFreeCommand(command);
    if (rc < 0)
        return NULL;
    pl_entry e = {ENTRY_COMMAND, 0, rl_monotonic() + self->timeout, Py_NewRef(args[0]), NULL};
    if (push_entry(self, e) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Pipeline_take_doc,
"take() -> bytes | None\n\nThe bytes queued since the last take(), to be written now.");

static PyObject *
Pipeline_take(PipelineObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *data;
    if (self->out_len == 0)
        Py_RETURN_NONE;
    data = PyBytes_FromStringAndSize(self->out, (Py_ssize_t)self->out_len);
    if (data == NULL)
        return NULL;
    if (self->out_capacity > 65536) {
        /* A burst grew the buffer: give the memory back. */
        PyMem_Free(self->out);
        self->out = NULL;
        self->out_capacity = 0;
    }
    self->out_len = 0;
    self->unsent = 0; /* every queued entry's bytes are on their way now */
    return data;
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
    done = PyObject_CallMethodNoArgs(future, state->str_done);
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
    /* OneArg, not CallMethod("O"): a tuple result must not be spread into arguments. */
    res = PyObject_CallMethodOneArg(
        future, is_exception ? state->str_set_exception : state->str_set_result, value);
    Py_DECREF(value);
    if (res == NULL)
        return -1;
    Py_DECREF(res);
    return 0;
}

/* Plain conversion for ENTRY_COMMAND replies (handshake, health checks). */
static PyObject *
reply_to_python(const redisReply *r)
{
    switch (r->type) {
    case REDIS_REPLY_STRING:
    case REDIS_REPLY_STATUS:
        return PyBytes_FromStringAndSize(r->str, (Py_ssize_t)r->len);
    case REDIS_REPLY_INTEGER:
        return PyLong_FromLongLong(r->integer);
    case REDIS_REPLY_NIL:
        Py_RETURN_NONE;
    case REDIS_REPLY_ERROR: /* inside an array: kept as its text */
        return PyBytes_FromStringAndSize(r->str, (Py_ssize_t)r->len);
    case REDIS_REPLY_ARRAY: {
        PyObject *list = PyList_New((Py_ssize_t)r->elements);
        if (list == NULL)
            return NULL;
        for (size_t i = 0; i < r->elements; i++) {
            PyObject *item = reply_to_python(r->element[i]);
            if (item == NULL) {
                Py_DECREF(list);
                return NULL;
            }
            PyList_SET_ITEM(list, (Py_ssize_t)i, item);
        }
        return list;
    }
    default:
        PyErr_Format(PyExc_ValueError, "unexpected reply type %d", r->type);
        return NULL;
    }
}

static int
is_error_with(const redisReply *r, const char *prefix)
{
    size_t n = strlen(prefix);
    return r->type == REDIS_REPLY_ERROR && r->str != NULL && r->len >= n &&
           memcmp(r->str, prefix, n) == 0;
}

/* Handles one reply for the entry at the head (already popped into e, owning its refs).
   Returns 0, 1 when the connection must be dropped (garbage), or -1 on a Python error. */
static int
handle_reply(PipelineObject *self, rl_module_state *state, pl_entry e, redisReply *reply)
{
    rl_error err = {RL_OK, 0, ""};
    int rc = 0;
    switch (e.kind) {
    case ENTRY_SCRIPT_LOAD:
        /* An error here shows up again as NOSCRIPT on the retried decision. */
        break;
    case ENTRY_COMMAND:
        if (reply->type == REDIS_REPLY_ERROR) {
            rl_status kind = (is_error_with(reply, "NOAUTH") || is_error_with(reply, "WRONGPASS"))
                                 ? RL_ERR_AUTH : RL_ERR_SERVER;
            rl_error_set(&err, kind, 0, "Redis answered an error: %.240s", reply->str);
            rc = resolve(state, e.future, rl_exception(state, &err), 1);
        } else {
            rc = resolve(state, e.future, reply_to_python(reply), 0);
        }
        break;
    case ENTRY_DECISION:
        if (is_error_with(reply, "NOSCRIPT") && e.attempts == 0) {
            /* The script cache is empty: nothing ran. Load it and send the same command. */
            size_t len;
            const char *bytes = request_bytes(e.request, &len);
            if (append_out(self, rl_script_load_command, sizeof(rl_script_load_command) - 1) < 0 ||
                append_out(self, bytes, len) < 0) {
                rc = -1;
                break;
            }
            pl_entry load = {ENTRY_SCRIPT_LOAD, 0, rl_monotonic() + self->timeout, NULL, NULL};
            if (push_entry(self, load) < 0) {
                rc = -1;
                break;
            }
            e.attempts = 1;
            e.deadline = rl_monotonic() + self->timeout;
            if (push_entry(self, e) < 0)
                return -1; /* push_entry released e's references */
            return 0;      /* e's references now live in the ring */
        }
        rl_result result;
        rl_status st = rl_script_decode(reply, &e.request->prepared.windows, &result, &err);
        if (st == RL_OK)
            rc = resolve(state, e.future, rl_result_tuple(&e.request->prepared.windows, &result,
                                                   e.request->with_window), 0);
        else {
            rc = resolve(state, e.future, rl_exception(state, &err), 1);
            if (rc == 0 && st == RL_ERR_PROTOCOL)
                rc = 1;
        }
        break;
    }
    Py_XDECREF(e.future);
    Py_XDECREF((PyObject *)e.request);
    return rc;
}

PyDoc_STRVAR(Pipeline_feed_doc,
"feed(data) -> bool\n\nParses the replies in data and resolves their futures in order. "
"Returns True when bytes were queued for writing (a NOSCRIPT reload). Raises "
"RateLimiterUnavailable when the server sent something that is not a reply this "
"connection expects: the caller must then fail_all() and close the connection.");

static PyObject *
Pipeline_feed(PipelineObject *self, PyTypeObject *defining_class, PyObject *const *args,
              Py_ssize_t nargs, PyObject *kwnames)
{
    rl_module_state *state = PyType_GetModuleState(defining_class);
    Py_buffer view;
    size_t out_before = self->out_len;
    rl_error err = {RL_OK, 0, ""};

    if (nargs != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "feed(data) takes 1 positional argument");
        return NULL;
    }
    if (self->reader == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the pipeline was not initialised");
        return NULL;
    }
    if (self->reader->err) {
        /* hiredis refuses input once it failed; the connection must be dropped. */
        rl_error_set(&err, RL_ERR_PROTOCOL, 0, "the connection already failed: %s",
                     rl_reader_error(self->reader));
        return rl_raise(state, &err);
    }
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int fed = redisReaderFeed(self->reader, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    if (fed != REDIS_OK)
        return PyErr_NoMemory();
    for (;;) {
        void *raw = NULL;
        if (redisReaderGetReply(self->reader, &raw) != REDIS_OK) {
            rl_error_set(&err, RL_ERR_PROTOCOL, 0, "Redis sent a malformed reply: %s",
                         rl_reader_error(self->reader));
            return rl_raise(state, &err);
        }
        if (raw == NULL)
            break;
        redisReply *reply = raw;
        if (self->count == self->unsent) {
            /* No entry whose command went out is waiting: nobody asked for this reply. */
            freeReplyObject(reply);
            rl_error_set(&err, RL_ERR_PROTOCOL, 0, "Redis sent a reply nobody asked for");
            return rl_raise(state, &err);
        }
        pl_entry e = self->ring[self->head];
        self->head = (self->head + 1) % self->capacity;
        self->count--;
        int rc = handle_reply(self, state, e, reply);
        freeReplyObject(reply);
        if (rc < 0)
            return NULL;
        if (rc == 1) {
            rl_error_set(&err, RL_ERR_PROTOCOL, 0,
                         "Redis answered something that is not a rate-limit decision");
            return rl_raise(state, &err);
        }
    }
    /* hiredis keeps a partial reply buffered; bound it, as the blocking path does. */
    if (self->reader->len - self->reader->pos > RL_MAX_REPLY_BYTES) {
        rl_error_set(&err, RL_ERR_PROTOCOL, 0,
                     "Redis sent more than %d bytes without completing a reply",
                     RL_MAX_REPLY_BYTES);
        return rl_raise(state, &err);
    }
    return PyBool_FromLong(self->out_len > out_before);
}

PyDoc_STRVAR(Pipeline_fail_all_doc,
"fail_all(exception)\n\nFails every pending future with the exception (those not done yet) "
"and forgets them; the queued bytes are dropped too.");

static PyObject *
Pipeline_fail_all(PipelineObject *self, PyTypeObject *defining_class, PyObject *const *args,
                  Py_ssize_t nargs, PyObject *kwnames)
{
    rl_module_state *state = PyType_GetModuleState(defining_class);
    int failed = 0;
    if (nargs != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "fail_all(exception) takes 1 positional argument");
        return NULL;
    }
    PyObject *exc = args[0];
    PyObject *first_type = NULL, *first_value = NULL, *first_tb = NULL;
    self->out_len = 0;
    self->unsent = 0;
    while (self->count > 0) {
        pl_entry e = self->ring[self->head];
        self->head = (self->head + 1) % self->capacity;
        self->count--;
        if (e.future != NULL && resolve(state, e.future, Py_NewRef(exc), 1) < 0) {
            /* Keep failing the others: report the first error at the end. */
            if (!failed)
                PyErr_Fetch(&first_type, &first_value, &first_tb);
            else
                PyErr_Clear();
            failed = 1;
        }
        Py_XDECREF(e.future);
        Py_XDECREF((PyObject *)e.request);
    }
    if (failed) {
        PyErr_Restore(first_type, first_value, first_tb);
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Pipeline_take_pending_doc,
"take_pending() -> list[tuple[future, Request | None]]\n\nEmpties the FIFO and returns the "
"futures still waiting (with their Request, or None for a plain command), oldest first; "
"queued bytes are dropped. For a connection that broke: the caller replays or fails them.");

static PyObject *
Pipeline_take_pending(PipelineObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *list = PyList_New(0);
    int failed = list == NULL;
    self->out_len = 0;
    while (self->count > 0) {
        pl_entry e = self->ring[self->head];
        self->head = (self->head + 1) % self->capacity;
        self->count--;
        if (!failed && e.future != NULL) {
            PyObject *pair = PyTuple_Pack(2, e.future, e.request ? (PyObject *)e.request : Py_None);
            if (pair == NULL || PyList_Append(list, pair) < 0)
                failed = 1;
            Py_XDECREF(pair);
        }
        Py_XDECREF(e.future);
        Py_XDECREF((PyObject *)e.request);
    }
    self->head = 0;
    self->unsent = 0;
    if (failed) {
        Py_XDECREF(list);
        return NULL;
    }
    return list;
}

PyDoc_STRVAR(Pipeline_oldest_deadline_doc,
"oldest_deadline() -> float | None\n\nThe time.monotonic() by which the oldest pending reply "
"is due, or None when nothing is pending. Replies come in order, so it is the first to expire.");

static PyObject *
Pipeline_oldest_deadline(PipelineObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->count == 0)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(self->ring[self->head].deadline);
}

static PyObject *
Pipeline_get_pending(PipelineObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(self->count);
}

static PyMethodDef Pipeline_methods[] = {
    {"push", (PyCFunction)(void (*)(void))Pipeline_push, METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     Pipeline_push_doc},
    {"push_command", (PyCFunction)(void (*)(void))Pipeline_push_command, METH_FASTCALL,
     Pipeline_push_command_doc},
    {"take", (PyCFunction)Pipeline_take, METH_NOARGS, Pipeline_take_doc},
    {"feed", (PyCFunction)(void (*)(void))Pipeline_feed, METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     Pipeline_feed_doc},
    {"fail_all", (PyCFunction)(void (*)(void))Pipeline_fail_all,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, Pipeline_fail_all_doc},
    {"take_pending", (PyCFunction)Pipeline_take_pending, METH_NOARGS, Pipeline_take_pending_doc},
    {"oldest_deadline", (PyCFunction)Pipeline_oldest_deadline, METH_NOARGS,
     Pipeline_oldest_deadline_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Pipeline_getset[] = {
    {"pending", (getter)Pipeline_get_pending, NULL, "Replies still due.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Pipeline_slots[] = {
    {Py_tp_doc, "Pipeline(timeout): the protocol state of one asyncio connection."},
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
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = Pipeline_slots,
};
