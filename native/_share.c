/*
 * shmloader._native: the read path of shmloader.share() (layout: shmloader/_share.py).
 *
 * Items is the base type of SharedList. Indexing it with an int reads the element's
 * two offsets and, when the element was stored with marshal (plain values only: see
 * plain_value), builds it straight from the shared bytes in C: no Python frame, no
 * memoryview, no unpickler. Anything else (a slice, an element stored as a pickle, an
 * index out of range) goes to the subclass's _item(key) in Python.
 *
 * plain_value(obj) says whether obj is made only of the exact types marshal writes
 * and reads back as they were: None, bool, int, float, str, bytes, list, tuple, dict.
 * A subclass (an IntEnum, an OrderedDict), a bytearray (marshal would turn it into
 * bytes) or a container met twice (marshal would copy it; pickle keeps one object)
 * makes it False, and the element is pickled instead.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <marshal.h>
#include <stdint.h>

#define CODE_MARSHAL 0
#define PLAIN_DEPTH 64   /* deeper than this: pickled */
#define PLAIN_SEEN 64    /* more containers than this in one element: pickled */

static PyObject *item_name; /* "_item", interned by shmloader_share_init */

typedef struct {
    PyObject_HEAD
    Py_buffer view;           /* the mapping, held while the reader lives */
    const uint64_t *offsets;  /* n + 1: element i is blob[offsets[i]:offsets[i + 1]] */
    const uint64_t *codes;    /* n: how element i was stored (CODE_MARSHAL: marshal) */
    const char *blob;
    uint64_t blob_len;
    Py_ssize_t n;
} Items;

static int items_init(Items *self, PyObject *args, PyObject *kwds) {
    PyObject *buffer;
    Py_ssize_t n, offsets_at, codes_at, blob_at, blob_len;
    static char *kwlist[] = {"buffer", "n", "offsets_at", "codes_at", "blob_at", "blob_len", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Onnnnn", kwlist, &buffer, &n, &offsets_at, &codes_at,
                                     &blob_at, &blob_len))
        return -1;
    if (self->view.obj != NULL) {
        PyErr_SetString(PyExc_TypeError, "Items is initialised once");
        return -1;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE) < 0) return -1;
    /* Every table inside the buffer, the u64 tables 8-byte aligned (the header's layout). */
    int ok = n >= 0 && offsets_at >= 0 && codes_at >= 0 && blob_at >= 0 && blob_len >= 0 &&
             offsets_at % 8 == 0 && codes_at % 8 == 0 && ((uintptr_t)view.buf) % 8 == 0 &&
             n < PY_SSIZE_T_MAX / 8 - 1 &&
             offsets_at <= view.len && (n + 1) * 8 <= view.len - offsets_at &&
             codes_at <= view.len && n * 8 <= view.len - codes_at &&
             blob_at <= view.len && blob_len <= view.len - blob_at;
    if (!ok) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "Items: a table lies outside the buffer");
        return -1;
    }
    const char *base = (const char *)view.buf;
    self->view = view;
    self->offsets = (const uint64_t *)(base + offsets_at);
    self->codes = (const uint64_t *)(base + codes_at);
    self->blob = base + blob_at;
    self->blob_len = (uint64_t)blob_len;
    self->n = n;
    return 0;
}

static void items_dealloc(Items *self) {
    if (self->view.obj != NULL) PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t items_length(Items *self) { return self->n; }

static PyObject *items_subscript(Items *self, PyObject *key) {
    if (PyLong_CheckExact(key) && self->view.obj != NULL) {
        Py_ssize_t i = PyLong_AsSsize_t(key);
        if (i == -1 && PyErr_Occurred()) {
            PyErr_Clear(); /* too large: _item says so */
        } else {
            if (i < 0) i += self->n;
            if (i >= 0 && i < self->n && self->codes[i] == CODE_MARSHAL) {
                uint64_t start = self->offsets[i], end = self->offsets[i + 1];
                if (start <= end && end <= self->blob_len)
                    return PyMarshal_ReadObjectFromString(self->blob + start, (Py_ssize_t)(end - start));
                PyErr_Format(PyExc_ValueError, "share(): element %zd lies outside the file", i);
                return NULL;
            }
        }
    }
    return PyObject_CallMethodOneArg((PyObject *)self, item_name, key);
}

/* ------------------------------------------------------------------ plain_value */
typedef struct {
    PyObject *seen[PLAIN_SEEN];
    int count;
} Seen;

/* 1: plain, 0: not, -1: error. */
static int plain(PyObject *v, int depth, Seen *seen) {
    if (v == Py_None || PyBool_Check(v) || PyLong_CheckExact(v) || PyFloat_CheckExact(v) ||
        PyUnicode_CheckExact(v) || PyBytes_CheckExact(v))
        return 1;
    int is_list = PyList_CheckExact(v), is_tuple = PyTuple_CheckExact(v), is_dict = PyDict_CheckExact(v);
    if (!(is_list || is_tuple || is_dict) || depth >= PLAIN_DEPTH) return 0;
    for (int k = 0; k < seen->count; k++)
        if (seen->seen[k] == v) return 0; /* shared or recursive */
    if (seen->count == PLAIN_SEEN) return 0;
    seen->seen[seen->count++] = v;
    if (is_dict) {
        Py_ssize_t pos = 0;
        PyObject *k, *item;
        while (PyDict_Next(v, &pos, &k, &item)) {
            int r = plain(k, depth + 1, seen);
            if (r == 1) r = plain(item, depth + 1, seen);
            if (r != 1) return r;
        }
        return 1;
    }
    Py_ssize_t len = is_list ? PyList_GET_SIZE(v) : PyTuple_GET_SIZE(v);
    for (Py_ssize_t j = 0; j < len; j++) {
        /* A list cannot change under us: plain() runs no Python code. */
        int r = plain(is_list ? PyList_GET_ITEM(v, j) : PyTuple_GET_ITEM(v, j), depth + 1, seen);
        if (r != 1) return r;
    }
    return 1;
}

static PyObject *plain_value(PyObject *module, PyObject *obj) {
    Seen seen;
    seen.count = 0;
    int r = plain(obj, 0, &seen);
    if (r < 0) return NULL;
    return PyBool_FromLong(r);
}

PyDoc_STRVAR(plain_value_doc,
             "plain_value($module, obj, /)\n--\n\n"
             "Whether obj holds only exact None, bool, int, float, str, bytes, list, tuple and dict,\n"
             "no container twice: what marshal writes and reads back as it was.");

static PyMethodDef shmloader_share_methods[] = {
    {"plain_value", plain_value, METH_O, plain_value_doc},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods items_as_mapping = {
    .mp_length = (lenfunc)items_length,
    .mp_subscript = (binaryfunc)items_subscript,
};

static PySequenceMethods items_as_sequence = {
    .sq_length = (lenfunc)items_length,
};

static PyTypeObject shmloader_items_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmloader._native.Items",
    .tp_basicsize = sizeof(Items),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Items(buffer, n, offsets_at, codes_at, blob_at, blob_len): the elements of a shared\n"
              "list read from buffer; an int index of an element stored with marshal is read in C,\n"
              "anything else goes to self._item(key).",
    .tp_init = (initproc)items_init,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)items_dealloc,
    .tp_as_mapping = &items_as_mapping,
    .tp_as_sequence = &items_as_sequence,
};

/* Called once by PyInit__native: the type ready and added to the module. */
int shmloader_share_init(PyObject *module) {
    item_name = PyUnicode_InternFromString("_item");
    if (item_name == NULL || PyType_Ready(&shmloader_items_type) < 0) return -1;
    Py_INCREF(&shmloader_items_type);
    if (PyModule_AddObject(module, "Items", (PyObject *)&shmloader_items_type) < 0) {
        Py_DECREF(&shmloader_items_type);
        return -1;
    }
    return PyModule_AddFunctions(module, shmloader_share_methods);
}
