/*
 * py_module.c - genai_ratelimit._native: module state, exceptions, multi-phase init, and
 * the one place where a C-level rl_error becomes a Python exception (rl_raise).
 *
 * GIL contract: everything here runs with the GIL held.
 * State: no static PyObject*; the exceptions, the types, the interned method names and the
 * page of randomness (which also tells a fork child apart, member.c) live in the module
 * state, so every interpreter that imports the module has its own (see module_slots).
 * Every type is immutable (Py_TPFLAGS_IMMUTABLETYPE), but WindowDecision, a struct sequence
 * that the C API gives no such flag. PyInit__native is the only exported symbol
 * (-fvisibility=hidden).
 */
#include "native.h"

#include <string.h>
#include <unistd.h>

/* The hiredis whose headers we were compiled against, "major.minor.patch": the module
   constant HIREDIS_VERSION, so a build against hiredis 1.x can be told from one against
   0.14 (make test-hiredis1 checks it). */
#define RL_STRINGIFY_(x) #x
#define RL_STRINGIFY(x) RL_STRINGIFY_(x)
#define RL_HIREDIS_VERSION                                                                         \
    RL_STRINGIFY(HIREDIS_MAJOR) "." RL_STRINGIFY(HIREDIS_MINOR) "." RL_STRINGIFY(HIREDIS_PATCH)

extern PyType_Spec rl_limiter_spec;
extern PyType_Spec rl_codec_spec;
extern PyType_Spec rl_request_spec;
extern PyType_Spec rl_pipeline_spec;
extern PyType_Spec rl_router_spec;
extern PyType_Spec rl_route_spec;
extern PyType_Spec rl_route_read_spec;
extern PyType_Spec rl_push_reader_spec;

static rl_module_state *
get_state(PyObject *module)
{
    return (rl_module_state *)PyModule_GetState(module);
}

PyObject *
rl_exception(rl_module_state *state, const rl_error *err)
{
    PyObject *type;
    switch (err->kind) {
    case RL_ERR_NOMEM:
        /* CPython's own MemoryError (preallocated: making one may need memory), set as the
           current exception: the caller takes it from there (resolve() in py_codec.c does). */
        PyErr_NoMemory();
        return NULL;
    case RL_ERR_TIMEOUT:
        type = state->Timeout;
        break;
    case RL_ERR_AUTH:
        type = state->AuthError;
        break;
    case RL_ERR_CLOSED:
        type = state->Error;
        break;
    case RL_ERR_REDIRECT: {
        /* Only a single-node limiter reports one: the cluster driver follows them. */
        PyObject *exc, *text = PyUnicode_FromFormat(
                           "Redis answered %.300s: the server is a Redis Cluster node; use a "
                           "redis+cluster:// URL",
                           err->message);
        if (text == NULL)
            return NULL;
        exc = PyObject_CallFunctionObjArgs(state->Unavailable, text, NULL);
        Py_DECREF(text);
        return exc;
    }
    case RL_OK: /* a bug: report it rather than fail without an exception */
        return PyObject_CallFunction(PyExc_SystemError, "s",
                                     "rate limiter failed without an error");
    default:
        type = state->Unavailable;
        break;
    }
    /* The message may quote a server's error text: not necessarily UTF-8, and %.Ns may
       have cut a character in two. Decode leniently; an exception must always be made. */
    const char *text = err->message[0] ? err->message : "Redis is unavailable";
    PyObject *message = PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "replace");
    if (message == NULL)
        return NULL;
    PyObject *exc = PyObject_CallFunctionObjArgs(type, message, NULL);
    Py_DECREF(message);
    return exc;
}

void
rl_error_from(PyObject *exc, rl_status kind, rl_error *err)
{
    err->kind = kind;
    PyObject *text = PyObject_Str(exc);
    const char *said = text != NULL ? PyUnicode_AsUTF8AndSize(text, NULL) : NULL;
    if (said == NULL) {
        /* A text that cannot be rendered (lone surrogates, a failing __str__) must not keep
           the failure from reaching whoever waits on it: the status says what happened. */
        PyErr_Clear();
        said = "the connection failed (its error could not be rendered as text)";
    }
    snprintf(err->message, sizeof(err->message), "%s", said);
    Py_XDECREF(text);
}

PyObject *
rl_raise(rl_module_state *state, const rl_error *err)
{
    PyObject *exc;
    if (err->kind == RL_ERR_NOMEM)
        return PyErr_NoMemory();
    exc = rl_exception(state, err);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

#ifdef RL_DEBUG_HOOKS
/* Debug and sanitized builds: runs the wipe check on bytes, so the tests can see that it
   fires (it aborts the process when the canary is in them). */
static PyObject *
debug_check_wiped(PyObject *Py_UNUSED(module), PyObject *arg)
{
    char *data;
    Py_ssize_t len;
    if (PyBytes_AsStringAndSize(arg, &data, &len) < 0)
        return NULL;
    rl_check_wiped(data, (size_t)len, "a buffer handed to _debug_check_wiped");
    Py_RETURN_NONE;
}
#endif

static PyMethodDef module_methods[] = {
    {"check_options", (PyCFunction)(void (*)(void))rl_check_options, METH_VARARGS | METH_KEYWORDS,
     "check_options(key_prefix, clock, connect_timeout, socket_timeout, max_connections,\n"
     "    storage, min_replicas, replica_timeout_ms, hash_tag=False)\n--\n\n"
     "Validates a limiter's options (both limiters'), raising TypeError or ValueError."},
    {"_set_client_clock", rl_set_client_clock, METH_O,
     "_set_client_clock(ms, /)\n--\n\nFor tests: clock='client' limiters read ms (unix ms) "
     "instead of the system clock until called with None."},
    {"key_owner", rl_key_owner, METH_VARARGS,
     "key_owner(owner, hash_tag, /)\n--\n\nThe owner (a user id, a shared scope's name) as "
     "the limiter's keys spell it: on a Redis Cluster (hash_tag) a hash tag, \"{owner}\" with "
     "'%', '{' and '}' percent-encoded."},
    {"read_key", rl_read_key, METH_VARARGS,
     "read_key(name, prefix, hash_tag, /)\n--\n\nWhat a key's name says, read with the rule "
     "the limiter writes it with: (kind, owner, seconds, tokens, scope, suffix), kind "
     "'window', 'scope', 'shared' or 'leases', suffix 'w' (weights), 'c' (compact) or ''; "
     "None for a name that is not one of its window or leases keys."},
#ifdef RL_DEBUG_HOOKS
    {"_debug_check_wiped", debug_check_wiped, METH_O,
     "_debug_check_wiped(data, /)\n--\n\nDebug builds: aborts when the bytes hold the wipe "
     "canary."},
#endif
    {NULL, NULL, 0, NULL},
};

static int
add_exception(PyObject *module, PyObject **slot, const char *name, const char *doc, PyObject *bases)
{
    char qualified[128];
    PyOS_snprintf(qualified, sizeof(qualified), "genai_ratelimit.%s", name);
    *slot = PyErr_NewExceptionWithDoc(qualified, doc, bases, NULL);
    if (*slot == NULL)
        return -1;
    return PyModule_AddObjectRef(module, name, *slot);
}

static int
add_type(PyObject *module, PyTypeObject **slot, PyType_Spec *spec, const char *name)
{
    *slot = (PyTypeObject *)PyType_FromModuleAndSpec(module, spec, NULL);
    if (*slot == NULL)
        return -1;
    return PyModule_AddObjectRef(module, name, (PyObject *)*slot);
}

static int
add_long_long(PyObject *module, const char *name, long long value)
{
    PyObject *obj = PyLong_FromLongLong(value);
    int rc;
    if (obj == NULL)
        return -1;
    rc = PyModule_AddObjectRef(module, name, obj);
    Py_DECREF(obj);
    return rc;
}

static PyStructSequence_Field window_decision_fields[] = {
    {"allowed", "True when the request was admitted (and logged in every window)"},
    {"remaining", "requests left in the window reported by window_seconds (0 on a refusal)"},
    {"retry_after_s", "seconds until a retry can succeed, rounded up (0 when allowed)"},
    {"window_seconds", "the window that refused, or on allow the one with the fewest left"},
    {"retry_after_ms", "the same wait in milliseconds, not rounded up (0 when allowed)"},
    {"timestamp_ms", "the unix time in ms the script decided at (the entry's score)"},
    {NULL, NULL},
};

static PyStructSequence_Desc window_decision_desc = {
    "genai_ratelimit._native.WindowDecision",
    "check_windows_detailed's answer: unpacks and compares as check_windows' (allowed,\n"
    "remaining, retry_after_s, window_seconds); the exact wait (retry_after_ms) and the\n"
    "decision's time (timestamp_ms) are attributes only.",
    window_decision_fields,
    4,
};

static int
module_exec(PyObject *module)
{
    rl_module_state *state = get_state(module);
    PyObject *bases = NULL;
    static const struct {
        rl_script_id id;
        const char *sha_name, *source_name;
    } exported[] = {
        {RL_SCRIPT_WINDOW, "SCRIPT_SHA1", "SCRIPT_SOURCE"},
        {RL_SCRIPT_RECONCILE, "RECONCILE_SHA1", "RECONCILE_SOURCE"},
        {RL_SCRIPT_PEEK, "PEEK_SHA1", "PEEK_SOURCE"},
        {RL_SCRIPT_RESET, "RESET_SHA1", "RESET_SOURCE"},
        {RL_SCRIPT_LEASE, "LEASE_SHA1", "LEASE_SOURCE"},
        {RL_SCRIPT_COMPACT_WINDOW, "COMPACT_SHA1", "COMPACT_SOURCE"},
        {RL_SCRIPT_COMPACT_RECONCILE, "COMPACT_RECONCILE_SHA1", "COMPACT_RECONCILE_SOURCE"},
        {RL_SCRIPT_COMPACT_PEEK, "COMPACT_PEEK_SHA1", "COMPACT_PEEK_SOURCE"},
        {RL_SCRIPT_IN_FLIGHT, "IN_FLIGHT_SHA1", "IN_FLIGHT_SOURCE"},
        {RL_SCRIPT_RECONCILE_RELEASE, "RECONCILE_RELEASE_SHA1", "RECONCILE_RELEASE_SOURCE"},
        {RL_SCRIPT_COMPACT_IN_FLIGHT, "COMPACT_IN_FLIGHT_SHA1", "COMPACT_IN_FLIGHT_SOURCE"},
        {RL_SCRIPT_COMPACT_RECONCILE_RELEASE, "COMPACT_RECONCILE_RELEASE_SHA1",
         "COMPACT_RECONCILE_RELEASE_SOURCE"},
        {RL_SCRIPT_GCRA, "GCRA_SHA1", "GCRA_SOURCE"},
        {RL_SCRIPT_GCRA_WINDOWS, "GCRA_WINDOWS_SHA1", "GCRA_WINDOWS_SOURCE"},
        {RL_SCRIPT_COMPACT_GCRA_WINDOWS, "COMPACT_GCRA_WINDOWS_SHA1",
         "COMPACT_GCRA_WINDOWS_SOURCE"},
        {RL_SCRIPT_BUDGET_HOLD, "BUDGET_HOLD_SHA1", "BUDGET_HOLD_SOURCE"},
        {RL_SCRIPT_BUDGET_SETTLE, "BUDGET_SETTLE_SHA1", "BUDGET_SETTLE_SOURCE"},
        {RL_SCRIPT_OBSERVE, "OBSERVE_SHA1", "OBSERVE_SOURCE"},
        {RL_SCRIPT_QUEUE, "QUEUE_SHA1", "QUEUE_SOURCE"}};
    int rc = -1;

    state->kill_switch_warned = 0;
    state->client_clock_ms = -1;
    if ((state->random = rl_random_new()) == NULL) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }

    if ((state->str_done = PyUnicode_InternFromString("done")) == NULL ||
        (state->str_set_result = PyUnicode_InternFromString("set_result")) == NULL ||
        (state->str_set_exception = PyUnicode_InternFromString("set_exception")) == NULL)
        goto done;
    if (add_exception(module, &state->Error, "RateLimiterError",
                      "Base class of every error this package raises.", NULL) < 0)
        goto done;
    if (add_exception(module, &state->Unavailable, "RateLimiterUnavailable",
                      "Redis could not give a decision: unreachable, timed out, or it answered "
                      "something that is not a decision. The next call reconnects by itself.",
                      state->Error) < 0)
        goto done;
    if ((bases = PyTuple_Pack(2, state->Unavailable, PyExc_TimeoutError)) == NULL)
        goto done;
    if (add_exception(module, &state->Timeout, "RateLimiterTimeout",
                      "Redis did not answer within the configured timeout.", bases) < 0)
        goto done;
    if (add_exception(module, &state->AuthError, "RateLimiterAuthError",
                      "Redis refused the credentials, or wants a password that was not given.",
                      state->Unavailable) < 0)
        goto done;

    if (add_type(module, &state->LimiterType, &rl_limiter_spec, "Limiter") < 0 ||
        add_type(module, &state->CodecType, &rl_codec_spec, "Codec") < 0 ||
        add_type(module, &state->RequestType, &rl_request_spec, "Request") < 0 ||
        add_type(module, &state->PipelineType, &rl_pipeline_spec, "Pipeline") < 0 ||
        add_type(module, &state->RouterType, &rl_router_spec, "Router") < 0 ||
        add_type(module, &state->RouteType, &rl_route_spec, "Route") < 0 ||
        add_type(module, &state->RouteReadType, &rl_route_read_spec, "RouteRead") < 0 ||
        add_type(module, &state->PushReaderType, &rl_push_reader_spec, "PushReader") < 0)
        goto done;
    state->WindowDecisionType = PyStructSequence_NewType(&window_decision_desc);
    if (state->WindowDecisionType == NULL ||
        PyModule_AddObjectRef(module, "WindowDecision", (PyObject *)state->WindowDecisionType) < 0)
        goto done;

    if (PyModule_AddStringConstant(module, "HIREDIS_VERSION", RL_HIREDIS_VERSION) < 0)
        goto done;
    for (size_t i = 0; i < sizeof(exported) / sizeof(exported[0]); i++) {
        size_t len;
        const char *text = rl_script_source_text(exported[i].id, &len);
        PyObject *source = PyUnicode_DecodeUTF8(text, (Py_ssize_t)len, "strict");
        if (source == NULL)
            goto done;
        int added = PyModule_AddObjectRef(module, exported[i].source_name, source);
        Py_DECREF(source);
        if (added < 0 || PyModule_AddStringConstant(module, exported[i].sha_name,
                                                    rl_script_sha1(exported[i].id)) < 0)
            goto done;
    }
    if (PyModule_AddIntConstant(module, "MAX_WINDOWS", RL_MAX_WINDOWS) < 0 ||
        add_long_long(module, "MAX_LIMIT", RL_MAX_LIMIT) < 0 ||
        add_long_long(module, "MAX_WINDOW_SECONDS", RL_MAX_WINDOW_SECONDS) < 0 ||
        add_long_long(module, "MAX_TIMEOUT_SECONDS", (long long)RL_MAX_TIMEOUT_SECONDS) < 0 ||
        /* The bounds of a script's reply (native.h), for the tests and the fuzzer's model. */
        add_long_long(module, "MAX_UNIX_MS", RL_MAX_UNIX_MS) < 0 ||
        add_long_long(module, "MAX_CLOCK_SKEW_MS", RL_MAX_CLOCK_SKEW_MS) < 0 ||
        /* The rl_status of a failure: the engine tags its exceptions with it, and the
           asyncio driver names its own (a timeout, a lost connection, a closed limiter). */
        PyModule_AddIntConstant(module, "STATUS_CONNECT", RL_ERR_CONNECT) < 0 ||
        PyModule_AddIntConstant(module, "STATUS_TIMEOUT", RL_ERR_TIMEOUT) < 0 ||
        PyModule_AddIntConstant(module, "STATUS_AUTH", RL_ERR_AUTH) < 0 ||
        PyModule_AddIntConstant(module, "STATUS_PROTOCOL", RL_ERR_PROTOCOL) < 0 ||
        PyModule_AddIntConstant(module, "STATUS_CLOSED", RL_ERR_CLOSED) < 0 ||
        PyModule_AddIntConstant(module, "STATUS_IO", RL_ERR_IO) < 0 ||
        PyModule_AddIntConstant(module, "STATUS_SERVER", RL_ERR_SERVER) < 0 ||
        PyModule_AddIntConstant(module, "STATUS_REDIRECT", RL_ERR_REDIRECT) < 0 ||
        /* What Route.next() says to do (router.c's rl_route_action). */
        PyModule_AddIntConstant(module, "ROUTE_SEND", RL_ROUTE_SEND) < 0 ||
        PyModule_AddIntConstant(module, "ROUTE_READ", RL_ROUTE_READ) < 0 ||
        PyModule_AddIntConstant(module, "ROUTE_WAIT", RL_ROUTE_WAIT) < 0 ||
        PyModule_AddIntConstant(module, "ROUTE_FAIL", RL_ROUTE_FAIL) < 0)
        goto done;
#ifdef RL_DEBUG_HOOKS
    /* Debug and sanitized builds: what rl_check_wiped looks for (tests/test_secret_wipe.py). */
    if (PyModule_AddStringConstant(module, "_debug_wipe_canary", RL_WIPE_CANARY) < 0)
        goto done;
#endif
    rc = 0;
done:
    Py_XDECREF(bases);
    return rc;
}

static int
module_traverse(PyObject *module, visitproc visit, void *arg)
{
    rl_module_state *state = get_state(module);
    Py_VISIT(state->LimiterType);
    Py_VISIT(state->CodecType);
    Py_VISIT(state->RequestType);
    Py_VISIT(state->PipelineType);
    Py_VISIT(state->RouterType);
    Py_VISIT(state->RouteType);
    Py_VISIT(state->RouteReadType);
    Py_VISIT(state->PushReaderType);
    Py_VISIT(state->WindowDecisionType);
    Py_VISIT(state->Error);
    Py_VISIT(state->Unavailable);
    Py_VISIT(state->Timeout);
    Py_VISIT(state->AuthError);
    return 0;
}

static int
module_clear(PyObject *module)
{
    rl_module_state *state = get_state(module);
    Py_CLEAR(state->LimiterType);
    Py_CLEAR(state->CodecType);
    Py_CLEAR(state->RequestType);
    Py_CLEAR(state->PipelineType);
    Py_CLEAR(state->RouterType);
    Py_CLEAR(state->RouteType);
    Py_CLEAR(state->RouteReadType);
    Py_CLEAR(state->PushReaderType);
    Py_CLEAR(state->WindowDecisionType);
    Py_CLEAR(state->Error);
    Py_CLEAR(state->Unavailable);
    Py_CLEAR(state->Timeout);
    Py_CLEAR(state->AuthError);
    Py_CLEAR(state->str_done);
    Py_CLEAR(state->str_set_result);
    Py_CLEAR(state->str_set_exception);
    return 0;
}

static void
module_free(void *module)
{
    rl_module_state *state = get_state((PyObject *)module);
    module_clear((PyObject *)module);
    if (state != NULL) {
        rl_random_free(state->random);
        state->random = NULL;
    }
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#ifdef Py_mod_multiple_interpreters
    /* CPython 3.12+: every import has its module state and no C state is shared, so the
       module loads in subinterpreters that share the main interpreter's GIL; a GIL of its
       own per interpreter is not claimed (not tested). A build for the 3.10 Limited API
       cannot name the slot, and 3.12+ then defaults to the same. */
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_SUPPORTED},
#endif
    {0, NULL},
};

PyDoc_STRVAR(module_doc,
"The C core of genai_ratelimit: argument validation, UUID4 members, RESP encoding and\n"
"decoding (hiredis), the socket round trip with the GIL released, connection pooling.");

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,         .m_name = "genai_ratelimit._native",
    .m_doc = module_doc,           .m_size = sizeof(rl_module_state),
    .m_methods = module_methods,   .m_slots = module_slots,
    .m_traverse = module_traverse, .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModuleDef_Init(&native_module);
}
