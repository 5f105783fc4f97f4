/*
 * shmloader._native: the slot header codec (synchronisation: native/_sync.c; the read
 * path of shmloader.share(): native/_share.c; the slot table and the consumer's per-batch
 * step: native/_schedule.c; the layout they share: native/_layout.h).
 *
 * A slot's leaf table lists every array the worker wrote into the slot's data
 * region: dtype code, kind (torch tensor or numpy array), byte offset, byte
 * length and shape.  The worker encodes it once per batch; the main process
 * decodes it and bounds-checks every entry before any tensor is built over
 * slot memory, so a torn or corrupted table raises ValueError instead of a
 * tensor reading outside the slot. (These checks are not a defence against a
 * hostile writer: the batch's skeleton goes through an Unpickler. The ring is
 * created with mode 0600, so only the user's own processes can write it.)
 *
 * Wire format (native byte order, all fields 8-byte aligned):
 *   u32 magic 'SHLT' | u32 count
 *   count x { u8 code | u8 kind | u8 ndim | u8 0 | u32 0 | u64 offset |
 *             u64 nbytes | i64 shape[ndim] }
 *
 * Functions take buffers and plain tuples; they hold no Python object graph.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_layout.h"

#define TABLE_MAGIC 0x544C4853u /* "SHLT" little-endian */
#define MAX_NDIM 64 /* torch's limit */
#define ENTRY_FIXED 24
#define LEAF_ALIGN 64
#define N_KINDS 2

/* Item sizes indexed by dtype code; the order is fixed by shmloader/wire/layout.py. */
static const uint8_t ITEMSIZE[] = {
    1,  /* 0 bool */
    1,  /* 1 uint8 */
    1,  /* 2 int8 */
    2,  /* 3 int16 */
    4,  /* 4 int32 */
    8,  /* 5 int64 */
    2,  /* 6 float16 */
    2,  /* 7 bfloat16 */
    4,  /* 8 float32 */
    8,  /* 9 float64 */
    8,  /* 10 complex64 */
    16, /* 11 complex128 */
    2,  /* 12 uint16 */
    4,  /* 13 uint32 */
    8,  /* 14 uint64 */
    4,  /* 15 complex32 (torch only, as are the rest) */
    1,  /* 16 float8_e4m3fn */
    1,  /* 17 float8_e4m3fnuz */
    1,  /* 18 float8_e5m2 */
    1,  /* 19 float8_e5m2fnuz */
    1,  /* 20 float8_e8m0fnu */
    1,  /* 21 float4_e2m1fn_x2 */
    1,  /* 22 bits8 */
    2,  /* 23 bits16 */
    1,  /* 24 bits1x8 */
    1,  /* 25 bits2x4 */
    1,  /* 26 bits4x2 */
    1, 1, 1, 1, 1, 1, 1, /* 27-33 uint1 .. uint7 */
    1, 1, 1, 1, 1, 1, 1, /* 34-40 int1 .. int7 */
};
#define N_CODES ((int)(sizeof(ITEMSIZE) / sizeof(ITEMSIZE[0])))

typedef struct {
    uint8_t code, kind, ndim, pad0;
    uint32_t pad1;
    uint64_t offset;
    uint64_t nbytes;
} entry_head;
_Static_assert(sizeof(entry_head) == ENTRY_FIXED, "an entry's fixed part is ENTRY_FIXED bytes");
#define TABLE_HEAD 8 /* u32 magic | u32 count */

/* nbytes of a leaf, or -1 on overflow / bad shape. */
static int64_t leaf_nbytes(int code, const int64_t *shape, int ndim) {
    uint64_t n = ITEMSIZE[code];
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return -1;
        uint64_t d = (uint64_t)shape[i];
        if (d != 0 && n > (UINT64_MAX >> 1) / d) return -1;
        n *= d;
    }
    if (n > (uint64_t)INT64_MAX) return -1;
    return (int64_t)n;
}

PyDoc_STRVAR(encode_table_doc,
"encode_table($module, buffer, offset, limit, leaves, /)\n"
"--\n\n"
"Write the leaf table for `leaves`, a sequence of (code, kind, offset, shape)\n"
"tuples, into the writable `buffer` at `offset`, using at most `limit` bytes.\n"
"Returns the number of bytes written (table_bytes of the shapes); raises\n"
"ValueError if it does not fit or an entry is malformed (an offset not aligned\n"
"to LEAF_ALIGN included: decode_table would refuse it), TypeError if an entry\n"
"or a shape is not a tuple. It reads a tuple copy of `leaves`, so no Python code\n"
"that runs meanwhile can change what it reads.");

/* What a slot that fails validation raises: shmloader.CorruptSlotError (a ValueError), once
   shmloader._errors has handed it over (set_corrupt_error); a plain ValueError before. */
static PyObject *corrupt_type = NULL;
#define corrupt_error (corrupt_type != NULL ? corrupt_type : PyExc_ValueError)

static PyObject *encode_table(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t offset, limit;
    PyObject *leaves;
    if (!PyArg_ParseTuple(args, "w*nnO", &view, &offset, &limit, &leaves)) return NULL;
    /* A tuple of its own (strong references): nothing the leaves hold can change what is
       read below, whatever Python code runs meanwhile (an int subclass's __index__). */
    PyObject *seq = PySequence_Tuple(leaves);
    if (seq == NULL) { PyBuffer_Release(&view); return NULL; }
    Py_ssize_t count = PyTuple_GET_SIZE(seq);
    PyObject **items = &PyTuple_GET_ITEM(seq, 0);
    if (offset < 0 || limit < 0 || offset > view.len || limit > view.len - offset) {
        PyErr_Format(PyExc_ValueError, "table area [%zd, +%zd) outside buffer of %zd bytes",
                     offset, limit, view.len);
        goto fail;
    }
    char *base = (char *)view.buf + offset;
    Py_ssize_t pos = TABLE_HEAD;
    if (pos > limit) goto too_small;
    for (Py_ssize_t i = 0; i < count; i++) {
        int code, kind;
        long long loff;
        PyObject *shape;
        if (!PyTuple_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "leaf %zd must be a tuple (code, kind, offset, shape), not %s",
                         i, Py_TYPE(items[i])->tp_name);
            goto fail;
        }
        if (!PyArg_ParseTuple(items[i], "iiLO;leaf must be (code, kind, offset, shape)",
                              &code, &kind, &loff, &shape)) goto fail;
        if (code < 0 || code >= N_CODES || kind < 0 || kind >= N_KINDS || loff < 0 || loff % LEAF_ALIGN) {
            PyErr_Format(PyExc_ValueError, "leaf %zd: bad code %d, kind %d or offset %lld (offsets are "
                         "multiples of %d)", i, code, kind, loff, LEAF_ALIGN);
            goto fail;
        }
        if (!PyTuple_Check(shape)) {  /* a tuple: no user __iter__ runs while we read it */
            PyErr_Format(PyExc_TypeError, "leaf %zd: shape must be a tuple, not %s", i, Py_TYPE(shape)->tp_name);
            goto fail;
        }
        Py_INCREF(shape);
        Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
        if (ndim > MAX_NDIM) {
            Py_DECREF(shape);
            PyErr_Format(PyExc_ValueError, "leaf %zd has %zd dimensions (at most %d)", i, ndim, MAX_NDIM);
            goto fail;
        }
        Py_ssize_t need = ENTRY_FIXED + 8 * ndim;
        if (need > limit - pos) { Py_DECREF(shape); goto too_small; }
        int64_t dims[MAX_NDIM];
        for (Py_ssize_t d = 0; d < ndim; d++) {
            dims[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d));
            if (dims[d] == -1 && PyErr_Occurred()) { Py_DECREF(shape); goto fail; }
        }
        Py_DECREF(shape);
        int64_t nbytes = leaf_nbytes(code, dims, (int)ndim);
        if (nbytes < 0) {
            PyErr_Format(PyExc_ValueError, "leaf %zd has a negative or overflowing shape", i);
            goto fail;
        }
        entry_head h = {(uint8_t)code, (uint8_t)kind, (uint8_t)ndim, 0, 0,
                        (uint64_t)loff, (uint64_t)nbytes};
        memcpy(base + pos, &h, sizeof h);
        memcpy(base + pos + ENTRY_FIXED, dims, 8 * (size_t)ndim);
        pos += need;
    }
    uint32_t head[2] = {TABLE_MAGIC, (uint32_t)count};
    memcpy(base, head, sizeof head);
    Py_DECREF(seq);
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(pos);
too_small:
    PyErr_Format(PyExc_ValueError, "leaf table of %zd leaves does not fit in %zd bytes", count, limit);
fail:
    Py_DECREF(seq);
    PyBuffer_Release(&view);
    return NULL;
}

PyDoc_STRVAR(decode_table_doc,
"decode_table($module, buffer, offset, length, data_limit, /)\n"
"--\n\n"
"Decode and validate the leaf table stored in `buffer[offset:offset+length]`.\n"
"Every leaf must have a known dtype code and kind, a non-negative shape whose\n"
"byte size matches its recorded length, an offset aligned to 64 bytes, and lie\n"
"entirely inside [0, data_limit). Returns a list of\n"
"(code, kind, offset, nbytes, shape) tuples; raises ValueError naming the first\n"
"violation.");

/* The leaves of the table at base[0:length] (validated; see decode_table), or NULL with ValueError. */
static PyObject *decode_entries(const char *base, Py_ssize_t length, long long data_limit) {
    if (length < TABLE_HEAD) {
        PyErr_Format(corrupt_error, "leaf table of %zd bytes is shorter than its head", length);
        return NULL;
    }
    uint32_t head[2];
    memcpy(head, base, sizeof head);
    if (head[0] != TABLE_MAGIC) {
        PyErr_Format(corrupt_error, "leaf table magic is 0x%08x, expected 0x%08x", head[0], TABLE_MAGIC);
        return NULL;
    }
    Py_ssize_t count = head[1];
    if (count > (length - TABLE_HEAD) / ENTRY_FIXED) {
        PyErr_Format(corrupt_error, "leaf table claims %zd leaves but holds %zd bytes", count, length);
        return NULL;
    }
    PyObject *out = PyList_New(count);
    if (out == NULL) return NULL;
    Py_ssize_t pos = TABLE_HEAD;
    for (Py_ssize_t i = 0; i < count; i++) {
        entry_head h;
        if (ENTRY_FIXED > length - pos) goto truncated;
        memcpy(&h, base + pos, sizeof h);
        if (h.code >= N_CODES || h.kind >= N_KINDS || h.ndim > MAX_NDIM) {
            PyErr_Format(corrupt_error, "leaf %zd: unknown dtype code %u, kind %u or ndim %u",
                         i, h.code, h.kind, h.ndim);
            goto fail;
        }
        Py_ssize_t need = ENTRY_FIXED + 8 * (Py_ssize_t)h.ndim;
        if (need > length - pos) goto truncated;
        int64_t dims[MAX_NDIM];
        memcpy(dims, base + pos + ENTRY_FIXED, 8 * (size_t)h.ndim);
        int64_t nbytes = leaf_nbytes(h.code, dims, h.ndim);
        if (nbytes < 0 || (uint64_t)nbytes != h.nbytes) {
            PyErr_Format(corrupt_error, "leaf %zd: shape does not match its %llu bytes",
                         i, (unsigned long long)h.nbytes);
            goto fail;
        }
        if (h.offset % LEAF_ALIGN != 0 || h.offset > (uint64_t)data_limit ||
            h.nbytes > (uint64_t)data_limit - h.offset) {
            PyErr_Format(corrupt_error, "leaf %zd: bytes [%llu, +%llu) outside the %lld-byte data region",
                         i, (unsigned long long)h.offset, (unsigned long long)h.nbytes, data_limit);
            goto fail;
        }
        PyObject *shape = PyTuple_New(h.ndim);
        if (shape == NULL) goto fail;
        for (int d = 0; d < h.ndim; d++) {
            PyObject *v = PyLong_FromLongLong(dims[d]);
            if (v == NULL) { Py_DECREF(shape); goto fail; }
            PyTuple_SET_ITEM(shape, d, v);
        }
        PyObject *item = Py_BuildValue("(iiKKN)", h.code, h.kind, (unsigned long long)h.offset,
                                       (unsigned long long)h.nbytes, shape);
        if (item == NULL) goto fail;
        PyList_SET_ITEM(out, i, item);
        pos += need;
    }
    return out;
truncated:
    PyErr_Format(corrupt_error, "leaf table truncated: %zd leaves do not fit in %zd bytes", count, length);
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *decode_table(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t offset, length;
    long long data_limit;
    if (!PyArg_ParseTuple(args, "y*nnL", &view, &offset, &length, &data_limit)) return NULL;
    PyObject *out = NULL;
    if (offset < 0 || length < TABLE_HEAD || offset > view.len || length > view.len - offset || data_limit < 0) {
        PyErr_Format(corrupt_error, "leaf table [%zd, +%zd) outside buffer of %zd bytes",
                     offset, length, view.len);
    } else {
        out = decode_entries((const char *)view.buf + offset, length, data_limit);
    }
    PyBuffer_Release(&view);
    return out;
}

PyDoc_STRVAR(read_slot_doc,
"read_slot($module, ring, header, described, at, room, memory, data, cap, lone, /)\n"
"--\n\n"
"A published slot's leaves. The leaf table and pickled skeleton that the header at\n"
"`ring[header:]` (int64 fields) names must lie inside the `room`-byte region at\n"
"`described[at:]` (the batch's description: in its slot's data region or with its leaves),\n"
"and the leaves the table names inside the `cap`-byte data region at `memory[data:]` (the\n"
"ring itself, or the batch's overflow mapping). Returns (leaves, lone): the decoded table\n"
"(as decode_table) and whether the skeleton is exactly `lone` (a batch that is its one\n"
"leaf). Raises ValueError naming what is wrong.");

/* The header at hdr[header:] and its two spans inside the `cap`-byte data region at data[region:]:
   0 with the header's fields in f, or -1 with ValueError naming what is wrong. */
static int slot_fields(const Py_buffer *hview, Py_ssize_t header, const Py_buffer *dview, Py_ssize_t region,
                       long long cap, int64_t f[N_HEADER_FIELDS]) {
    if (header < 0 || header % 8 != 0 || header > hview->len || N_HEADER_FIELDS * 8 > hview->len - header) {
        PyErr_Format(corrupt_error, "header at %zd outside the buffer", header);
        return -1;
    }
    if (region < 0 || cap < 0 || region > dview->len || cap > dview->len - region) {
        PyErr_Format(corrupt_error, "data region [%zd, +%lld) outside the buffer", region, cap);
        return -1;
    }
    memcpy(f, (const char *)hview->buf + header, N_HEADER_FIELDS * sizeof f[0]);
    static const char *const what[2] = {"leaf table", "pickled skeleton or error"};
    for (int k = 0; k < 2; k++) {
        int64_t off = f[k ? F_PICKLED_OFF : F_TABLE_OFF], len = f[k ? F_PICKLED_LEN : F_TABLE_LEN];
        if (off < 0 || len < 0 || off > cap || len > cap - off) {
            PyErr_Format(corrupt_error, "%s [%lld, +%lld) lies outside the slot's %lld-byte data region",
                         what[k], (long long)off, (long long)len, cap);
            return -1;
        }
    }
    return 0;
}

/* Whether the skeleton the fields f name, in the data region at base, is exactly lone[0:lone_len]. */
static int skeleton_is(const int64_t f[N_HEADER_FIELDS], const char *base, const char *lone, Py_ssize_t lone_len) {
    return f[F_PICKLED_LEN] == lone_len && memcmp(base + f[F_PICKLED_OFF], lone, (size_t)lone_len) == 0;
}

static PyObject *read_slot(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "read_slot takes 9 arguments");
        return NULL;
    }
    /* ring, header, described, at, room, memory, data, cap, lone */
    Py_buffer hview, sview, dview;
    if (PyObject_GetBuffer(args[0], &hview, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[2], &sview, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&hview);
        return NULL;
    }
    if (PyObject_GetBuffer(args[5], &dview, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&sview);
        PyBuffer_Release(&hview);
        return NULL;
    }
    PyObject *out = NULL;
    Py_ssize_t header = PyLong_AsSsize_t(args[1]), at = PyLong_AsSsize_t(args[3]), data = PyLong_AsSsize_t(args[6]);
    long long room = PyLong_AsLongLong(args[4]), cap = PyLong_AsLongLong(args[7]);
    char *lone;
    Py_ssize_t lone_len;
    if (PyErr_Occurred() || PyBytes_AsStringAndSize(args[8], &lone, &lone_len) < 0) goto done;
    if (data < 0 || cap < 0 || data > dview.len || cap > dview.len - data) {
        PyErr_Format(corrupt_error, "data region [%zd, +%lld) outside the buffer", data, cap);
        goto done;
    }
    int64_t f[N_HEADER_FIELDS];
    if (slot_fields(&hview, header, &sview, at, room, f) < 0) goto done;
    const char *described = (const char *)sview.buf + at;
    PyObject *leaves = decode_entries(described + f[F_TABLE_OFF], (Py_ssize_t)f[F_TABLE_LEN], cap);
    if (leaves == NULL) goto done;
    out = Py_BuildValue("(NO)", leaves, skeleton_is(f, described, lone, lone_len) ? Py_True : Py_False);
done:
    PyBuffer_Release(&dview);
    PyBuffer_Release(&sview);
    PyBuffer_Release(&hview);
    return out;
}

/* Indices into lend_lone's `lone` tuple (shmloader/main/lease.py's lone_args). */
enum { L_RING, L_HEADERS, L_DATA, L_CAP, L_SKELETON, L_REGION_FIELD, L_SLOT_REGION, L_TENSOR, L_NP_DTYPES,
       L_MAX_NDIM, L_NDARRAY, L_FROM_NUMPY, L_MAX_LENT, L_U8, L_RECIPES, N_LONE };
/* A recipe's containers (shmloader/main/lease.py's RECIPES). */
enum { R_LIST, R_TUPLE, R_DICT };

PyDoc_STRVAR(lend_lone_doc,
"lend_lone($module, slot, bases, lone, /)\n"
"--\n\n"
"read_batch's common cases and Leases.lend in one call, for a slot just taken: a batch that is\n"
"one tensor in the slot's own data region, or a list, tuple or dict of tensors there whose\n"
"skeleton is a recipe's. `lone` = (ring, header offsets, data offsets, data bytes, LONE_LEAF,\n"
"Field.REGION, Region.SLOT, Kind.TENSOR, NP_DTYPES, _NUMPY_MAX_NDIM, np.ndarray, a tensor maker\n"
"(torch.from_numpy), most slots lent, np.uint8's dtype, recipes: {skeleton bytes: (container,\n"
"leaves, keys)}: container 0 a list, 1 a tuple, 2 a dict of those keys, of that many leaves\n"
"in order). If\n"
"fewer than that many slots are in `bases` and the slot's header and leaf table check and say\n"
"so, a one-tensor batch is the tensor maker's tensor of a fresh array `base` over its bytes,\n"
"a recipe's is its container of the tensor maker's tensors of arrays over a fresh array `base`\n"
"of the slot's data region (as read_batch builds them); bases[slot] = base; returns (batch,\n"
"nbytes). Returns None, having changed nothing, for anything else (another region, another\n"
"skeleton, a leaf that is not a non-empty tensor of a dtype numpy has, a header that does not\n"
"check): read_batch builds that batch, or says what is wrong with it.");

/* Entry i of decode_entries' list as a tensor leaf lend_lone may build: its numpy dtype, shape
   and bytes; 0 when it is not one (read_batch builds it), -1 on an error. */
static int plain_leaf(PyObject *entry, PyObject *np_dtypes, long long tensor, long long max_ndim, PyObject **dtype,
                      PyObject **shape, long long *off, long long *size) {
    /* (code, kind, offset, nbytes, shape), as decode_entries built it */
    long code = PyLong_AsLong(PyTuple_GET_ITEM(entry, 0)), kind = PyLong_AsLong(PyTuple_GET_ITEM(entry, 1));
    *off = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 2));
    *size = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 3));
    *shape = PyTuple_GET_ITEM(entry, 4);
    if (PyErr_Occurred()) return -1;
    if (kind != tensor || code < 0 || code >= PyTuple_GET_SIZE(np_dtypes) || PyTuple_GET_ITEM(np_dtypes, code) == Py_None ||
        PyTuple_GET_SIZE(*shape) > max_ndim || *size <= 0)
        return 0;
    *dtype = PyTuple_GET_ITEM(np_dtypes, code);
    return 1;
}

/* maker(np.ndarray(shape, dtype, buffer, offset)), and that array in *arr (a new reference). */
static PyObject *leaf_of(PyObject *ndarray, PyObject *maker, PyObject *shape, PyObject *dtype, PyObject *buffer,
                         long long offset, PyObject **arr) {
    PyObject *at = PyLong_FromLongLong(offset);
    if (at == NULL) return NULL;
    PyObject *array_args[4] = {shape, dtype, buffer, at};
    *arr = PyObject_Vectorcall(ndarray, array_args, 4, NULL);
    Py_DECREF(at);
    return *arr == NULL ? NULL : PyObject_Vectorcall(maker, arr, 1, NULL);
}

/* A recipe's batch: its container of the leaves `entries` names, views of a fresh array over the
   data region (*base, a new reference); *nbytes their bytes. None when a leaf is not one
   lend_lone builds, NULL on an error. */
static PyObject *by_recipe(PyObject *lone, PyObject *recipe, PyObject *entries, long long data, long long cap,
                           PyObject **base, long long *nbytes) {
    PyObject *np_dtypes = PyTuple_GET_ITEM(lone, L_NP_DTYPES), *ring = PyTuple_GET_ITEM(lone, L_RING),
             *ndarray = PyTuple_GET_ITEM(lone, L_NDARRAY), *maker = PyTuple_GET_ITEM(lone, L_FROM_NUMPY);
    long long tensor = PyLong_AsLongLong(PyTuple_GET_ITEM(lone, L_TENSOR)),
              max_ndim = PyLong_AsLongLong(PyTuple_GET_ITEM(lone, L_MAX_NDIM));
    if (PyErr_Occurred()) return NULL;
    if (!PyTuple_Check(recipe) || PyTuple_GET_SIZE(recipe) != 3) {
        PyErr_SetString(PyExc_TypeError, "lend_lone: a recipe is (container, leaves, keys)");
        return NULL;
    }
    long container = PyLong_AsLong(PyTuple_GET_ITEM(recipe, 0));
    Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GET_ITEM(recipe, 1));
    PyObject *keys = PyTuple_GET_ITEM(recipe, 2);
    if (PyErr_Occurred()) return NULL;
    if ((container != R_LIST && container != R_TUPLE && container != R_DICT) ||
        (container == R_DICT && (!PyTuple_Check(keys) || PyTuple_GET_SIZE(keys) != n))) {
        PyErr_SetString(PyExc_ValueError, "lend_lone: a recipe's container is 0, 1 or 2 (a dict, with a key a leaf)");
        return NULL;
    }
    if (PyList_GET_SIZE(entries) != n) return Py_NewRef(Py_None); /* (a table of other leaves) */
    /* Every leaf checked before anything is made */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *dtype, *shape;
        long long off, size;
        int ok = plain_leaf(PyList_GET_ITEM(entries, i), np_dtypes, tensor, max_ndim, &dtype, &shape, &off, &size);
        if (ok <= 0) return ok < 0 ? NULL : Py_NewRef(Py_None);
    }
    PyObject *shape_args = Py_BuildValue("(L)", cap);
    if (shape_args == NULL) return NULL;
    PyObject *made = NULL, *array_args[4] = {shape_args, PyTuple_GET_ITEM(lone, L_U8), ring, NULL};
    array_args[3] = PyLong_FromLongLong(data);
    *base = array_args[3] == NULL ? NULL : PyObject_Vectorcall(ndarray, array_args, 4, NULL);
    Py_XDECREF(array_args[3]);
    Py_DECREF(shape_args);
    if (*base == NULL) return NULL;
    made = container == R_LIST ? PyList_New(n) : container == R_TUPLE ? PyTuple_New(n) : PyDict_New();
    *nbytes = 0;
    for (Py_ssize_t i = 0; made != NULL && i < n; i++) {
        PyObject *dtype = NULL, *shape, *arr = NULL, *leaf = NULL;
        long long off, size;
        if (plain_leaf(PyList_GET_ITEM(entries, i), np_dtypes, tensor, max_ndim, &dtype, &shape, &off, &size) > 0)
            leaf = leaf_of(ndarray, maker, shape, dtype, *base, off, &arr); /* (checked above: always) */
        else if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "lend_lone: a leaf changed while its batch was built");
        Py_XDECREF(arr);
        *nbytes += size;
        if (leaf == NULL) Py_CLEAR(made);
        else if (container == R_LIST) PyList_SET_ITEM(made, i, leaf);
        else if (container == R_TUPLE) PyTuple_SET_ITEM(made, i, leaf);
        else {
            if (PyDict_SetItem(made, PyTuple_GET_ITEM(keys, i), leaf) < 0) Py_CLEAR(made);
            Py_DECREF(leaf);
        }
    }
    if (made == NULL) Py_CLEAR(*base);
    return made;
}

static PyObject *lend_lone(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyDict_CheckExact(args[1]) || !PyTuple_Check(args[2]) || PyTuple_GET_SIZE(args[2]) != N_LONE ||
        !PyDict_CheckExact(PyTuple_GET_ITEM(args[2], L_RECIPES))) {
        PyErr_SetString(PyExc_TypeError, "lend_lone takes a slot, the lease dict and the lone tuple");
        return NULL;
    }
    PyObject *slot_obj = args[0], *bases = args[1], *lone = args[2];
    PyObject *headers = PyTuple_GET_ITEM(lone, L_HEADERS), *datas = PyTuple_GET_ITEM(lone, L_DATA),
             *np_dtypes = PyTuple_GET_ITEM(lone, L_NP_DTYPES);
    if (!PyTuple_Check(headers) || !PyTuple_Check(datas) || !PyTuple_Check(np_dtypes) ||
        PyTuple_GET_SIZE(headers) != PyTuple_GET_SIZE(datas)) {
        PyErr_SetString(PyExc_TypeError, "lend_lone: header and data offsets must be tuples of one length");
        return NULL;
    }
    Py_ssize_t slot = PyLong_AsSsize_t(slot_obj), max_lent = PyLong_AsSsize_t(PyTuple_GET_ITEM(lone, L_MAX_LENT));
    long long cap = PyLong_AsLongLong(PyTuple_GET_ITEM(lone, L_CAP)),
              region_field = PyLong_AsLongLong(PyTuple_GET_ITEM(lone, L_REGION_FIELD)),
              slot_region = PyLong_AsLongLong(PyTuple_GET_ITEM(lone, L_SLOT_REGION)),
              tensor = PyLong_AsLongLong(PyTuple_GET_ITEM(lone, L_TENSOR)),
              max_ndim = PyLong_AsLongLong(PyTuple_GET_ITEM(lone, L_MAX_NDIM));
    if (PyErr_Occurred()) return NULL;
    if (slot < 0 || slot >= PyTuple_GET_SIZE(headers) || region_field < 0 || region_field >= N_HEADER_FIELDS) {
        PyErr_Format(PyExc_ValueError, "lend_lone: slot %zd or header field %lld out of range", slot, region_field);
        return NULL;
    }
    if (PyDict_GET_SIZE(bases) >= max_lent) Py_RETURN_NONE; /* the caller decides whether to copy */
    Py_ssize_t header = PyLong_AsSsize_t(PyTuple_GET_ITEM(headers, slot)),
               data = PyLong_AsSsize_t(PyTuple_GET_ITEM(datas, slot));
    char *skeleton;
    Py_ssize_t skeleton_len;
    if (PyErr_Occurred() || PyBytes_AsStringAndSize(PyTuple_GET_ITEM(lone, L_SKELETON), &skeleton, &skeleton_len) < 0)
        return NULL;
    PyObject *ring = PyTuple_GET_ITEM(lone, L_RING), *entries = NULL, *arr = NULL, *out = NULL, *recipe = NULL,
             *batch = NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(ring, &view, PyBUF_SIMPLE) < 0) return NULL;
    int64_t f[N_HEADER_FIELDS];
    if (slot_fields(&view, header, &view, data, cap, f) < 0) {
        PyErr_Clear(); /* read_batch says what is wrong */
        goto none;
    }
    const char *base = (const char *)view.buf + data;
    if (f[region_field] != slot_region) goto none;
    int one = skeleton_is(f, base, skeleton, skeleton_len);
    if (!one) { /* (slot_fields checked the skeleton's span) */
        /* Compared in place, by length first: a skeleton that is no recipe's (one with the
           batch's strings, say) is neither copied nor hashed. No Python code runs meanwhile. */
        const char *pickled = base + f[F_PICKLED_OFF];
        Py_ssize_t pos = 0, pickled_len = (Py_ssize_t)f[F_PICKLED_LEN];
        PyObject *key, *value;
        while (recipe == NULL && PyDict_Next(PyTuple_GET_ITEM(lone, L_RECIPES), &pos, &key, &value))
            if (PyBytes_Check(key) && PyBytes_GET_SIZE(key) == pickled_len &&
                memcmp(PyBytes_AS_STRING(key), pickled, (size_t)pickled_len) == 0)
                recipe = Py_NewRef(value);
        if (recipe == NULL) goto none;
    }
    entries = decode_entries(base + f[F_TABLE_OFF], (Py_ssize_t)f[F_TABLE_LEN], cap);
    if (entries == NULL) {
        if (!PyErr_ExceptionMatches(corrupt_error)) goto done;
        PyErr_Clear();
        goto none;
    }
    PyBuffer_Release(&view); /* the arrays take their own export of the ring */
    view.obj = NULL;
    long long size;
    if (!one) {
        if (PyList_GET_SIZE(entries) == 0) goto none;
        batch = by_recipe(lone, recipe, entries, data, cap, &arr, &size);
        if (batch == NULL) goto done;
        if (batch == Py_None) goto none;
    } else {
        if (PyList_GET_SIZE(entries) != 1) goto none;
        PyObject *dtype, *shape;
        long long off;
        int ok = plain_leaf(PyList_GET_ITEM(entries, 0), np_dtypes, tensor, max_ndim, &dtype, &shape, &off, &size);
        if (ok <= 0) {
            if (ok < 0) goto done;
            goto none;
        }
        batch = leaf_of(PyTuple_GET_ITEM(lone, L_NDARRAY), PyTuple_GET_ITEM(lone, L_FROM_NUMPY), shape, dtype, ring,
                        (long long)data + off, &arr);
        if (batch == NULL) goto done;
    }
    out = Py_BuildValue("(OL)", batch, size);
    if (out != NULL && PyDict_SetItem(bases, slot_obj, arr) < 0) Py_CLEAR(out);
    goto done;
none:
    out = Py_NewRef(Py_None);
done:
    Py_XDECREF(batch);
    Py_XDECREF(arr);
    Py_XDECREF(recipe);
    Py_XDECREF(entries);
    if (view.obj != NULL) PyBuffer_Release(&view);
    return out;
}

PyDoc_STRVAR(same_attr_doc,
"same_attr($module, items, name, /)\n"
"--\n\n"
"The attribute `name` of every element of the sequence `items` when it is one and the same\n"
"object for all of them (a batch of tensors of one dtype: `same_attr(batch, \"dtype\")`);\n"
"None when they differ or the list is empty. What getting the attribute raises, it raises.");

/* The attribute `name` of `item`. A batch's items share one type, so its getset descriptor is
   looked up once (`*type`, `*getter`; the caller releases `*type`) and called directly: what
   PyObject_GetAttr would call for a data descriptor of a type with the generic getattr. */
static PyObject *attr_of(PyObject *item, PyObject *name, PyTypeObject **type, PyGetSetDef **getter) {
    PyTypeObject *tp = Py_TYPE(item);
    if (tp != *type) {
        Py_XDECREF(*type);
        Py_INCREF(tp);
        *type = tp;
        *getter = NULL;
        PyObject *descr = tp->tp_getattro == PyObject_GenericGetAttr ? _PyType_Lookup(tp, name) : NULL;
        if (descr != NULL && Py_IS_TYPE(descr, &PyGetSetDescr_Type) && ((PyGetSetDescrObject *)descr)->d_getset->get)
            *getter = ((PyGetSetDescrObject *)descr)->d_getset;
    }
    if (*getter != NULL) return (*getter)->get(item, (*getter)->closure);
    return PyObject_GetAttr(item, name);
}

static PyObject *same_attr(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "same_attr takes a sequence and an attribute name");
        return NULL;
    }
    PyObject *items = PySequence_Fast(args[0], "same_attr takes a sequence"), *name = args[1], *first = NULL;
    if (items == NULL) return NULL;
    PyObject *result = NULL;
    PyTypeObject *type = NULL;
    PyGetSetDef *getter = NULL;
    /* The size is read afresh at every step: a getter may run Python code that changes a list. */
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items); i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(items, i);
        Py_INCREF(item);
        PyObject *value = attr_of(item, name, &type, &getter);
        Py_DECREF(item);
        if (value == NULL) goto done;
        if (first == NULL) {
            first = value;
            continue;
        }
        int same = value == first;
        Py_DECREF(value);
        if (!same) {
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    result = first != NULL ? Py_NewRef(first) : Py_NewRef(Py_None);
done:
    Py_XDECREF(type);
    Py_XDECREF(first);
    Py_DECREF(items);
    return result;
}

PyDoc_STRVAR(unviewed_doc,
"unviewed($module, bases, remove, /)\n"
"--\n\n"
"The keys of the dict `bases` whose value nothing but the dict references (a lent slot's base\n"
"array once every view of its batch is gone), as a list; with `remove` true they leave the dict\n"
"in the same call (atomic under the GIL: another thread's dict.pop gets a key or this does).");

static PyObject *unviewed(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyDict_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "unviewed takes a dict and a flag");
        return NULL;
    }
    int remove = PyObject_IsTrue(args[1]);
    if (remove < 0) return NULL;
    PyObject *bases = args[0], *out = PyList_New(0), *key, *value;
    if (out == NULL) return NULL;
    Py_ssize_t pos = 0;
    while (PyDict_Next(bases, &pos, &key, &value)) {
        if (Py_REFCNT(value) == 1 && PyList_Append(out, key) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    /* Dropping a base runs no Python code (a numpy array over the ring's mapping): the dict
       cannot change between the loops. */
    for (Py_ssize_t i = 0; remove && i < PyList_GET_SIZE(out); i++) {
        if (PyDict_DelItem(bases, PyList_GET_ITEM(out, i)) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

PyDoc_STRVAR(set_corrupt_error_doc, "set_corrupt_error(type, /)\n--\n\n"
"The exception type a slot that fails validation raises (shmloader.CorruptSlotError, a\n"
"subclass of ValueError).");

static PyObject *set_corrupt_error(PyObject *self, PyObject *type) {
    if (!PyType_Check(type) || !PyType_IsSubtype((PyTypeObject *)type, (PyTypeObject *)PyExc_ValueError)) {
        PyErr_SetString(PyExc_TypeError, "set_corrupt_error takes a subclass of ValueError");
        return NULL;
    }
    Py_INCREF(type);
    Py_XSETREF(corrupt_type, type);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"set_corrupt_error", set_corrupt_error, METH_O, set_corrupt_error_doc},
    {"unviewed", (PyCFunction)(void (*)(void))unviewed, METH_FASTCALL, unviewed_doc},
    {"same_attr", (PyCFunction)(void (*)(void))same_attr, METH_FASTCALL, same_attr_doc},
    {"encode_table", encode_table, METH_VARARGS, encode_table_doc},
    {"decode_table", decode_table, METH_VARARGS, decode_table_doc},
    {"read_slot", (PyCFunction)(void (*)(void))read_slot, METH_FASTCALL, read_slot_doc},
    {"lend_lone", (PyCFunction)(void (*)(void))lend_lone, METH_FASTCALL, lend_lone_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shmloader._native",
    .m_doc = "Slot header codec of shmloader (see native/_native.c).",
    .m_size = -1,
    .m_methods = methods,
};

/* ITEMSIZES: the item size of every dtype code, for shmloader/wire/layout.py to check DTYPES against. */
static int add_itemsizes(PyObject *m) {
    PyObject *t = PyTuple_New(N_CODES);
    if (t == NULL) return -1;
    for (int i = 0; i < N_CODES; i++) {
        PyObject *v = PyLong_FromLong(ITEMSIZE[i]);
        if (v == NULL) { Py_DECREF(t); return -1; }
        PyTuple_SET_ITEM(t, i, v);
    }
    return PyModule_AddObject(m, "ITEMSIZES", t) < 0 ? (Py_DECREF(t), -1) : 0;
}

/* LAYOUT: native/_layout.h's names and values, for shmloader/wire/layout.py to check its own against. */
static int add_layout(PyObject *m) {
    PyObject *d = PyDict_New();
    if (d == NULL) return -1;
#define ADD_NAME(name)                                                 \
    {                                                                  \
        PyObject *v = PyLong_FromLong(name);                           \
        if (v == NULL || PyDict_SetItemString(d, #name, v) < 0) {      \
            Py_XDECREF(v);                                             \
            Py_DECREF(d);                                              \
            return -1;                                                 \
        }                                                              \
        Py_DECREF(v);                                                  \
    }
    SHMLOADER_LAYOUT_NAMES(ADD_NAME)
#undef ADD_NAME
    return PyModule_AddObject(m, "LAYOUT", d) < 0 ? (Py_DECREF(d), -1) : 0;
}

extern PyMethodDef shmloader_sync_methods[]; /* native/_sync.c */
extern PyMethodDef shmloader_tensors_methods[]; /* native/_tensors.c */
extern const int shmloader_sem_stride;
int shmloader_share_init(PyObject *module); /* native/_share.c */
int shmloader_schedule_init(PyObject *module); /* native/_schedule.c */
int shmloader_pages_init(PyObject *module); /* native/_pages.c */

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddFunctions(m, shmloader_sync_methods) < 0 || PyModule_AddFunctions(m, shmloader_tensors_methods) < 0 ||
        PyModule_AddIntConstant(m, "SEM_STRIDE", shmloader_sem_stride) < 0 ||
        PyModule_AddIntConstant(m, "N_CODES", N_CODES) < 0 ||
        PyModule_AddIntConstant(m, "LEAF_ALIGN", LEAF_ALIGN) < 0 ||
        PyModule_AddIntConstant(m, "MAX_NDIM", MAX_NDIM) < 0 ||
        PyModule_AddIntConstant(m, "N_KINDS", N_KINDS) < 0 ||
        PyModule_AddIntConstant(m, "TABLE_HEAD", TABLE_HEAD) < 0 ||
        PyModule_AddIntConstant(m, "ENTRY_FIXED", ENTRY_FIXED) < 0 ||
        add_layout(m) < 0 || add_itemsizes(m) < 0 || shmloader_share_init(m) < 0 || shmloader_schedule_init(m) < 0 ||
        shmloader_pages_init(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
