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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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
    long long gone = 0, code = NOT_READY;
    if (sem_off < 0 || sem_off > view.len - (Py_ssize_t)sizeof(sem_t) || sem_off % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "steady_take: the semaphore lies outside the buffer");
        goto release;
    }
    /* The address of every header, checked once. */
    char *hdr[256];
    if (n_slots > 256) {
        PyErr_SetString(PyExc_ValueError, "steady_take: at most 256 slots");
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
    Py_XDECREF(back);
    PyBuffer_Release(&view);
    return out;
}

PyMethodDef shmloader_steady_methods[] = {
    {"steady_take", (PyCFunction)(void (*)(void))py_steady_take, METH_FASTCALL, steady_take_doc},
    {NULL, NULL, 0, NULL},
};
