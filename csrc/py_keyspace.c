/*
 * py_keyspace.c - the Python face of the key grammar: the command line and genai_ratelimit's
 * _keyspace read the limiter's keys with the rule script.c writes them with (rl_key_user,
 * rl_key_read), never a second copy of it.
 *
 *   key_owner(owner, hash_tag)        an owner as its keys spell it ("{...}" on a cluster)
 *   read_key(name, prefix, hash_tag)  what a key's name says, or None
 *
 * Text crosses as UTF-8 with surrogate escapes both ways, so a key that is not UTF-8 (as
 * SCAN hands it back) reads to the same bytes it came from.
 *
 * GIL contract: both run with the GIL held; they do no I/O.
 */
#include "native.h"

#include <stdlib.h>
#include <string.h>

/* The bytes of str text (UTF-8, surrogates escaped): a new reference, or NULL with an
   exception naming what. */
static PyObject *
utf8_bytes(PyObject *text, const char *what)
{
    if (!PyUnicode_Check(text)) {
        PyErr_Format(PyExc_TypeError, "%s must be str", what);
        return NULL;
    }
    return PyUnicode_AsEncodedString(text, "utf-8", "surrogateescape");
}

/* A str of len bytes (UTF-8, surrogates escaped), percent-decoded first when unescape:
   a new reference, or NULL with an exception. */
static PyObject *
key_text(const char *bytes, size_t len, int unescape)
{
    PyObject *text;
    char *decoded;
    if (!unescape)
        return PyUnicode_DecodeUTF8(bytes, (Py_ssize_t)len, "surrogateescape");
    if ((decoded = malloc(len + 1)) == NULL)
        return PyErr_NoMemory();
    len = rl_key_unescape(decoded, bytes, len);
    text = PyUnicode_DecodeUTF8(decoded, (Py_ssize_t)len, "surrogateescape");
    free(decoded);
    return text;
}

PyObject *
rl_key_owner(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *owner, *bytes, *result = NULL;
    char *data, *out;
    Py_ssize_t len;
    int hash_tag;
    if (!PyArg_ParseTuple(args, "Up:key_owner", &owner, &hash_tag))
        return NULL;
    if ((bytes = utf8_bytes(owner, "owner")) == NULL)
        return NULL;
    if (PyBytes_AsStringAndSize(bytes, &data, &len) == 0) {
        if ((out = malloc(rl_key_user_room((size_t)len))) == NULL) {
            PyErr_NoMemory();
        } else {
            result = key_text(out, rl_key_user(out, data, (size_t)len, hash_tag), 0);
            free(out);
        }
    }
    Py_DECREF(bytes);
    return result;
}

PyObject *
rl_read_key(PyObject *Py_UNUSED(module), PyObject *args)
{
    static const char *const kinds[] = {
        [RL_KEY_WINDOW] = "window", [RL_KEY_SCOPE] = "scope", [RL_KEY_SHARED] = "shared",
        [RL_KEY_LEASES] = "leases", [RL_KEY_GCRA] = "gcra",   [RL_KEY_BUDGET] = "budget"};
    PyObject *name, *prefix, *name_bytes = NULL, *prefix_bytes = NULL, *result = NULL;
    PyObject *owner = NULL, *scope = NULL;
    char *name_data, *prefix_data;
    Py_ssize_t name_len, prefix_len;
    int hash_tag;
    rl_key_reading key;

    if (!PyArg_ParseTuple(args, "UUp:read_key", &name, &prefix, &hash_tag))
        return NULL;
    if ((name_bytes = utf8_bytes(name, "name")) == NULL ||
        (prefix_bytes = utf8_bytes(prefix, "prefix")) == NULL ||
        PyBytes_AsStringAndSize(name_bytes, &name_data, &name_len) < 0 ||
        PyBytes_AsStringAndSize(prefix_bytes, &prefix_data, &prefix_len) < 0)
        goto done;
    if (rl_key_read(name_data, (size_t)name_len, prefix_data, (size_t)prefix_len, hash_tag, &key) <
        0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    /* The owner is encoded only inside a hash tag; a scope's name always. */
    if ((owner = key_text(key.owner, key.owner_len, hash_tag)) == NULL)
        goto done;
    if (key.scope == NULL)
        scope = Py_NewRef(Py_None);
    else if ((scope = key_text(key.scope, key.scope_len, 1)) == NULL)
        goto done;
    result =
        Py_BuildValue("(sOLNOs#)", kinds[key.kind], owner, key.seconds, PyBool_FromLong(key.tokens),
                      scope, &key.suffix, (Py_ssize_t)(key.suffix != 0));
done:
    Py_XDECREF(owner);
    Py_XDECREF(scope);
    Py_XDECREF(name_bytes);
    Py_XDECREF(prefix_bytes);
    return result;
}
