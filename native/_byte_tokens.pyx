# cython: language_level=3, boundscheck=False, wraparound=False
"""The byte-level tokenizer's ids built in C: the same list as
:meth:`openai_request.tokenizer.ByteTokenizer.encode` builds in Python (which specifies it),
without a Python iteration per byte: each byte's id object is read from a table and its
reference taken, as a list copy does."""

from cpython.list cimport PyList_New
from cpython.ref cimport Py_INCREF, PyObject

__all__ = ["byte_ids"]

cdef extern from "Python.h":
    PyObject **PySequence_Fast_ITEMS(object)
    void PyList_SET_ITEM_RAW "PyList_SET_ITEM" (object, Py_ssize_t, PyObject *)
    void Py_INCREF_RAW "Py_INCREF" (PyObject *)


def byte_ids(bytes data, list table, first=None):
    """``[first]`` (when given), then ``table[byte]`` for each byte of ``data``.

    Raises:
        ValueError: ``table`` does not have 256 entries.
    """
    if len(table) != 256:
        raise ValueError(f"table has {len(table)} entries, not 256")
    cdef const unsigned char *p = data
    cdef PyObject **ids = PySequence_Fast_ITEMS(table)
    cdef Py_ssize_t n = len(data), i
    cdef Py_ssize_t start = 0 if first is None else 1
    cdef list out = PyList_New(n + start)
    cdef PyObject *item
    if start:
        Py_INCREF(first)
        PyList_SET_ITEM_RAW(out, 0, <PyObject *>first)
    for i in range(n):
        item = ids[p[i]]
        Py_INCREF_RAW(item)  # PyList_SET_ITEM steals the reference
        PyList_SET_ITEM_RAW(out, i + start, item)
    return out
