/*
 * py_limited.c - what the Limited API (Py_LIMITED_API = 3.10: one abi3 wheel for every CPython
 * from 3.10 on) leaves out and the extension needs: the name of an object's type for
 * error messages. PyTypeObject is opaque there (no tp_name), and "%T" only came in 3.13.
 *
 * GIL contract: called with the GIL held; errors are Python exceptions.
 */
#include "native.h"

#include <stdarg.h>

/* The name CPython's own messages give an object's type (what tp_name holds): "int", a
   class's __name__, "module.Name" for a static type of an extension module. A heap type
   made from a spec gives its __name__ alone. New reference, or NULL with an exception. */
static PyObject *
type_name(PyObject *obj)
{
    PyTypeObject *type = Py_TYPE(obj);
    PyObject *name = PyObject_GetAttrString((PyObject *)type, "__name__");
    if (name == NULL || (PyType_GetFlags(type) & Py_TPFLAGS_HEAPTYPE))
        return name;
    /* A static type's __module__ is what precedes the last dot of its tp_name, or
       "builtins" when there is none: joined again, the two give tp_name back. */
    PyObject *module = PyObject_GetAttrString((PyObject *)type, "__module__");
    if (module == NULL) {
        Py_DECREF(name);
        return NULL;
    }
    PyObject *full = name;
    if (PyUnicode_Check(module) && PyUnicode_CompareWithASCIIString(module, "builtins") != 0) {
        full = PyUnicode_FromFormat("%U.%U", module, name);
        Py_DECREF(name);
    }
    Py_DECREF(module);
    return full;
}

PyObject *
rl_type_error(PyObject *obj, const char *format, ...)
{
    va_list vargs;
    va_start(vargs, format);
    PyObject *text = PyUnicode_FromFormatV(format, vargs);
    va_end(vargs);
    if (text == NULL)
        return NULL;
    PyObject *name = type_name(obj);
    if (name != NULL)
        PyErr_Format(PyExc_TypeError, "%U%.100U", text, name);
    Py_XDECREF(name);
    Py_DECREF(text);
    return NULL;
}
