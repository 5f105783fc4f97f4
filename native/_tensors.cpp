/* shmloader._tensors: what needs torch's C++ API (a worker's stack into its slot; the tensor
   the main process lends over a slot).

   Built only where torch is importable at build time (`make` installs it first and builds
   without isolation); it records the torch version it was built against, and shmloader uses
   it only under that version (shmloader/_accel.py). Without it, torch.stack does the same
   work at about twenty times the cost for a batch of small samples: torch's per-tensor
   overhead in stack, not the bytes, is what a small batch's worker spends its time on.
*/
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>

#include <atomic>
#include <cerrno>
#include <functional>
#include <memory>
#include <stdexcept>
#include <vector>
#include <cstring>
#include <sys/mman.h>
#include <unistd.h>

#define STR_(x) #x
#define STR(x) STR_(x)

namespace {

/* A sample memcpy copies exactly as torch.stack's copy would: a plain CPU tensor of the
   batch's dtype and sample shape, contiguous, with nothing that a copy resolves (conjugate
   or negative bit, zero tensor) and nothing that stack(out=) refuses (requires_grad). */
bool plain_sample(const at::Tensor &t, const at::Tensor &out) {
    if (t.layout() != c10::kStrided || !t.device().is_cpu() || t.is_nested() || !t.has_storage()) return false;
    if (t.scalar_type() != out.scalar_type() || t.requires_grad() || t.is_conj() || t.is_neg() || t._is_zerotensor())
        return false;
    if (t.dim() + 1 != out.dim() || !t.is_contiguous()) return false;
    for (int64_t d = 0; d < t.dim(); d++)
        if (t.size(d) != out.size(d + 1)) return false;
    return true;
}

bool overlaps(const char *a, size_t na, const char *b, size_t nb) { return a < b + nb && b < a + na; }

PyObject *stack_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !THPVariable_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "stack_into takes a list of samples and the tensor to stack them into");
        return NULL;
    }
    PyObject *samples = args[0];
    if (!PyList_CheckExact(samples) && !PyTuple_CheckExact(samples)) Py_RETURN_FALSE;
    /* A torch function or dispatch mode would see torch.stack: let it. */
    if (at::impl::torch_function_mode_enabled() || c10::impl::TorchDispatchModeTLS::any_modes_set()) Py_RETURN_FALSE;
    try {
        const at::Tensor &out = THPVariable_Unpack(args[1]);
        Py_ssize_t n = PySequence_Fast_GET_SIZE(samples);
        if (!THPVariable_CheckExact(args[1]) || n == 0 || out.dim() < 1 || out.size(0) != n ||
            out.layout() != c10::kStrided || !out.device().is_cpu() || !out.is_contiguous() || out.requires_grad() ||
            !out.has_storage() || out.is_conj() || out.is_neg() || out._is_zerotensor())
            Py_RETURN_FALSE;
        char *dst = static_cast<char *>(out.data_ptr());
        size_t total = out.nbytes(), each = total / static_cast<size_t>(n);
        /* Every sample checked before any byte is written: on False the slot is as it was. Each
           is kept (a tensor reference: its storage lives) so the copy runs without the GIL, and
           a thread of the dataset's own is not stalled by it, whatever it does to the list. */
        std::vector<c10::Storage> kept; /* (a sample's storage: another thread's resize_ or set_ cannot free it) */
        std::vector<const char *> from;
        kept.reserve(static_cast<size_t>(n));
        from.reserve(static_cast<size_t>(n));
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(samples, i);
            if (!THPVariable_CheckExact(item)) Py_RETURN_FALSE; /* subclasses: their __torch_function__ */
            const at::Tensor &t = THPVariable_Unpack(item);
            if (!plain_sample(t, out) || t.nbytes() != each) Py_RETURN_FALSE;
            if (each && overlaps(static_cast<const char *>(t.const_data_ptr()), each, dst, total))
                Py_RETURN_FALSE; /* torch.stack raises for a sample inside its output */
            kept.push_back(t.storage());
            from.push_back(static_cast<const char *>(t.const_data_ptr()));
        }
        if (each) { /* pointers and storages taken with the GIL: nothing below calls into torch or Python */
            Py_BEGIN_ALLOW_THREADS
            for (size_t i = 0; i < from.size(); i++) std::memcpy(dst + i * each, from[i], each);
            Py_END_ALLOW_THREADS
        }
        out.unsafeGetTensorImpl()->bump_version(); /* an in-place write, as stack(out=) counts it */
    } catch (const std::exception &e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return NULL;
    }
    Py_RETURN_TRUE;
}

/* The torch dtype of a buffer's format, as numpy exports its native dtypes. */
bool scalar_type_of(const Py_buffer &b, c10::ScalarType *out) {
    const char *f = b.format;
    if (f == NULL || f[0] == '\0') return false;
    if (f[0] == '@' || f[0] == '=' || f[0] == '<') f++;
    bool complex = f[0] == 'Z';
    if (complex) f++;
    if (f[0] == '\0' || f[1] != '\0') return false;
    switch (f[0]) {
        case '?': *out = c10::kBool; return b.itemsize == 1 && !complex;
        case 'b': *out = c10::kChar; return b.itemsize == 1 && !complex;
        case 'B': *out = c10::kByte; return b.itemsize == 1 && !complex;
        case 'h': *out = c10::kShort; return b.itemsize == 2 && !complex;
        case 'H': *out = c10::kUInt16; return b.itemsize == 2 && !complex;
        case 'i': case 'I': case 'l': case 'L': case 'q': case 'Q': {
            bool is_signed = f[0] == 'i' || f[0] == 'l' || f[0] == 'q';
            if (b.itemsize == 4) *out = is_signed ? c10::kInt : c10::kUInt32;
            else if (b.itemsize == 8) *out = is_signed ? c10::kLong : c10::kUInt64;
            else return false;
            return !complex;
        }
        case 'e': *out = c10::kHalf; return b.itemsize == 2 && !complex;
        case 'f': *out = complex ? c10::kComplexFloat : c10::kFloat; return b.itemsize == (complex ? 8 : 4);
        case 'd': *out = complex ? c10::kComplexDouble : c10::kDouble; return b.itemsize == (complex ? 16 : 8);
    }
    return false;
}

/* Tests make the next from_blob calls fail (_fail_from_blob): its error paths must give back
   what they hold (an exported buffer, a mapping). */
int failing_blobs = 0;

at::Tensor blob(void *data, at::IntArrayRef sizes, const std::function<void(void *)> &deleter,
                const at::TensorOptions &options) {
    if (failing_blobs > 0) {
        failing_blobs--;
        throw std::runtime_error("from_blob failed (injected by _fail_from_blob)");
    }
    return at::from_blob(data, sizes, deleter, options);
}

/* A buffer exported for a tensor's life, released exactly once: by the tensor's deleter, or
   by the caller when the tensor was never made (whether or not from_blob ran the deleter). */
struct Export {
    Py_buffer view;
    std::atomic<bool> released{false};
    void release() {
        if (released.exchange(true)) return;
        if (!Py_IsInitialized()) return; /* (the interpreter is finishing: left to the process's end) */
        PyGILState_STATE gil = PyGILState_Ensure();
        PyBuffer_Release(&view);
        PyGILState_Release(gil);
    }
};

PyObject *from_array(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "from_array takes one C-contiguous writable array");
        return NULL;
    }
    /* The buffer stays exported until the tensor's memory goes (its deleter releases it): the
       exporter can then neither resize nor unmap what the tensor views. */
    auto exported = std::make_shared<Export>();
    Py_buffer *view = &exported->view;
    if (PyObject_GetBuffer(args[0], view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        exported->released = true;
        return NULL;
    }
    c10::ScalarType type;
    if (!scalar_type_of(*view, &type)) {
        exported->release();
        PyErr_SetString(PyExc_TypeError, "from_array: a dtype torch has no tensor of");
        return NULL;
    }
    at::Tensor t;
    try {
        t = blob(view->buf, std::vector<int64_t>(view->shape, view->shape + view->ndim),
                 [exported](void *) { exported->release(); }, at::TensorOptions().dtype(type));
    } catch (const std::exception &e) { /* (from_blob throws only for sizes a valid buffer cannot have) */
        exported->release(); /* (a no-op if from_blob's own cleanup ran the deleter) */
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return NULL;
    }
    return THPVariable_Wrap(std::move(t));
}

/* A copy of a contiguous CPU tensor in a memory file of its own (memfd), written with pwrite
   and mapped without populating: the pages are where torch's held batches are (shared memory
   that no other process maps), so a process's PSS counts them once they are read, as it counts
   torch's; the machine counts them at once either way. One system call copies every page. */
static int copy_to_memfd(const void *from, size_t nbytes, size_t mapped, void **out) {
#ifdef MFD_NOEXEC_SEAL /* (Linux 6.3: without it the kernel warns, and refuses under vm.memfd_noexec=2) */
    int fd = memfd_create("shmloader-copy", MFD_CLOEXEC | MFD_NOEXEC_SEAL);
    if (fd < 0 && errno == EINVAL) fd = memfd_create("shmloader-copy", MFD_CLOEXEC); /* (an older kernel) */
#else
    int fd = memfd_create("shmloader-copy", MFD_CLOEXEC);
#endif
    if (fd < 0) return -1;
    int ok = 1; /* (pwrite sizes the file: the mapping's last page is its last, partly past the end) */
    for (size_t done = 0; ok && done < nbytes;) {
        ssize_t n = pwrite(fd, static_cast<const char *>(from) + done, nbytes - done, static_cast<off_t>(done));
        if (n > 0) done += static_cast<size_t>(n);
        else if (n < 0 && errno == EINTR) continue;
        else ok = 0;
    }
    void *p = ok ? mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    close(fd);
    if (p == MAP_FAILED) return -1;
    *out = p;
    return 0;
}

PyObject *copy_out(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1 || !THPVariable_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "copy_out takes one tensor");
        return NULL;
    }
    try {
        if (!THPVariable_CheckExact(args[0])) Py_RETURN_NONE; /* (a subclass: clone keeps it one) */
        const at::Tensor &src = THPVariable_Unpack(args[0]);
        if (!src.device().is_cpu() || src.layout() != c10::kStrided || !src.is_contiguous() || src.is_conj() ||
            src.is_neg() || src._is_zerotensor() || src.is_quantized() || src.requires_grad() ||
            !src.has_storage() || src.nbytes() == 0)
            Py_RETURN_NONE;
        static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
        size_t nbytes = src.nbytes(), mapped = (nbytes + page - 1) / page * page;
        const void *from = src.const_data_ptr();
        void *p = NULL;
        int failed;
        Py_BEGIN_ALLOW_THREADS
        failed = copy_to_memfd(from, nbytes, mapped, &p);
        Py_END_ALLOW_THREADS
        if (failed) Py_RETURN_NONE; /* (no memory, or no fd or mapping left: clone tries the allocator) */
        auto mapping = std::make_shared<std::atomic<void *>>(p); /* unmapped once, by whoever is last */
        auto unmap = [mapping, mapped](void *) {
            void *q = mapping->exchange(nullptr);
            if (q != nullptr) munmap(q, mapped);
        };
        try {
            at::Tensor t = blob(p, src.sizes(), unmap, at::TensorOptions().dtype(src.scalar_type()));
            return THPVariable_Wrap(std::move(t));
        } catch (...) {
            unmap(nullptr);
            throw;
        }
    } catch (const std::exception &e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return NULL;
    }
}

PyObject *fail_from_blob(PyObject *self, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    failing_blobs = static_cast<int>(n);
    Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"_fail_from_blob", fail_from_blob, METH_O,
     "_fail_from_blob($module, n, /)\n--\n\nMake the next n tensors made over memory fail (for tests)."},
    {"copy_out", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(copy_out)), METH_FASTCALL,
     "copy_out($module, tensor, /)\n--\n\n"
     "tensor.clone() for a plain contiguous CPU tensor (exact torch.Tensor, no grad,\n"
     "conjugate or negative bit), into a memory file of its own (memfd, one pwrite for every\n"
     "page), mapped unpopulated: shared memory nobody else maps, as torch's batches are; None\n"
     "for anything else, or when no memory could be had (clone it)."},
    {"from_array", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(from_array)), METH_FASTCALL,
     "from_array($module, array, /)\n--\n\n"
     "torch.from_numpy(array) for a C-contiguous writable array of a dtype torch has (what\n"
     "lend_lone makes over a slot), with less of torch's overhead: the tensor shares the\n"
     "array's memory and keeps the array alive."},
    {"stack_into", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(stack_into)), METH_FASTCALL,
     "stack_into($module, samples, out, /)\n--\n\n"
     "torch.stack(samples, 0, out=out) as one memcpy per sample, for a list or tuple of plain\n"
     "contiguous CPU tensors of out's dtype and sample shape (exact torch.Tensor, no grad,\n"
     "conjugate or negative bit, not inside out; no torch function or dispatch mode active).\n"
     "Returns True when it stacked them; False, having written nothing, for anything else\n"
     "(torch.stack then does it, or raises its own error)."},
    {NULL, NULL, 0, NULL},
};

struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shmloader._tensors", "What needs torch's C++ API (see native/_tensors.cpp).", -1, methods,
};

}  // namespace

PyMODINIT_FUNC PyInit__tensors(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "TORCH_VERSION", STR(SHMLOADER_TORCH_VERSION)) < 0) Py_CLEAR(m);
    return m;
}
