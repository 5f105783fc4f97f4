/*
 * shmloader._native, part 2: synchronisation that lives inside the shared segment.
 *
 * Process-shared POSIX semaphores (sem_init with pshared=1) placed in the segment's
 * control area, so nothing has a name: a worker started later (a replacement under
 * spawn or forkserver) gets them with the segment's fd. And release/acquire loads and
 * stores of 64-bit header fields, so a consumer that sees a slot's state also sees every
 * byte written before it, on ARM as on x86.
 *
 * Every function takes a writable buffer (the segment's mmap) and a byte offset into
 * it, checked to lie inside the buffer and to be aligned. Blocking waits release the GIL;
 * a signal that interrupts one runs the Python handlers, so Ctrl-C and pytest-timeout
 * reach the caller.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <sched.h>
#include <semaphore.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "_layout.h"

#define SEM_STRIDE 64 /* bytes reserved per semaphore in the control area */
_Static_assert(sizeof(sem_t) <= SEM_STRIDE, "sem_t must fit its reserved bytes");

/* The address at `offset` in a writable buffer, for an object of `size` bytes aligned to
   `align`; NULL with ValueError otherwise. The caller releases `view`. */
static char *at(PyObject *buffer, Py_buffer *view, Py_ssize_t offset, Py_ssize_t size, Py_ssize_t align) {
    if (PyObject_GetBuffer(buffer, view, PyBUF_WRITABLE) < 0) return NULL;
    if (offset < 0 || offset > view->len - size || offset % align != 0) {
        PyErr_Format(PyExc_ValueError, "offset %zd: %zd bytes aligned to %zd do not fit a %zd-byte buffer",
                     offset, size, align, view->len);
        PyBuffer_Release(view);
        return NULL;
    }
    return (char *)view->buf + offset;
}

/* METH_FASTCALL argument checks for the sub-microsecond calls (no tuple is built). */
static int nargs_is(const char *name, Py_ssize_t nargs, Py_ssize_t want) {
    if (nargs == want) return 1;
    PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd arguments (%zd given)", name, want, nargs);
    return 0;
}

static int as_ssize(PyObject *o, Py_ssize_t *out) {
    *out = PyLong_AsSsize_t(o);
    return !(*out == -1 && PyErr_Occurred());
}

/* (buffer, offset): apply `op` to the semaphore there. */
static PyObject *sem_call(const char *name, PyObject *const *args, Py_ssize_t nargs, int (*op)(sem_t *)) {
    Py_ssize_t offset;
    Py_buffer view;
    if (!nargs_is(name, nargs, 2) || !as_ssize(args[1], &offset)) return NULL;
    char *p = at(args[0], &view, offset, SEM_STRIDE, 8);
    if (p == NULL) return NULL;
    int rc = op((sem_t *)p);
    PyBuffer_Release(&view);
    if (rc != 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static int init_shared(sem_t *sem) { return sem_init(sem, 1, 0); }

PyDoc_STRVAR(sem_init_doc,
"sem_init($module, buffer, offset, /)\n--\n\n"
"Initialise a process-shared semaphore of value 0 at buffer[offset:offset+64].");

static PyObject *py_sem_init(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return sem_call("sem_init", args, nargs, init_shared);
}

PyDoc_STRVAR(sem_post_doc,
"sem_post($module, buffer, offset, /)\n--\n\n"
"Post the semaphore at buffer[offset] (a full memory barrier).");

static PyObject *py_sem_post(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return sem_call("sem_post", args, nargs, sem_post);
}

PyDoc_STRVAR(sem_wait_doc,
"sem_wait($module, buffer, offset, timeout, /)\n--\n\n"
"Take one token of the semaphore at buffer[offset]: at once when timeout is 0, waiting at\n"
"most timeout seconds otherwise. Returns True when a token was taken, False on timeout.\n"
"A signal during the wait runs Python's handlers (their exception propagates).");

/* Take one token of `sem`: at once when `timeout` <= 0, else waiting at most `timeout` s with
   the GIL released. 1: taken; 0: none in time; -1: an exception is set (a signal handler
   raised, or the wait failed). */
static int wait_token(sem_t *sem, double timeout) {
    int rc, err = 0;
    if (timeout <= 0) {
        rc = sem_trywait(sem);
        err = rc ? errno : 0;
    } else {
        struct timespec deadline;
        clock_gettime(CLOCK_REALTIME, &deadline);
        double whole = (double)(time_t)timeout;
        deadline.tv_sec += (time_t)timeout;
        deadline.tv_nsec += (long)((timeout - whole) * 1e9);
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec += 1;
            deadline.tv_nsec -= 1000000000L;
        }
        for (;;) {
            Py_BEGIN_ALLOW_THREADS
            rc = sem_timedwait(sem, &deadline);
            err = rc ? errno : 0;
            Py_END_ALLOW_THREADS
            if (rc == 0 || err != EINTR) break;
            if (PyErr_CheckSignals() < 0) return -1;
        }
    }
    if (rc == 0) return 1;
    if (err == EAGAIN || err == ETIMEDOUT || err == EINTR) return 0;
    errno = err;
    PyErr_SetFromErrno(PyExc_OSError);
    return -1;
}

static PyObject *py_sem_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t offset;
    Py_buffer view;
    if (!nargs_is("sem_wait", nargs, 3) || !as_ssize(args[1], &offset)) return NULL;
    double timeout = PyFloat_AsDouble(args[2]);
    if (timeout == -1.0 && PyErr_Occurred()) return NULL;
    char *p = at(args[0], &view, offset, SEM_STRIDE, 8);
    if (p == NULL) return NULL;
    int taken = wait_token((sem_t *)p, timeout);
    PyBuffer_Release(&view);
    if (taken < 0) return NULL;
    return PyBool_FromLong(taken);
}

PyDoc_STRVAR(yield_wait_doc,
"yield_wait($module, buffer, offset, bound, /)\n--\n\n"
"Give the CPU away (sched_yield) and try for a token of the semaphore at buffer[offset], up to\n"
"bound times, with the GIL released. Returns how many yields it took to get one (1..bound),\n"
"or 0 when none came (the caller then sleeps on the semaphore).");

static PyObject *py_yield_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t offset, bound, took = 0;
    Py_buffer view;
    if (!nargs_is("yield_wait", nargs, 3) || !as_ssize(args[1], &offset) || !as_ssize(args[2], &bound)) return NULL;
    char *p = at(args[0], &view, offset, SEM_STRIDE, 8);
    if (p == NULL) return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 1; i <= bound; i++) {
        sched_yield();
        /* (a failure other than EAGAIN, which the GIL-less loop cannot raise, shows in the
           sem_wait the caller goes on to) */
        if (sem_trywait((sem_t *)p) == 0) {
            took = i;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(took);
}

PyDoc_STRVAR(yield_wait_timed_doc,
"yield_wait_timed($module, buffer, offset, bound, slow_ns, /)\n--\n\n"
"yield_wait, each yield timed: it stops at the first yield that took more than slow_ns (another\n"
"process ran its time slice: a CPU-bound neighbour shares this CPU). Returns (took, slow): how\n"
"many yields it took to get a token (0: none came), and whether it stopped at a slow yield (a\n"
"token found right after one is taken all the same).");

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static PyObject *py_yield_wait_timed(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t offset, bound, slow_ns, took = 0;
    int slow = 0;
    Py_buffer view;
    if (!nargs_is("yield_wait_timed", nargs, 4) || !as_ssize(args[1], &offset) || !as_ssize(args[2], &bound) ||
        !as_ssize(args[3], &slow_ns))
        return NULL;
    char *p = at(args[0], &view, offset, SEM_STRIDE, 8);
    if (p == NULL) return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 1; i <= bound; i++) {
        int64_t began = now_ns();
        sched_yield();
        slow = now_ns() - began > slow_ns;
        if (sem_trywait((sem_t *)p) == 0) {  /* (as in yield_wait: another failure shows in the sem_wait after) */
            took = i;
            break;
        }
        if (slow) break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("(nO)", took, slow ? Py_True : Py_False);
}

PyDoc_STRVAR(load_acquire_doc,
"load_acquire($module, buffer, offset, /)\n--\n\n"
"The int64 at buffer[offset] (8-byte aligned), read with acquire ordering: every write the\n"
"writer made before its store_release of this value is visible after it.");

static PyObject *py_load_acquire(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t offset;
    Py_buffer view;
    if (!nargs_is("load_acquire", nargs, 2) || !as_ssize(args[1], &offset)) return NULL;
    char *p = at(args[0], &view, offset, 8, 8);
    if (p == NULL) return NULL;
    int64_t v = __atomic_load_n((int64_t *)p, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&view);
    return PyLong_FromLongLong(v);
}

PyDoc_STRVAR(store_release_doc,
"store_release($module, buffer, offset, value, /)\n--\n\n"
"Store the int64 value at buffer[offset] (8-byte aligned) with release ordering: every\n"
"write before it is visible to a reader whose load_acquire sees the value.");

/* (buffer, offset, value) of a store: the int64 address and the value, or NULL. */
static char *store_args(const char *name, PyObject *const *args, Py_ssize_t nargs, Py_buffer *view,
                        long long *value) {
    Py_ssize_t offset;
    if (!nargs_is(name, nargs, 3) || !as_ssize(args[1], &offset)) return NULL;
    *value = PyLong_AsLongLong(args[2]);
    if (*value == -1 && PyErr_Occurred()) return NULL;
    return at(args[0], view, offset, 8, 8);
}

static PyObject *py_store_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long value;
    Py_buffer view;
    char *p = store_args("store_release", args, nargs, &view, &value);
    if (p == NULL) return NULL;
    __atomic_store_n((int64_t *)p, (int64_t)value, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* Whether buffer bytes [off, off + size) exist and off is 8-byte aligned. */
static int fits(const Py_buffer *view, Py_ssize_t off, Py_ssize_t size) {
    return off >= 0 && off <= view->len - size && off % 8 == 0;
}

/* Store the ints of `seq` (from PySequence_Fast) as int64 at `h`; -1 with an exception set
   when one is not an int. */
static int store_ints(PyObject *seq, char *h) {
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v == -1 && PyErr_Occurred()) return -1;
        ((int64_t *)h)[i] = (int64_t)v;
    }
    return 0;
}

PyDoc_STRVAR(post_task_doc,
"post_task($module, buffer, header, epoch, seq, index, pickled, data, cap, entry, slot, sem, own, /)\n--\n\n"
"Hand a task to a worker in one call. The index goes to buffer[data:data+cap]: with `pickled`\n"
"false, `index` must be a list of exact ints that fit int64 (a batch sampler's) or a range\n"
"whose values fit int64 (standing for the list of them), stored as int64 values\n"
"(TASK_LEN -2 - n); with `pickled` true, `index` is the pickled index's bytes\n"
"(TASK_LEN their length). Then the header at buffer[header:] gets IDLE, epoch, seq, TASK_LEN, OWN\n"
"(`own`: the batch goes into memory of its own, not the slot),\n"
"buffer[entry] (the worker's queue entry) gets `slot`, and the semaphore at buffer[sem] is\n"
"posted (a full barrier: the worker sees every write once it takes the token).\n"
"Returns 1 when posted; 0 when the index does not fit `cap` bytes (nothing written); -1 when\n"
"`index` is not such a list or range (nothing written: pickle it and call again).");

/* The `n` values of range `r` as int64 at dst (only checked when not `fit`): 1 when they all
   fit int64, 0 when one does not, -1 on error. A range's values run monotonically from its
   first to its last, so those two decide; the step between them is exact in 128 bits. */
static int range_end(PyObject *r, Py_ssize_t i, long long *out) {
    PyObject *v = PySequence_GetItem(r, i);
    if (v == NULL) return -1;
    int overflow = 0;
    *out = PyLong_AsLongLongAndOverflow(v, &overflow);
    Py_DECREF(v);
    if (*out == -1 && PyErr_Occurred()) return -1;
    return !overflow;
}

static int store_range(PyObject *r, char *dst, Py_ssize_t n, int fit) {
    if (n == 0) return 1;  /* the empty list, whatever the bounds */
    long long first, second = 0, last;
    int ok = range_end(r, 0, &first);
    if (ok == 1) ok = range_end(r, n - 1, &last);
    if (ok == 1 && n > 1) ok = range_end(r, 1, &second);
    if (ok != 1 || !fit) return ok;
    __int128 step = (__int128)second - (__int128)first;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t v64 = (int64_t)((__int128)first + (__int128)i * step);
        memcpy(dst + 8 * i, &v64, 8);
    }
    return 1;
}

/* post_task over a writable buffer the caller holds (native/_schedule.c's step posts through
   it): 1 posted, 0 the index does not fit, -1 not a list or range of int64 ints (nothing written
   in either case), -2 an error (an exception is set). */
int shmloader_write_task(Py_buffer *view, Py_ssize_t header, int64_t epoch, int64_t seq, PyObject *index,
                         int pickled, Py_ssize_t data, Py_ssize_t cap, Py_ssize_t entry, int64_t slot,
                         Py_ssize_t sem_off, int own) {
    int is_range = !pickled && PyRange_Check(index);
    if (pickled ? !PyBytes_Check(index) : !(PyList_CheckExact(index) || is_range)) {
        if (pickled) {
            PyErr_SetString(PyExc_TypeError, "post_task: a pickled index must be bytes");
            return -2;
        }
        return -1;
    }
    if (!fits(view, header, N_HEADER_FIELDS * 8) || !fits(view, sem_off, SEM_STRIDE) || !fits(view, entry, 8) ||
        cap < 0 || data < 0 || data > view->len - cap) {
        PyErr_SetString(PyExc_ValueError, "post_task: an offset lies outside the buffer or is misaligned");
        return -2;
    }
    char *dst = (char *)view->buf + data;
    int64_t task_len;
    if (pickled) {
        Py_ssize_t n = PyBytes_GET_SIZE(index);
        if (n > cap) return 0;
        memcpy(dst, PyBytes_AS_STRING(index), (size_t)n);
        task_len = n;
    } else if (is_range) {
        Py_ssize_t n = PyObject_Size(index);
        if (n < 0) {  /* a range too long for a size: never a batch's */
            PyErr_Clear();
            return -1;
        }
        int fit = n <= cap / 8;
        int stored = store_range(index, dst, n, fit);
        if (stored <= 0) return stored == 0 ? -1 : -2;
        if (!fit) return 0;
        task_len = -2 - (int64_t)n;
    } else {
        /* -1 for any list that is not all int64 ints, whatever its size, so the caller's pickle
           can still fit; 0 for one that is but does not fit. Values are stored as they are
           checked: what a refused list left in the data region is never posted. (No item runs
           Python code, so the list cannot change under the loop.) */
        Py_ssize_t n = PyList_GET_SIZE(index);
        int fit = n <= cap / 8;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PyList_GET_ITEM(index, i);
            int overflow = 0;
            long long v = 0;
            if (!PyLong_CheckExact(item) || (v = PyLong_AsLongLongAndOverflow(item, &overflow), overflow)) return -1;
            if (fit) {
                int64_t v64 = (int64_t)v;
                memcpy(dst + 8 * i, &v64, 8);
            }
        }
        if (!fit) return 0;
        task_len = -2 - (int64_t)n;
    }
    int64_t *fields = (int64_t *)((char *)view->buf + header);
    fields[F_STATE] = STATE_IDLE;
    fields[F_EPOCH] = epoch;
    fields[F_SEQ] = seq;
    fields[F_TASK_LEN] = task_len;
    fields[F_OWN] = own;
    *(int64_t *)((char *)view->buf + entry) = slot;
    if (sem_post((sem_t *)((char *)view->buf + sem_off)) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -2;
    }
    return 1;
}

static PyObject *py_post_task(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t header, data, cap, entry, sem_off;
    long long epoch, seq, slot;
    Py_buffer view;
    if (!nargs_is("post_task", nargs, 12) || !as_ssize(args[1], &header) || !as_ssize(args[6], &data) ||
        !as_ssize(args[7], &cap) || !as_ssize(args[8], &entry) || !as_ssize(args[10], &sem_off))
        return NULL;
    if (((epoch = PyLong_AsLongLong(args[2])) == -1 && PyErr_Occurred()) ||
        ((seq = PyLong_AsLongLong(args[3])) == -1 && PyErr_Occurred()) ||
        ((slot = PyLong_AsLongLong(args[9])) == -1 && PyErr_Occurred()))
        return NULL;
    int pickled = PyObject_IsTrue(args[5]), own = PyObject_IsTrue(args[11]);
    if (pickled < 0 || own < 0 || PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0) return NULL;
    int code = shmloader_write_task(&view, header, (int64_t)epoch, (int64_t)seq, args[4], pickled, data, cap, entry,
                                    (int64_t)slot, sem_off, own);
    PyBuffer_Release(&view);
    return code == -2 ? NULL : PyLong_FromLong(code);
}

PyDoc_STRVAR(publish_doc,
"publish($module, buffer, header, first, fields, state, done, sem, flag, awaited, wake, /)\n--\n\n"
"Publish a slot's result in one call: store the int64 values of `fields` at the header's\n"
"fields first, first+1, ...; store `done` at buffer[state] with release ordering; post the\n"
"semaphore at buffer[sem]; then, after a full fence, read the int64 at buffer[awaited] and post\n"
"the semaphore at buffer[wake] when a consumer sleeps (it is not AWAIT_NONE) and the word names\n"
"this result (its R_SEQ + 1), or any (AWAIT_ANY), or the result asks the consumer for something\n"
"(NEED_MEMORY, or its batch comes over the pipe): a sleeping consumer is woken by what it must\n"
"act on, not by every batch. Returns the int64 at buffer[flag] (nonzero: an asynchronous\n"
"consumer waits and wants its doorbell rung).");

static PyObject *py_publish(PyObject *self, PyObject *args) {
    PyObject *buffer, *fields;
    Py_ssize_t header, first, state, sem_off, flag, awaited_off, wake_off;
    long long done;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "OnnOnLnnnn", &buffer, &header, &first, &fields, &state, &done, &sem_off, &flag,
                          &awaited_off, &wake_off))
        return NULL;
    if (header < 0 || first < 0 || first > (PY_SSIZE_T_MAX - 8) / 8 || header > PY_SSIZE_T_MAX - first * 8) {
        PyErr_Format(PyExc_ValueError, "publish: field %zd of the header at %zd is not a field of it", first, header);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(fields, "fields must be a sequence of ints");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *result = NULL;
    char *h = at(buffer, &view, header + first * 8, n * 8, 8);
    if (h == NULL) goto done;
    if (!fits(&view, header, N_HEADER_FIELDS * 8) || !fits(&view, state, 8) || !fits(&view, sem_off, SEM_STRIDE) ||
        !fits(&view, flag, 8) || !fits(&view, awaited_off, 8) || !fits(&view, wake_off, SEM_STRIDE)) {
        PyErr_SetString(PyExc_ValueError, "publish: an offset lies outside the buffer or is misaligned");
        goto release;
    }
    if (store_ints(seq, h) < 0) goto release;
    __atomic_store_n((int64_t *)((char *)view.buf + state), (int64_t)done, __ATOMIC_RELEASE);
    if (sem_post((sem_t *)((char *)view.buf + sem_off)) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto release;
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    int64_t awaited = __atomic_load_n((int64_t *)((char *)view.buf + awaited_off), __ATOMIC_RELAXED);
    const int64_t *fields_of = (const int64_t *)((char *)view.buf + header); /* (this worker's own, just stored) */
    int wake = awaited == AWAIT_ANY ||
               (awaited != AWAIT_NONE && (awaited == fields_of[F_R_SEQ] + 1 || fields_of[F_STATUS] == STATUS_NEED_MEMORY ||
                                          fields_of[F_REGION] == REGION_PIPE));
    if (wake && sem_post((sem_t *)((char *)view.buf + wake_off)) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto release;
    }
    result = PyLong_FromLongLong(__atomic_load_n((int64_t *)((char *)view.buf + flag), __ATOMIC_RELAXED));
release:
    PyBuffer_Release(&view);
done:
    Py_DECREF(seq);
    return result;
}

PyDoc_STRVAR(store_fenced_doc,
"store_fenced($module, buffer, offset, value, /)\n--\n\n"
"Store the int64 value at buffer[offset], then a full fence: a later read (of a semaphore, of a\n"
"slot's STATE) cannot pass it, so a publisher that posts (or stores DONE) and then reads this\n"
"word sees it, or is seen.");

static PyObject *py_store_fenced(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long value;
    Py_buffer view;
    char *p = store_args("store_fenced", args, nargs, &view, &value);
    if (p == NULL) return NULL;
    __atomic_store_n((int64_t *)p, (int64_t)value, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(take_task_doc,
"take_task($module, buffer, sem, entry, headers, data, cap, timeout, /)\n--\n\n"
"A worker's next task in one call: take a token of the semaphore at buffer[sem] (as sem_wait),\n"
"then read the queue entry at buffer[entry]. Returns None on timeout; the entry itself when it\n"
"is negative (stop, attach to a grown ring); otherwise (slot, epoch, seq, index, own), read from\n"
"the slot's header at buffer[headers[slot]] and its data region at buffer[data[slot]] of `cap`\n"
"bytes: index is the list of ints of a TASK_LEN of -2 - n, the pickled bytes of a TASK_LEN >= 0,\n"
"None for -1 (the index comes over the worker's connection). Lengths are clamped to `cap`.\n"
"A negative `timeout` says the caller already holds the token (yield_wait took it): the entry\n"
"is read at once.");

static PyObject *py_take_task(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t sem_off, entry, cap;
    Py_buffer view;
    if (!nargs_is("take_task", nargs, 7) || !as_ssize(args[1], &sem_off) || !as_ssize(args[2], &entry) ||
        !as_ssize(args[5], &cap))
        return NULL;
    PyObject *headers = args[3], *datas = args[4];
    if (!PyTuple_Check(headers) || !PyTuple_Check(datas) || PyTuple_GET_SIZE(headers) != PyTuple_GET_SIZE(datas)) {
        PyErr_SetString(PyExc_TypeError, "take_task() takes two tuples of offsets of one length");
        return NULL;
    }
    double timeout = PyFloat_AsDouble(args[6]);
    if (timeout == -1.0 && PyErr_Occurred()) return NULL;
    char *sem = at(args[0], &view, sem_off, SEM_STRIDE, 8);
    if (sem == NULL) return NULL;
    PyObject *result = NULL;
    if (!fits(&view, entry, 8) || cap < 0) {
        PyErr_SetString(PyExc_ValueError, "take_task: an offset lies outside the buffer or is misaligned");
        goto release;
    }
    int taken = timeout < 0 ? 1 : wait_token((sem_t *)sem, timeout);
    if (taken <= 0) {
        if (taken == 0) result = Py_NewRef(Py_None);
        goto release;
    }
    int64_t slot = *(int64_t *)((char *)view.buf + entry);
    if (slot < 0) {
        result = PyLong_FromLongLong(slot);
        goto release;
    }
    if (slot >= PyTuple_GET_SIZE(headers)) {
        PyErr_Format(PyExc_ValueError, "take_task: queue entry %lld is not a slot of %zd", (long long)slot,
                     PyTuple_GET_SIZE(headers));
        goto release;
    }
    Py_ssize_t header = PyLong_AsSsize_t(PyTuple_GET_ITEM(headers, slot));
    Py_ssize_t data = PyLong_AsSsize_t(PyTuple_GET_ITEM(datas, slot));
    if ((header == -1 || data == -1) && PyErr_Occurred()) goto release;
    if (!fits(&view, header, N_HEADER_FIELDS * 8) || data < 0 || data > view.len - cap) {
        PyErr_SetString(PyExc_ValueError, "take_task: a slot's offsets lie outside the buffer or are misaligned");
        goto release;
    }
    const int64_t *h = (const int64_t *)((char *)view.buf + header);
    int64_t epoch = h[F_EPOCH], seq = h[F_SEQ], task_len = h[F_TASK_LEN], own = h[F_OWN] != 0;
    const char *payload = (const char *)view.buf + data;
    PyObject *index;
    if (task_len >= 0) {
        index = PyBytes_FromStringAndSize(payload, (Py_ssize_t)(task_len < cap ? task_len : cap));
    } else if (task_len == -1) {
        index = Py_NewRef(Py_None);
    } else {
        /* -2 - n: n int64 values (the count clamped to what the data region holds) */
        uint64_t n = (uint64_t)(-(task_len + 2));
        if (n > (uint64_t)(cap / 8)) n = (uint64_t)(cap / 8);
        index = PyList_New((Py_ssize_t)n);
        for (Py_ssize_t i = 0; index != NULL && i < (Py_ssize_t)n; i++) {
            int64_t v;
            memcpy(&v, payload + 8 * i, 8);
            PyObject *item = PyLong_FromLongLong(v);
            if (item == NULL) Py_CLEAR(index);
            else PyList_SET_ITEM(index, i, item);
        }
    }
    if (index != NULL)
        result = Py_BuildValue("(LLLNO)", (long long)slot, (long long)epoch, (long long)seq, index, own ? Py_True : Py_False);
release:
    PyBuffer_Release(&view);
    return result;
}

PyMethodDef shmloader_sync_methods[] = {
    {"take_task", (PyCFunction)(void (*)(void))py_take_task, METH_FASTCALL, take_task_doc},
    {"post_task", (PyCFunction)(void (*)(void))py_post_task, METH_FASTCALL, post_task_doc},
    {"publish", py_publish, METH_VARARGS, publish_doc},
    {"store_fenced", (PyCFunction)(void (*)(void))py_store_fenced, METH_FASTCALL, store_fenced_doc},
    {"sem_init", (PyCFunction)(void (*)(void))py_sem_init, METH_FASTCALL, sem_init_doc},
    {"sem_post", (PyCFunction)(void (*)(void))py_sem_post, METH_FASTCALL, sem_post_doc},
    {"sem_wait", (PyCFunction)(void (*)(void))py_sem_wait, METH_FASTCALL, sem_wait_doc},
    {"yield_wait", (PyCFunction)(void (*)(void))py_yield_wait, METH_FASTCALL, yield_wait_doc},
    {"yield_wait_timed", (PyCFunction)(void (*)(void))py_yield_wait_timed, METH_FASTCALL, yield_wait_timed_doc},
    {"load_acquire", (PyCFunction)(void (*)(void))py_load_acquire, METH_FASTCALL, load_acquire_doc},
    {"store_release", (PyCFunction)(void (*)(void))py_store_release, METH_FASTCALL, store_release_doc},
    {NULL, NULL, 0, NULL},
};
const int shmloader_sem_stride = SEM_STRIDE;
