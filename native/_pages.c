/*
 * shmloader._native's copy_pages: a held batch's copy in a memory file of its own (memfd),
 * written with pwrite and mapped unpopulated: the pages are where torch's held batches are
 * (shared memory that no other process maps), so a process's PSS counts them once they are
 * read, as it counts torch's; the machine counts them at once either way. One system call
 * copies every page. The mapping is a Pages object, a writable buffer unmapped when the last
 * view of it (torch.frombuffer's tensor, say) is gone.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MFD_NOEXEC_SEAL
#define MFD_NOEXEC_SEAL 0x0008U /* Linux 6.3: without it the kernel warns, and refuses under vm.memfd_noexec=2 */
#endif

typedef struct {
    PyObject_HEAD
    void *addr;
    size_t mapped;
    Py_ssize_t nbytes;
} Pages;

static int pages_getbuffer(PyObject *self, Py_buffer *view, int flags) {
    Pages *p = (Pages *)self;
    return PyBuffer_FillInfo(view, self, p->addr, p->nbytes, 0, flags); /* (keeps self while exported) */
}

static void pages_dealloc(PyObject *self) {
    Pages *p = (Pages *)self;
    if (p->addr != NULL) munmap(p->addr, p->mapped);
    Py_TYPE(self)->tp_free(self);
}

static PyBufferProcs pages_as_buffer = {.bf_getbuffer = pages_getbuffer};

static PyTypeObject PagesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmloader._native.Pages",
    .tp_basicsize = sizeof(Pages),
    .tp_dealloc = pages_dealloc,
    .tp_as_buffer = &pages_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A memory file's pages, mapped: a writable buffer, unmapped with its last view.",
};

static int no_seal; /* set once a kernel refused MFD_NOEXEC_SEAL (atomic: threads copy without the GIL) */

/* The copy's mapping, or NULL with errno set. */
static void *copy_to_memfd(const char *from, size_t nbytes, size_t mapped) {
    int fd = -1;
    if (!__atomic_load_n(&no_seal, __ATOMIC_RELAXED)) {
        fd = memfd_create("shmloader-copy", MFD_CLOEXEC | MFD_NOEXEC_SEAL);
        if (fd < 0 && errno == EINVAL) __atomic_store_n(&no_seal, 1, __ATOMIC_RELAXED); /* (an older kernel) */
    }
    if (fd < 0 && __atomic_load_n(&no_seal, __ATOMIC_RELAXED)) fd = memfd_create("shmloader-copy", MFD_CLOEXEC);
    if (fd < 0) return NULL;
    int ok = 1; /* (pwrite sizes the file: the mapping's last page is its last, partly past the end) */
    for (size_t done = 0; ok && done < nbytes;) {
        ssize_t n = pwrite(fd, from + done, nbytes - done, (off_t)done);
        if (n > 0) done += (size_t)n;
        else if (n < 0 && errno == EINTR) continue;
        else ok = 0;
    }
    void *p = ok ? mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    int saved = errno;
    close(fd);
    errno = saved;
    return p == MAP_FAILED ? NULL : p;
}

PyDoc_STRVAR(copy_pages_doc,
"copy_pages($module, address, nbytes, /)\n"
"--\n\n"
"The `nbytes` bytes at `address` (a live tensor's data_ptr()) copied into a memory file of\n"
"their own, mapped unpopulated: a Pages buffer (torch.frombuffer makes it a tensor); None when\n"
"no memory file or mapping could be had (clone instead).");

static PyObject *copy_pages(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "copy_pages takes an address and a size");
        return NULL;
    }
    void *from = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (from == NULL || nbytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "copy_pages takes a non-null address and a positive size");
        return NULL;
    }
    static size_t page = 0;
    if (page == 0) page = (size_t)sysconf(_SC_PAGESIZE);
    size_t mapped = ((size_t)nbytes + page - 1) / page * page;
    Pages *pages = PyObject_New(Pages, &PagesType);
    if (pages == NULL) return NULL;
    void *p;
    Py_BEGIN_ALLOW_THREADS
    p = copy_to_memfd(from, (size_t)nbytes, mapped);
    Py_END_ALLOW_THREADS
    pages->addr = p;
    pages->mapped = mapped;
    pages->nbytes = nbytes;
    if (p == NULL) {
        Py_DECREF(pages);
        Py_RETURN_NONE; /* (no memory, or no fd or mapping left) */
    }
    return (PyObject *)pages;
}

PyMethodDef shmloader_pages_methods[] = {
    {"copy_pages", (PyCFunction)(void (*)(void))copy_pages, METH_FASTCALL, copy_pages_doc},
    {NULL, NULL, 0, NULL},
};

int shmloader_pages_init(PyObject *module) {
    if (PyType_Ready(&PagesType) < 0) return -1;
    Py_INCREF(&PagesType);
    if (PyModule_AddObject(module, "Pages", (PyObject *)&PagesType) < 0) {
        Py_DECREF(&PagesType);
        return -1;
    }
    return PyModule_AddFunctions(module, shmloader_pages_methods);
}
