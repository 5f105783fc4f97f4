/*
 * shmloader._native: the consumer's steady state in one call.
 *
 * steady_take does, for a sync next() in order, what RingIterator._steady's Python did
 * between its waits: take back the slots whose batches are gone, collect the published
 * slots (one per token of the ready semaphore) and take the next batch in order. It works
 * on the slot table's own containers (shmloader/_slots.py: state, free, tasks, ready, load)
 * and makes exactly the transitions SlotTable.give_back, done and take make. Anything out of
 * the ordinary (a request for overflow memory, a batch sent over the pipe, a stale epoch, a
 * torn header, a result that is not a batch) it leaves as it is and answers GENERAL: the
 * general path (RingIterator._round) then does the rest, from a consistent table.
 *
 * dispatch_next does the other half of an in-order next(): the next task, from the worker
 * round robin picks and the sampler's next index to the slot table's dispatch and the post
 * that wakes the worker (native/_sync.c's post_task).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <semaphore.h>
#include <stdint.h>

#define NOT_READY -1
#define GENERAL -2

/* Indices into the `consts` tuple (built once by shmloader._consume). */
enum { C_FREE, C_IN_FLIGHT, C_READY, C_LENT, C_DONE, C_OK, C_NEED_MEMORY, C_PIPE, C_STATE, C_STATUS, C_REGION,
       C_R_EPOCH, C_R_SEQ, C_FIELDS, N_CONSTS };

static long long const_int(PyObject *consts, int i) { return PyLong_AsLongLong(PyTuple_GET_ITEM(consts, i)); }

/* Field `f` of the header at `h`, read after its STATE was loaded DONE with acquire ordering
   (what the worker wrote before DONE is visible after it). */
static int64_t field(const char *h, long long f) { return ((const int64_t *)h)[f]; }

static PyObject *result(long long code, long long banked, long long gone) {
    return Py_BuildValue("(LLL)", code, banked, gone);
}

PyDoc_STRVAR(steady_take_doc,
"steady_take($module, buffer, ready_sem, headers, banked, tasks, state, ready, load, free, bases,\n"
"            epoch, seq, consts, /)\n--\n\n"
"One look of a sync, in-order next(), without waiting. (1) Slots whose base in `bases` (the lease\n"
"table: slot -> base array) nothing else references leave it and go LENT -> FREE. (2) Every\n"
"token of the semaphore at buffer[ready_sem] is taken and added to `banked`; published slots\n"
"(IN_FLIGHT, header STATE DONE), in the tasks' order, go IN_FLIGHT -> READY, one per token.\n"
"(3) The result `seq` of the current `epoch`, if READY and a batch (status OK), goes READY ->\n"
"LENT. Returns (code, banked, gone): code is the slot taken, -1 (not ready) or -2 (GENERAL: a\n"
"slot that needs the general path, left as it was); banked the tokens left; gone the tasks\n"
"that left the workers (the caller lowers `outstanding` and `load` went down here).");

static PyObject *py_steady_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 13) {
        PyErr_Format(PyExc_TypeError, "steady_take() takes exactly 13 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *headers = args[2], *tasks = args[4], *state = args[5], *ready = args[6], *load = args[7],
             *free_ = args[8], *bases = args[9], *consts = args[12];
    if (!PyTuple_Check(headers) || !PyDict_CheckExact(tasks) || !PyList_CheckExact(state) || !PyDict_CheckExact(ready) ||
        !PyList_CheckExact(load) || !PyList_CheckExact(free_) || !PyDict_CheckExact(bases) || !PyTuple_Check(consts) ||
        PyTuple_GET_SIZE(consts) != N_CONSTS) {
        PyErr_SetString(PyExc_TypeError, "steady_take: wrong container types");
        return NULL;
    }
    Py_ssize_t sem_off = PyLong_AsSsize_t(args[1]);
    long long banked = PyLong_AsLongLong(args[3]), epoch = PyLong_AsLongLong(args[10]);
    if (PyErr_Occurred()) return NULL;
    PyObject *FREE = PyTuple_GET_ITEM(consts, C_FREE), *IN_FLIGHT = PyTuple_GET_ITEM(consts, C_IN_FLIGHT),
             *READY = PyTuple_GET_ITEM(consts, C_READY), *LENT = PyTuple_GET_ITEM(consts, C_LENT);
    long long done = const_int(consts, C_DONE), ok = const_int(consts, C_OK), need = const_int(consts, C_NEED_MEMORY),
              pipe = const_int(consts, C_PIPE), f_state = const_int(consts, C_STATE), f_status = const_int(consts, C_STATUS),
              f_region = const_int(consts, C_REGION), f_r_epoch = const_int(consts, C_R_EPOCH),
              f_r_seq = const_int(consts, C_R_SEQ), n_fields = const_int(consts, C_FIELDS);
    if (PyErr_Occurred()) return NULL;
    long long fields[] = {f_state, f_status, f_region, f_r_epoch, f_r_seq};
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        if (fields[i] < 0 || fields[i] >= n_fields || n_fields > 4096) {
            PyErr_SetString(PyExc_ValueError, "steady_take: a header field index outside the header");
            return NULL;
        }
    }
    Py_ssize_t n_slots = PyList_GET_SIZE(state);
    if (PyTuple_GET_SIZE(headers) != n_slots) {
        PyErr_SetString(PyExc_ValueError, "steady_take: one header offset per slot");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0) return NULL;
    PyObject *out = NULL, *back = NULL;
    char **hdr = NULL;
    long long gone = 0, code = NOT_READY;
    if (sem_off < 0 || sem_off > view.len - (Py_ssize_t)sizeof(sem_t) || sem_off % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "steady_take: the semaphore lies outside the buffer");
        goto release;
    }
    /* The address of every header, checked once (as many as the ring has slots). */
    hdr = PyMem_New(char *, n_slots > 0 ? n_slots : 1);
    if (hdr == NULL) {
        PyErr_NoMemory();
        goto release;
    }
    for (Py_ssize_t s = 0; s < n_slots; s++) {
        Py_ssize_t off = PyLong_AsSsize_t(PyTuple_GET_ITEM(headers, s));
        if (off == -1 && PyErr_Occurred()) goto release;
        if (off < 0 || off > view.len - n_fields * 8 || off % 8 != 0) {
            PyErr_Format(PyExc_ValueError, "steady_take: header offset %zd does not fit the buffer", off);
            goto release;
        }
        hdr[s] = (char *)view.buf + off;
    }

    /* (1) Returned slots. Checked first, so a table that is not as expected is left as it was. */
    back = PyList_New(0);
    if (back == NULL) goto release;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(bases, &pos, &key, &value)) {
        if (Py_REFCNT(value) != 1) continue;
        Py_ssize_t slot = PyLong_AsSsize_t(key);
        if (slot == -1 && PyErr_Occurred()) goto release;
        if (slot < 0 || slot >= n_slots || PyList_GET_ITEM(state, slot) != LENT) {
            code = GENERAL;
            goto answer;
        }
        if (PyList_Append(back, key) < 0) goto release;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(back); i++) {
        PyObject *slot_obj = PyList_GET_ITEM(back, i);
        Py_ssize_t slot = PyLong_AsSsize_t(slot_obj);
        if (PyDict_DelItem(bases, slot_obj) < 0 || PyList_Append(free_, slot_obj) < 0) goto release;
        Py_INCREF(FREE);
        PyList_SetItem(state, slot, FREE);
    }

    /* (2) Published slots, one per token, in the tasks' (dispatch) order. */
    sem_t *sem = (sem_t *)((char *)view.buf + sem_off);
    while (sem_trywait(sem) == 0) banked++;
    pos = 0;
    while (banked > 0 && PyDict_Next(tasks, &pos, &key, &value)) {
        Py_ssize_t slot = PyLong_AsSsize_t(key);
        if (slot == -1 && PyErr_Occurred()) goto release;
        if (slot < 0 || slot >= n_slots || PyList_GET_ITEM(state, slot) != IN_FLIGHT) continue;
        const char *h = hdr[slot];
        if (__atomic_load_n((const int64_t *)h + f_state, __ATOMIC_ACQUIRE) != done) continue;
        if (!PyTuple_Check(value) || PyTuple_GET_SIZE(value) < 3) {
            code = GENERAL;
            goto answer;
        }
        long long worker = PyLong_AsLongLong(PyTuple_GET_ITEM(value, 0)),
                  t_epoch = PyLong_AsLongLong(PyTuple_GET_ITEM(value, 1)),
                  t_seq = PyLong_AsLongLong(PyTuple_GET_ITEM(value, 2));
        if (PyErr_Occurred()) goto release;
        if (field(h, f_r_seq) != t_seq || field(h, f_r_epoch) != t_epoch || field(h, f_status) == need ||
            field(h, f_region) == pipe || t_epoch != epoch || worker < 0 || worker >= PyList_GET_SIZE(load)) {
            code = GENERAL;  /* torn, asks for memory, came over the pipe, or a stale epoch's */
            goto answer;
        }
        /* SlotTable.done: IN_FLIGHT -> READY, the task leaves its worker, ready[seq] = slot. */
        long long busy = PyLong_AsLongLong(PyList_GET_ITEM(load, worker));
        if (busy == -1 && PyErr_Occurred()) goto release;
        PyObject *n = PyLong_FromLongLong(busy - 1);
        if (n == NULL) goto release;
        PyList_SetItem(load, worker, n);
        if (PyDict_SetItem(ready, PyTuple_GET_ITEM(value, 2), key) < 0) goto release;
        Py_INCREF(READY);
        PyList_SetItem(state, slot, READY);
        gone++;
        banked--;
    }

    /* (3) The next batch in order, if it is one. */
    PyObject *seq = args[11];
    PyObject *slot_obj = PyDict_GetItemWithError(ready, seq);
    if (slot_obj == NULL) {
        if (PyErr_Occurred()) goto release;
        goto answer;  /* NOT_READY */
    }
    Py_ssize_t slot = PyLong_AsSsize_t(slot_obj);
    if (slot == -1 && PyErr_Occurred()) goto release;
    int has_task = slot >= 0 && slot < n_slots ? PyDict_Contains(tasks, slot_obj) : 0;
    if (has_task < 0) goto release;
    if (!has_task || PyList_GET_ITEM(state, slot) != READY || field(hdr[slot], f_status) != ok) {
        code = GENERAL;  /* an end of shard or an error (_take_next says what it is), or not a slot table's */
        goto answer;
    }
    Py_INCREF(slot_obj);
    if (PyDict_DelItem(ready, seq) < 0 || PyDict_DelItem(tasks, slot_obj) < 0) {
        Py_DECREF(slot_obj);
        goto release;
    }
    Py_DECREF(slot_obj);
    Py_INCREF(LENT);
    PyList_SetItem(state, slot, LENT);
    code = slot;
answer:
    out = result(code, banked, gone);
release:
    PyMem_Free(hdr);
    Py_XDECREF(back);
    PyBuffer_Release(&view);
    return out;
}

extern PyObject *shmloader_post_task(PyObject *self, PyObject *const *args, Py_ssize_t nargs); /* native/_sync.c */

/* Indices into dispatch_next's `post` tuple (Ring.posting) and `consts` tuple (_consume._DISPATCH). */
enum { P_BUFFER, P_HEADERS, P_DATA, P_CAP, P_QUEUES, P_QUEUE_LEN, P_TAILS, P_SEMS, N_POST };
enum { D_FREE, D_IN_FLIGHT, D_TASK, N_DISPATCH };

static PyObject *dispatched(long code, Py_ssize_t rr, PyObject *slot, Py_ssize_t worker, PyObject *index) {
    return Py_BuildValue("(lnOnO)", code, rr, slot, worker, index);
}

PyDoc_STRVAR(dispatch_next_doc,
"dispatch_next($module, sampler, active, rr, load, free, state, tasks, epoch, seq, post, consts, /)\n--\n\n"
"The next task of an in-order epoch in one call, as RingIterator._next_task, SlotTable.dispatch\n"
"and Ring.post_task make it in turn. The worker: the first of `active` from position `rr` on,\n"
"round robin (Dispatcher.pick, in order). The index: next(`sampler`). The slot: popped from\n"
"`free`; it goes FREE -> IN_FLIGHT, tasks[slot] = Task(worker, epoch, seq, index, 0) and\n"
"load[worker] += 1. Then the task is written and posted as post_task writes it, with `post` =\n"
"Ring.posting (buffer, header offsets, data offsets, data bytes, queue offsets, queue length,\n"
"tails, task semaphores); tails[worker] += 1 once posted. `consts` = (FREE, IN_FLIGHT, Task).\n"
"Returns (code, rr, slot, worker, index): code 1 posted; 0 dispatched but not posted (the index\n"
"is not a list of int64 ints, or does not fit the slot: the caller hands it on its own way);\n"
"-1 no worker is active; -2 the sampler is exhausted; rr the round-robin position after the\n"
"pick. The free slot is checked before anything is taken; an exception from the sampler\n"
"propagates with nothing dispatched.");

static PyObject *py_dispatch_next(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11) {
        PyErr_Format(PyExc_TypeError, "dispatch_next() takes exactly 11 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *sampler = args[0], *active = args[1], *load = args[3], *free_ = args[4], *state = args[5],
             *tasks = args[6], *epoch = args[7], *seq = args[8], *post = args[9], *consts = args[10];
    if (!PyIter_Check(sampler) || !PyList_CheckExact(active) || !PyList_CheckExact(load) || !PyList_CheckExact(free_) ||
        !PyList_CheckExact(state) || !PyDict_CheckExact(tasks) || !PyTuple_Check(post) ||
        PyTuple_GET_SIZE(post) != N_POST || !PyTuple_Check(consts) || PyTuple_GET_SIZE(consts) != N_DISPATCH) {
        PyErr_SetString(PyExc_TypeError, "dispatch_next: wrong container types");
        return NULL;
    }
    PyObject *headers = PyTuple_GET_ITEM(post, P_HEADERS), *datas = PyTuple_GET_ITEM(post, P_DATA),
             *queues = PyTuple_GET_ITEM(post, P_QUEUES), *tails = PyTuple_GET_ITEM(post, P_TAILS),
             *sems = PyTuple_GET_ITEM(post, P_SEMS), *task_type = PyTuple_GET_ITEM(consts, D_TASK);
    Py_ssize_t n_workers = PyList_GET_SIZE(load), n_slots = PyList_GET_SIZE(state);
    if (!PyTuple_Check(headers) || !PyTuple_Check(datas) || !PyTuple_Check(queues) || !PyList_CheckExact(tails) ||
        !PyList_Check(sems) || PyTuple_GET_SIZE(headers) != n_slots || PyTuple_GET_SIZE(datas) != n_slots ||
        PyTuple_GET_SIZE(queues) != n_workers || PyList_GET_SIZE(tails) != n_workers ||
        PyList_GET_SIZE(sems) != n_workers || PyList_GET_SIZE(active) != n_workers || n_workers == 0 ||
        !PyType_Check(task_type) || !PyType_IsSubtype((PyTypeObject *)task_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "dispatch_next: the ring's and the table's sizes disagree");
        return NULL;
    }
    Py_ssize_t rr = PyLong_AsSsize_t(args[2]), queue_len = PyLong_AsSsize_t(PyTuple_GET_ITEM(post, P_QUEUE_LEN));
    if (PyErr_Occurred()) return NULL;
    if (rr < 0 || rr >= n_workers || queue_len <= 0) {
        PyErr_SetString(PyExc_ValueError, "dispatch_next: round-robin position or queue length out of range");
        return NULL;
    }
    /* SlotTable.dispatch's slot and its check, before anything is taken. */
    Py_ssize_t n_free = PyList_GET_SIZE(free_);
    if (n_free == 0) {
        PyErr_SetString(PyExc_ValueError, "dispatch_next: no free slot");
        return NULL;
    }
    PyObject *slot_obj = PyList_GET_ITEM(free_, n_free - 1);
    Py_ssize_t slot = PyLong_AsSsize_t(slot_obj);
    if (slot == -1 && PyErr_Occurred()) return NULL;
    if (slot < 0 || slot >= n_slots) {
        PyErr_Format(PyExc_ValueError, "dispatch_next: free slot %zd is not one of %zd", slot, n_slots);
        return NULL;
    }
    if (PyList_GET_ITEM(state, slot) != PyTuple_GET_ITEM(consts, D_FREE)) {
        PyObject *now = PyList_GET_ITEM(state, slot), *name = PyObject_GetAttrString(now, "name");
        if (name == NULL) {  /* not a SlotState: said as it is */
            PyErr_Clear();
            name = PyObject_Repr(now);
        }
        if (name != NULL) PyErr_Format(PyExc_AssertionError, "slot %zd is %S, expected ['FREE']", slot, name);
        Py_XDECREF(name);
        return NULL;
    }
    /* Dispatcher.pick, in order: the first active worker from rr on; rr moves past each one looked at. */
    Py_ssize_t worker = -1;
    for (Py_ssize_t i = 0; i < n_workers; i++) {
        Py_ssize_t w = rr;
        rr = (rr + 1) % n_workers;
        int on = PyObject_IsTrue(PyList_GET_ITEM(active, w));
        if (on < 0) return NULL;
        if (on) {
            worker = w;
            break;
        }
    }
    if (worker < 0) return dispatched(-1, rr, Py_None, -1, Py_None);
    PyObject *index = PyIter_Next(sampler);
    if (index == NULL) {
        if (PyErr_Occurred()) return NULL;
        return dispatched(-2, rr, Py_None, worker, Py_None);
    }
    PyObject *out = NULL, *worker_obj = NULL, *items = NULL, *task = NULL, *busy = NULL, *entry = NULL, *posted = NULL;
    Py_INCREF(slot_obj);
    long long load_w = PyLong_AsLongLong(PyList_GET_ITEM(load, worker)),
              tail = PyLong_AsLongLong(PyList_GET_ITEM(tails, worker));
    Py_ssize_t queue = PyLong_AsSsize_t(PyTuple_GET_ITEM(queues, worker));
    if (PyErr_Occurred()) goto done;
    if (tail < 0 || tail == LLONG_MAX || queue < 0 || queue > PY_SSIZE_T_MAX / 2 || queue_len > PY_SSIZE_T_MAX / 16 ||
        load_w < 0 || load_w == LLONG_MAX) {
        PyErr_SetString(PyExc_ValueError, "dispatch_next: a queue tail or offset, or a load, out of range");
        goto done;
    }
    worker_obj = PyLong_FromSsize_t(worker);
    items = worker_obj ? Py_BuildValue("((OOOOi))", worker_obj, epoch, seq, index, 0) : NULL;
    task = items ? PyTuple_Type.tp_new((PyTypeObject *)task_type, items, NULL) : NULL;
    busy = task ? PyLong_FromLongLong(load_w + 1) : NULL;
    entry = busy ? PyLong_FromSsize_t(queue + (Py_ssize_t)(tail % queue_len) * 8) : NULL;
    if (entry == NULL) goto done;
    /* The table's transitions (SlotTable.dispatch), none of which can fail from here on but the
       dict insert, which goes first. */
    if (PyDict_SetItem(tasks, slot_obj, task) < 0) goto done;
    if (PyList_SetSlice(free_, n_free - 1, n_free, NULL) < 0) goto done;
    Py_INCREF(PyTuple_GET_ITEM(consts, D_IN_FLIGHT));
    PyList_SetItem(state, slot, PyTuple_GET_ITEM(consts, D_IN_FLIGHT));
    PyList_SetItem(load, worker, busy);
    busy = NULL;
    /* Ring.post_task */
    PyObject *post_args[11] = {PyTuple_GET_ITEM(post, P_BUFFER), PyTuple_GET_ITEM(headers, slot), epoch, seq, index,
                               Py_False, PyTuple_GET_ITEM(datas, slot), PyTuple_GET_ITEM(post, P_CAP), entry, slot_obj,
                               PyList_GET_ITEM(sems, worker)};
    posted = shmloader_post_task(NULL, post_args, 11);
    if (posted == NULL) goto done;
    long code = PyLong_AsLong(posted);
    if (code == -1 && PyErr_Occurred()) goto done;
    if (code == 1) {
        PyObject *next_tail = PyLong_FromLongLong(tail + 1);
        if (next_tail == NULL) goto done;
        PyList_SetItem(tails, worker, next_tail);
    }
    out = dispatched(code == 1, rr, slot_obj, worker, index);
done:
    Py_XDECREF(posted);
    Py_XDECREF(entry);
    Py_XDECREF(busy);
    Py_XDECREF(task);
    Py_XDECREF(items);
    Py_XDECREF(worker_obj);
    Py_DECREF(slot_obj);
    Py_DECREF(index);
    return out;
}

PyMethodDef shmloader_steady_methods[] = {
    {"steady_take", (PyCFunction)(void (*)(void))py_steady_take, METH_FASTCALL, steady_take_doc},
    {"dispatch_next", (PyCFunction)(void (*)(void))py_dispatch_next, METH_FASTCALL, dispatch_next_doc},
    {NULL, NULL, 0, NULL},
};
