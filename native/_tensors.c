/*
 * shmloader._native's stack_into: torch.stack(samples, 0, out=out) as one memcpy per plain
 * sample, without torch's C++ API, so that one build works under every torch (no C++ ABI to
 * match, no torch at build time).
 *
 * What it reads of a tensor, and how it knows where:
 *   - its TensorImpl: the one pointer of the at::Tensor inside the Python object, at an offset
 *     learn_tensors finds by matching Tensor._cdata (torch's own answer) in probe tensors;
 *   - its dispatch key set, a word of the TensorImpl, at the offset where probes of different
 *     key sets (plain, conjugate, negative, meta, zero) all hold the value
 *     torch._C._dispatch_keys(t).raw_repr() gives. A sample whose key set is a plain CPU
 *     tensor's is dense, strided, on the CPU, and carries no conjugate, negative or zero bit,
 *     nothing nested, quantized, batched or functionalised;
 *   - dtype, sizes, strides and data pointer through torch's C shim (aoti_torch_*, extern "C"
 *     and kept stable across torch versions), looked up in libtorch_cpu at learn time;
 *   - whether it may need grad: its autograd metadata, a TensorImpl word that is null until
 *     autograd has something to keep (TensorImpl::requires_grad() is false while it is), found
 *     as the first word null in fresh probes and set in probes that need grad; where it is set,
 *     torch's own requires_grad getter says (a view, say, has metadata and needs no grad).
 * Each offset is checked against torch's answers for every probe before anything uses it, and
 * the shim through them against each CPU probe's data pointer, sizes and strides; a torch whose
 * tensors do not match leaves stack_into unlearned and shmloader uses torch.stack
 * (learn_tensors says why). One difference from stack(out=) is left: out's version counter is
 * not bumped (out is a worker's view of its slot, in no autograd graph).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>

typedef void *TensorHandle; /* torch's AtenTensorHandle: a pointer to an at::Tensor */
typedef int32_t (*dtype_fn)(TensorHandle, int32_t *);
typedef int32_t (*dim_fn)(TensorHandle, int64_t *);
typedef int32_t (*ints_fn)(TensorHandle, int64_t **);
typedef int32_t (*ptr_fn)(TensorHandle, void **);

/* Bytes of a TensorImpl searched for its key set, from the start (stopping at the first match):
   torch 2.13's is at 168, its last field. Where it is not found (a torch whose layout differs),
   the scan reads up to this bound from the object's start, past its end: heap memory, mapped. */
#define KEYS_SCAN 320
#define RELEASE_GIL_FROM (1 << 20) /* bytes: a smaller batch is copied holding the GIL */
#define MAX_DIM 64
#define N_DTYPES 64 /* torch's ScalarType codes are below this */

static struct {
    int learned;
    PyTypeObject *tensor_type;      /* torch.Tensor: samples must be exactly it */
    Py_ssize_t impl_at;             /* the at::Tensor's offset in the Python object */
    Py_ssize_t keys_at;             /* the key set's offset in the TensorImpl */
    Py_ssize_t autograd_at;         /* the autograd metadata pointer's offset in the TensorImpl */
    uint64_t plain_keys[2];         /* a plain CPU tensor's key set, and one made in inference mode
                                       (a sample may have either; out only the first, as stack(out=)
                                       refuses an inference tensor outside inference mode) */
    getter requires_grad;           /* Tensor.requires_grad's C getter, and its closure */
    void *requires_grad_closure;
    PyObject *function_mode;        /* torch._C._is_torch_function_mode_enabled */
    PyObject *dispatch_modes;       /* torch._C._len_torch_dispatch_stack */
    PyObject *untyped_storage;      /* Tensor.untyped_storage (the type's, not an instance's): a
                                       storage kept while the GIL is released */
    dtype_fn get_dtype;
    dim_fn get_dim;
    ints_fn get_sizes, get_strides;
    ptr_fn get_data_ptr;            /* the mutable pointer: out's */
    ptr_fn get_const_data_ptr;      /* a sample's (a copy-on-write sample stays shared; torch >= 2.10,
                                       else get_data_ptr) */
    uint8_t itemsize[N_DTYPES];     /* by dtype code; 0: a dtype learn_tensors was not shown */
} T;

static TensorHandle handle_of(PyObject *t) { return (char *)t + T.impl_at; }
static char *impl_of(PyObject *t) { return *(char **)((char *)t + T.impl_at); }

/* The shape, data pointer and dtype of a tensor that is exactly torch.Tensor, a plain CPU
   tensor, contiguous, and needs no grad; 0 when it is not (or the shim failed). */
typedef struct {
    int32_t dtype;
    int64_t dim;
    int64_t *sizes;
    char *data;
} Plain;

static int plain(PyObject *t, Plain *p, int is_out) {
    if (Py_TYPE(t) != T.tensor_type) return 0; /* subclasses: their __torch_function__ */
    char *impl = impl_of(t);
    uint64_t keys = *(uint64_t *)(impl + T.keys_at);
    if (keys != T.plain_keys[0] && (is_out || keys != T.plain_keys[1])) return 0;
    if (*(void **)(impl + T.autograd_at) != NULL) { /* (runs no Python code: an exact tensor, no mode) */
        PyObject *grad = T.requires_grad(t, T.requires_grad_closure);
        if (grad == NULL) return -1;
        Py_DECREF(grad);
        if (grad != Py_False) return 0;
    }
    TensorHandle h = handle_of(t);
    int64_t *strides;
    void *data;
    if (T.get_dtype(h, &p->dtype) || T.get_dim(h, &p->dim) || T.get_sizes(h, &p->sizes) ||
        T.get_strides(h, &strides) || (is_out ? T.get_data_ptr : T.get_const_data_ptr)(h, &data))
        return 0;
    int64_t expected = 1; /* contiguous as torch means it: size-1 dimensions' strides do not count */
    for (int64_t d = p->dim - 1; d >= 0; d--) {
        if (p->sizes[d] == 0) break; /* (no elements: contiguous) */
        if (p->sizes[d] != 1 && strides[d] != expected) return 0;
        expected *= p->sizes[d];
    }
    p->data = data;
    return 1;
}

static int overlaps(const char *a, size_t na, const char *b, size_t nb) { return a < b + nb && b < a + na; }

/* Whether a torch function mode or dispatch mode is active: they see torch.stack. */
static int modes_active(void) {
    PyObject *f = PyObject_CallNoArgs(T.function_mode);
    if (f == NULL) return -1;
    int on = PyObject_IsTrue(f);
    Py_DECREF(f);
    if (on != 0) return on;
    PyObject *d = PyObject_CallNoArgs(T.dispatch_modes);
    if (d == NULL) return -1;
    on = PyObject_IsTrue(d);
    Py_DECREF(d);
    return on;
}

PyDoc_STRVAR(stack_into_doc,
"stack_into($module, samples, out, /)\n"
"--\n\n"
"torch.stack(samples, 0, out=out) as one memcpy per sample, for a list or tuple of plain\n"
"contiguous CPU tensors of out's dtype and sample shape (exact torch.Tensor, no grad,\n"
"conjugate or negative bit, not inside out; no torch function or dispatch mode active).\n"
"Returns True when it stacked them; False, having written nothing, for anything else, or\n"
"before learn_tensors (torch.stack then does it, or raises its own error). Unlike\n"
"stack(out=), it leaves out's version counter as it was.");

/* out's dtype, shape and bytes, when stack_into may copy into it (0: it may not; -1: an error). */
static int out_of(PyObject *out, Py_ssize_t n, Plain *o, size_t *each) {
    int ok = plain(out, o, 1);
    if (ok <= 0 || n == 0 || o->dim < 1 || o->dim > MAX_DIM || o->sizes[0] != n || o->dtype < 0 ||
        o->dtype >= N_DTYPES || T.itemsize[o->dtype] == 0)
        return ok < 0 ? -1 : 0;
    *each = T.itemsize[o->dtype];
    for (int64_t d = 1; d < o->dim; d++) *each *= (size_t)o->sizes[d];
    return 1;
}

/* Storages kept for a copy without the GIL: one per sample, and out's last. Taking them runs
   Python code (an allocation can start a collection): the caller checks everything after. */
static PyObject *storages_of(PyObject *items, PyObject *out) {
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    PyObject *kept = PyTuple_New(n + 1);
    for (Py_ssize_t i = 0; kept != NULL && i <= n; i++) {
        PyObject *storage = PyObject_CallOneArg(T.untyped_storage, i < n ? PyTuple_GET_ITEM(items, i) : out);
        if (storage == NULL) Py_CLEAR(kept);
        else PyTuple_SET_ITEM(kept, i, storage);
    }
    return kept;
}

static PyObject *stack_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || (T.learned && !PyObject_TypeCheck(args[1], T.tensor_type))) {
        PyErr_SetString(PyExc_TypeError, "stack_into takes a list of samples and the tensor to stack them into");
        return NULL;
    }
    PyObject *samples = args[0], *out = args[1];
    if (!T.learned || (!PyList_CheckExact(samples) && !PyTuple_CheckExact(samples))) Py_RETURN_FALSE;
    int ok = modes_active();
    if (ok != 0) return ok < 0 ? NULL : Py_NewRef(Py_False);
    Plain o;
    size_t each;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(samples);
    if ((ok = out_of(out, n, &o, &each)) <= 0) return ok < 0 ? NULL : Py_NewRef(Py_False);
    size_t total = each * (size_t)n;
    /* A large batch is copied without the GIL, so that a thread of the dataset's own is not
       stalled by it: the samples (a tuple of them) and every storage are then kept, so that
       no other thread's set_ or resize_ frees what is read or written. Taking them may run
       Python code, so out is checked again after. Below, until the copy, no Python code runs
       (requires_grad's getter of an exact tensor with no mode active runs none). */
    int release = each != 0 && total >= RELEASE_GIL_FROM;
    PyObject *items = release ? PySequence_Tuple(samples) : Py_NewRef(samples);
    PyObject *kept = release && items != NULL ? storages_of(items, out) : NULL;
    if (items == NULL || (release && kept == NULL)) goto fail;
    if (release) {
        n = PyTuple_GET_SIZE(items);
        size_t again;
        if ((ok = out_of(out, n, &o, &again)) <= 0 || again != each) goto refuse_or_fail;
    }
    /* Every sample checked before any byte is written: on False the slot is as it was. */
    const char **from = PyMem_Malloc(sizeof(char *) * (size_t)n);
    if (from == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Plain s;
        ok = plain(PySequence_Fast_GET_ITEM(items, i), &s, 0);
        int same = ok > 0 && s.dtype == o.dtype && s.dim + 1 == o.dim;
        for (int64_t d = 0; same && d < s.dim; d++) same = s.sizes[d] == o.sizes[d + 1];
        if (!same || (each && overlaps(s.data, each, o.data, total))) { /* (torch.stack raises for an overlap) */
            PyMem_Free(from);
            ok = ok < 0 ? -1 : 0;
            goto refuse_or_fail;
        }
        from[i] = s.data;
    }
    if (release) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) memcpy(o.data + (size_t)i * each, from[i], each);
        Py_END_ALLOW_THREADS
    } else if (each) {
        for (Py_ssize_t i = 0; i < n; i++) memcpy(o.data + (size_t)i * each, from[i], each);
    }
    PyMem_Free(from);
    Py_XDECREF(kept);
    Py_DECREF(items);
    Py_RETURN_TRUE;
refuse_or_fail:
    if (ok == 0) {
        Py_XDECREF(kept);
        Py_DECREF(items);
        Py_RETURN_FALSE;
    }
fail:
    Py_XDECREF(kept);
    Py_XDECREF(items);
    return NULL;
}

/* learn_tensors ------------------------------------------------------------------------- */

static PyObject *refuse(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    PyObject *why = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    return why;
}

static void *shim(void *lib, const char *name, PyObject **why) {
    void *f = dlsym(lib, name);
    if (f == NULL && *why == NULL) *why = refuse("libtorch_cpu has no %s", name);
    return f;
}

/* The offset in [from, to) of a word that holds want[i] in every object base[i], the first
   one; -1 if none does. */
static Py_ssize_t find_word(char *const *base, const uint64_t *want, Py_ssize_t n, Py_ssize_t from, Py_ssize_t to) {
    for (Py_ssize_t at = from; at + (Py_ssize_t)sizeof(uint64_t) <= to; at += sizeof(uint64_t)) {
        Py_ssize_t i = 0;
        while (i < n && *(uint64_t *)(base[i] + at) == want[i]) i++;
        if (i == n) return at;
    }
    return -1;
}

PyDoc_STRVAR(learn_tensors_doc,
"learn_tensors($module, lib, tensor_type, requires_grad, untyped_storage, modes, dtypes, probes,\n"
"              fresh, graded, /)\n"
"--\n\n"
"Learn where torch keeps what stack_into reads, and check it (native/_tensors.c says how).\n"
"`lib`: the path of the loaded libtorch_cpu (found by its name first); `tensor_type`:\n"
"torch.Tensor; `requires_grad`, `untyped_storage`: its descriptors; `modes`:\n"
"torch._C._is_torch_function_mode_enabled and _len_torch_dispatch_stack; `dtypes`: (empty\n"
"tensor, item size) for each dtype stack_into may copy; `probes`: (tensor, its _cdata, its\n"
"dispatch keys' raw_repr(), its data_ptr(), its shape, its stride()), a plain CPU tensor\n"
"first, one made in inference mode second, then tensors of other key sets; `fresh`: new\n"
"tensors, no autograd metadata; `graded`: tensors that need grad. None once learned;\n"
"otherwise why not (a string), and stack_into stays unlearned.");

/* The objects' TensorImpls, in impl[] (at most 16 tensors of tensor_type); -1 with a TypeError. */
static Py_ssize_t impls_of(PyObject *list, PyTypeObject *type, char **impl) {
    if (!PyList_Check(list) || PyList_GET_SIZE(list) < 2 || PyList_GET_SIZE(list) > 16) {
        PyErr_SetString(PyExc_TypeError, "learn_tensors takes lists of 2 to 16 tensors");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        if (!Py_IS_TYPE(PyList_GET_ITEM(list, i), type)) {
            PyErr_SetString(PyExc_TypeError, "learn_tensors takes lists of tensors");
            return -1;
        }
        impl[i] = impl_of(PyList_GET_ITEM(list, i));
    }
    return PyList_GET_SIZE(list);
}

/* Whether the shim, through the handle learned, says of `t` what torch says: its data pointer,
   shape and strides (tuples of ints). */
static int shim_agrees(PyObject *t, uint64_t data, PyObject *shape, PyObject *stride) {
    TensorHandle h = handle_of(t);
    void *ptr;
    int64_t dim, *sizes, *strides;
    if (T.get_data_ptr(h, &ptr) || (uint64_t)(uintptr_t)ptr != data || T.get_const_data_ptr(h, &ptr) ||
        (uint64_t)(uintptr_t)ptr != data || T.get_dim(h, &dim) || T.get_sizes(h, &sizes) ||
        T.get_strides(h, &strides) || !PyTuple_Check(shape) || !PyTuple_Check(stride) ||
        PyTuple_GET_SIZE(shape) != dim || PyTuple_GET_SIZE(stride) != dim)
        return 0;
    for (int64_t d = 0; d < dim; d++)
        if (PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d)) != sizes[d] ||
            PyLong_AsLongLong(PyTuple_GET_ITEM(stride, d)) != strides[d])
            return 0;
    return !PyErr_Occurred();
}

static PyObject *learn_tensors(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const char *path;
    if (nargs != 9 || !(path = PyUnicode_AsUTF8(args[0])) || !PyType_Check(args[1]) || !PyTuple_Check(args[4]) ||
        PyTuple_GET_SIZE(args[4]) != 2 || !PyList_Check(args[5]) || !PyList_Check(args[6]) ||
        PyList_GET_SIZE(args[6]) < 4 || PyList_GET_SIZE(args[6]) > 16) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "learn_tensors takes a path, a type, two descriptors, two callables, "
                                             "a list of dtypes, a list of 4 to 16 probes and two lists of tensors");
        return NULL;
    }
    T.learned = 0;
    PyTypeObject *type = (PyTypeObject *)args[1];
    PyObject *descr = args[2], *probes = args[6], *why = NULL;
    if (!Py_IS_TYPE(descr, &PyGetSetDescr_Type) || ((PyGetSetDescrObject *)descr)->d_getset->get == NULL)
        return refuse("Tensor.requires_grad is not a C getter");
    if (!PyCallable_Check(args[3])) return refuse("Tensor.untyped_storage is not callable");
    /* By its name first: the loaded library wherever it lies (torch's lib directory, or a
       distribution's); then by the path torch's package implies. */
    void *lib = dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) return refuse("%s is not loaded", path);
    T.get_dtype = (dtype_fn)shim(lib, "aoti_torch_get_dtype", &why);
    T.get_dim = (dim_fn)shim(lib, "aoti_torch_get_dim", &why);
    T.get_sizes = (ints_fn)shim(lib, "aoti_torch_get_sizes", &why);
    T.get_strides = (ints_fn)shim(lib, "aoti_torch_get_strides", &why);
    T.get_data_ptr = (ptr_fn)shim(lib, "aoti_torch_get_data_ptr", &why);
    T.get_const_data_ptr = (ptr_fn)dlsym(lib, "torch_get_const_data_ptr");
    if (T.get_const_data_ptr == NULL) T.get_const_data_ptr = T.get_data_ptr;
    dlclose(lib); /* (RTLD_NOLOAD took a reference: torch keeps it loaded) */
    if (why != NULL) return why;

    Py_ssize_t n = PyList_GET_SIZE(probes);
    PyObject *tensor[16], *shape[16], *stride[16];
    char *object[16], *impl[16];
    uint64_t cdata[16], keys[16], data[16];
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PyList_GET_ITEM(probes, i);
        if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) != 6 || !Py_IS_TYPE(PyTuple_GET_ITEM(p, 0), type)) {
            PyErr_SetString(PyExc_TypeError, "a probe is (tensor, _cdata, raw keys, data_ptr, shape, stride)");
            return NULL;
        }
        tensor[i] = PyTuple_GET_ITEM(p, 0);
        object[i] = (char *)tensor[i];
        cdata[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(p, 1));
        keys[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(p, 2));
        data[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(p, 3));
        shape[i] = PyTuple_GET_ITEM(p, 4);
        stride[i] = PyTuple_GET_ITEM(p, 5);
        if (PyErr_Occurred()) return NULL;
    }
    Py_ssize_t impl_at = find_word(object, cdata, n, sizeof(PyObject), type->tp_basicsize);
    if (impl_at < 0) return refuse("no word of a %zd-byte tensor object holds its TensorImpl", type->tp_basicsize);
    for (Py_ssize_t i = 0; i < n; i++) impl[i] = (char *)(uintptr_t)cdata[i];
    /* (stops at the first match: every read is inside the TensorImpl, up to its key set) */
    Py_ssize_t keys_at = find_word(impl, keys, n, 0, KEYS_SCAN);
    if (keys_at < 0) return refuse("no word of the first %d bytes of a TensorImpl holds its key set", KEYS_SCAN);
    T.impl_at = impl_at;
    T.keys_at = keys_at;
    char *fresh[16], *graded[16];
    Py_ssize_t n_fresh = impls_of(args[7], type, fresh), n_graded = impls_of(args[8], type, graded);
    if (n_fresh < 0 || n_graded < 0) return NULL;
    Py_ssize_t autograd_at = -1;
    for (Py_ssize_t at = 0; autograd_at < 0 && at < keys_at; at += sizeof(void *)) {
        Py_ssize_t i = 0, j = 0;
        while (i < n_fresh && *(void **)(fresh[i] + at) == NULL) i++;
        while (j < n_graded && *(void **)(graded[j] + at) != NULL) j++;
        if (i == n_fresh && j == n_graded) autograd_at = at;
    }
    if (autograd_at < 0) return refuse("no word of a TensorImpl is null without autograd metadata and set with it");
    T.autograd_at = autograd_at;
    /* The shim, through the handle found, must say what torch says of the CPU probes. */
    for (Py_ssize_t i = 0; i < 2; i++)
        if (!shim_agrees(tensor[i], data[i], shape[i], stride[i]))
            return PyErr_Occurred() ? NULL : refuse("torch's C shim does not say what torch says of a probe");
    memset(T.itemsize, 0, sizeof T.itemsize);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(args[5]); i++) {
        PyObject *d = PyList_GET_ITEM(args[5], i);
        int32_t code = -1;
        long size;
        if (!PyTuple_Check(d) || PyTuple_GET_SIZE(d) != 2 || !Py_IS_TYPE(PyTuple_GET_ITEM(d, 0), type)) {
            PyErr_SetString(PyExc_TypeError, "a dtype is (empty tensor, item size)");
            return NULL;
        }
        if ((size = PyLong_AsLong(PyTuple_GET_ITEM(d, 1))) == -1 && PyErr_Occurred()) return NULL;
        if (T.get_dtype(handle_of(PyTuple_GET_ITEM(d, 0)), &code) || code < 0 || code >= N_DTYPES || size < 1 ||
            size > 16 || T.itemsize[code] != 0) /* (two dtypes of one code: the table is not torch's) */
            return refuse("torch's C shim gives dtype code %d", (int)code);
        T.itemsize[code] = (uint8_t)size;
    }
    T.plain_keys[0] = keys[0];
    T.plain_keys[1] = keys[1];
    T.requires_grad = ((PyGetSetDescrObject *)descr)->d_getset->get;
    T.requires_grad_closure = ((PyGetSetDescrObject *)descr)->d_getset->closure;
    Py_XSETREF(T.tensor_type, (PyTypeObject *)Py_NewRef(type));
    Py_XSETREF(T.untyped_storage, Py_NewRef(args[3]));
    Py_XSETREF(T.function_mode, Py_NewRef(PyTuple_GET_ITEM(args[4], 0)));
    Py_XSETREF(T.dispatch_modes, Py_NewRef(PyTuple_GET_ITEM(args[4], 1)));
    T.learned = 1;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(tensor_offsets_doc,
"tensor_offsets($module, /)\n"
"--\n\n"
"What learn_tensors found: (the TensorImpl pointer's offset in a tensor object, the key set's\n"
"and the autograd metadata's in a TensorImpl), or None before it has.");

static PyObject *tensor_offsets(PyObject *self, PyObject *unused) {
    if (!T.learned) Py_RETURN_NONE;
    return Py_BuildValue("(nnn)", T.impl_at, T.keys_at, T.autograd_at);
}

PyMethodDef shmloader_tensors_methods[] = {
    {"stack_into", (PyCFunction)(void (*)(void))stack_into, METH_FASTCALL, stack_into_doc},
    {"learn_tensors", (PyCFunction)(void (*)(void))learn_tensors, METH_FASTCALL, learn_tensors_doc},
    {"tensor_offsets", tensor_offsets, METH_NOARGS, tensor_offsets_doc},
    {NULL, NULL, 0, NULL},
};
