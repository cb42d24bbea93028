/*
 * py_pushes.c - the face of proto.c's pub/sub reader: the type PushReader of
 * genai_ratelimit._native, the decoding half of a subscriber connection. The in-flight wait
 * queue's wake-ups (genai_ratelimit/_wake.py) come on one such connection per limiter: a
 * blocking socket in a thread of its own (RateLimiter) or an asyncio Protocol
 * (AsyncRateLimiter); both only move bytes and hand them to a PushReader.
 *
 *   feed(data)       -> the pushes completed: [(kind, channel, payload)], kind "message",
 *                       "subscribe", "unsubscribe" or "status"; raises RateLimiterError
 *                       (an error reply: RateLimiterAuthError for a refused password) or
 *                       RateLimiterUnavailable (garbage) and is unusable after that.
 *   command(*words)  -> a command's RESP bytes, as a bytearray the caller can wipe (AUTH).
 *
 * GIL contract: every function here runs with the GIL held and does no I/O. A PushReader is
 * used by one thread at a time (its owner's).
 */
#include "native.h"

#include <string.h>

typedef struct {
    PyObject_HEAD
    rl_push_reader reader; /* reader.reader NULL until init */
} PushReaderObject;

static int
PushReader_init(PushReaderObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "", keywords))
        return -1;
    if (self->reader.reader == NULL && rl_push_reader_init(&self->reader) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void
PushReader_dealloc(PushReaderObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    if (self->reader.reader != NULL)
        rl_push_reader_clear(&self->reader);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(self);
    Py_DECREF(tp);
}

static const char *const kind_names[] = {
    [RL_PUSH_MESSAGE] = "message",
    [RL_PUSH_SUBSCRIBE] = "subscribe",
    [RL_PUSH_UNSUBSCRIBE] = "unsubscribe",
    [RL_PUSH_STATUS] = "status",
};

/* (kind, channel, payload) of one push. Returns a new reference, or NULL. */
static PyObject *
push_tuple(const rl_push *p)
{
    return Py_BuildValue("(sy#y#)", kind_names[p->kind], p->channel ? p->channel : "",
                         (Py_ssize_t)p->channel_len, p->payload ? p->payload : "",
                         (Py_ssize_t)p->payload_len);
}

PyDoc_STRVAR(PushReader_feed_doc,
             "feed($self, data, /)\n--\n\n"
             "Takes bytes read from a subscriber connection; returns the pushes they complete, "
             "[(kind, channel, payload)] (kind: \"message\", \"subscribe\", \"unsubscribe\", "
             "\"status\"). Raises on an error reply or garbage; the reader is done then.");

static PyObject *
PushReader_feed(PushReaderObject *self, PyTypeObject *defining_class, PyObject *const *args,
                Py_ssize_t nargs, PyObject *kwnames)
{
    rl_module_state *state = PyType_GetModuleState(defining_class);
    rl_error err = {RL_OK, ""};
    PyObject *pushes = NULL, *item = NULL;
    char *data;
    Py_ssize_t len;

    if (nargs != 1 || (kwnames != NULL && PyTuple_Size(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "feed() takes one argument, the bytes read");
        return NULL;
    }
    if (self->reader.reader == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "PushReader was not initialised");
        return NULL;
    }
    if (PyBytes_AsStringAndSize(args[0], &data, &len) < 0)
        return NULL;
    if (rl_push_feed(&self->reader, data, (size_t)len, &err) != RL_OK)
        return rl_raise(state, &err);
    if ((pushes = PyList_New(0)) == NULL)
        return NULL;
    for (;;) {
        rl_push push;
        int got = rl_push_next(&self->reader, &push, &err);
        if (got < 0) {
            Py_DECREF(pushes);
            return rl_raise(state, &err);
        }
        if (got == 0)
            break;
        item = push_tuple(&push);
        rl_push_done(&push);
        if (item == NULL || PyList_Append(pushes, item) < 0)
            goto error;
        Py_CLEAR(item);
    }
    return pushes;
error:
    Py_XDECREF(item);
    Py_DECREF(pushes);
    return NULL;
}

PyDoc_STRVAR(PushReader_command_doc,
             "command($self, /, *words)\n--\n\n"
             "A Redis command's RESP bytes (words: str, UTF-8, or bytes), as a bytearray "
             "the caller wipes when it holds a password.");

static PyObject *
PushReader_command(PushReaderObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    enum { MAX_WORDS = 8 };
    const char *argv[MAX_WORDS];
    size_t argvlen[MAX_WORDS];
    char *command = NULL;
    long long len;
    PyObject *out;

    if (nargs < 1 || nargs > MAX_WORDS) {
        PyErr_Format(PyExc_TypeError, "command() takes 1 to %d words", MAX_WORDS);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        Py_ssize_t n;
        if (PyUnicode_Check(args[i])) {
            argv[i] = PyUnicode_AsUTF8AndSize(args[i], &n);
            if (argv[i] == NULL)
                return NULL;
        } else if (PyBytes_Check(args[i])) {
            char *bytes;
            if (PyBytes_AsStringAndSize(args[i], &bytes, &n) < 0)
                return NULL;
            argv[i] = bytes;
        } else {
            return rl_type_error(args[i], "a command's word must be a str or bytes, not ");
        }
        argvlen[i] = (size_t)n;
    }
    if ((len = rl_push_format((int)nargs, argv, argvlen, &command)) < 0)
        return PyErr_NoMemory();
    out = PyByteArray_FromStringAndSize(command, (Py_ssize_t)len);
    rl_wipe(command, (size_t)len);
    rl_push_format_free(command);
    return out;
}

static PyMethodDef PushReader_methods[] = {
    {"feed", (PyCFunction)(void (*)(void))PushReader_feed,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS, PushReader_feed_doc},
    {"command", (PyCFunction)(void (*)(void))PushReader_command, METH_FASTCALL,
     PushReader_command_doc},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot PushReader_slots[] = {
    {Py_tp_doc, "PushReader()\n--\n\n"
                "The decoding half of a pub/sub subscriber connection (proto.c's push reader)."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, PushReader_init},
    {Py_tp_dealloc, PushReader_dealloc},
    {Py_tp_methods, PushReader_methods},
    {0, NULL},
};

PyType_Spec rl_push_reader_spec = {
    .name = "genai_ratelimit._native.PushReader",
    .basicsize = sizeof(PushReaderObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = PushReader_slots,
};
