/*
 * shmloader._native, part 4: the Scheduler — the state of every slot of the ring, the
 * epoch's tasks, and the consumer's per-batch step over them.
 *
 * The main process's iterator (shmloader/main/iterator.py) owns one. It is the one place slot
 * state changes: every transition below is written once, as a C function, and called both
 * by the method of its name (the general path: overflow, recovery, epochs, errors) and by
 * `step`, the per-batch path, which chains the ordinary ones and returns to Python at the
 * first thing that is not ordinary. There is no second copy of any transition.
 *
 * Slot states (native/_layout.h, shmloader/main/scheduler.py's SlotState):
 *   FREE       no task; may be dispatched
 *   IN_FLIGHT  a worker owns it: task queued, being written, or published and not collected
 *   WAITING    its worker's batch did not fit; the worker waits for overflow memory
 *   READY      a result of the current epoch, collected, not yet taken
 *   LENT       taken: the user views it, or a device copy reads it
 *
 * Invariants (`check` asserts them; tests/unit/test_slots.py runs it after every step of
 * random sequences):
 *   - every slot is in exactly one state; the free stack holds exactly the FREE slots, once;
 *   - a slot has a task exactly when it is IN_FLIGHT, WAITING or READY; the task list holds
 *     those slots in dispatch order, once;
 *   - every READY slot's task is of the current epoch; n_ready counts them;
 *   - load[w] counts the IN_FLIGHT and WAITING tasks of worker w; outstanding counts those
 *     of the current epoch; waiting_count the WAITING slots.
 *
 * The dispatch cursor (round robin over the active workers, as torch's loader), the
 * sequence numbers sent and received, and the ready semaphore's banked tokens live here
 * too: the step reads and moves them. A token means "look for DONE slots", never "this
 * slot is done": a worker stores DONE before it posts, so a DONE slot may be found before
 * its own token arrives, with another's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <semaphore.h>
#include <stdint.h>
#include <string.h>

#include "_layout.h"

#define NIL (-1)

/* step's answers other than a slot (shmloader/main/scheduler.py's Step). */
enum { NOT_READY = -1, EV_NEED_MEMORY = -2, EV_PIPE = -3, EV_TORN = -4, EV_STALE = -5, EV_RESULT = -6 };
#define FAILED (-100) /* (internal) an exception is set */

int shmloader_write_task(Py_buffer *view, Py_ssize_t header, int64_t epoch, int64_t seq, PyObject *index,
                         int pickled, Py_ssize_t data, Py_ssize_t cap, Py_ssize_t entry, int64_t slot,
                         Py_ssize_t sem_off, int own); /* native/_sync.c */

static const char *const STATE_NAMES[N_SLOT_STATES] = {"FREE", "IN_FLIGHT", "WAITING", "READY", "LENT"};

typedef struct {
    PyObject_HEAD
    Py_ssize_t n_slots, n_workers, cap;
    int in_order;
    /* per slot */
    uint8_t *state;
    Py_ssize_t *worker;
    int64_t *epoch, *seq, *needed;
    PyObject **index;        /* the task's index (owned), NULL without a task */
    Py_ssize_t *next, *prev; /* the task list, in dispatch order */
    Py_ssize_t head, tail, n_tasks;
    Py_ssize_t *free_stack, n_free;
    /* per worker */
    int64_t *load;
    uint8_t *active;
    /* counts and cursors */
    int64_t table_epoch, outstanding, waiting_count, n_ready;
    Py_ssize_t rr;
    int64_t send_seq, rcvd_seq, banked;
    int exhausted; /* the epoch has no more tasks: its sampler is exhausted, or every shard ended */
    int own; /* tasks dispatched now go into memory of their own: the user holds the ring */
    /* the ring, once attached */
    PyObject *ring;
    int64_t *tails; /* per worker: entries queued on the attached ring so far. Written here alone:
                       the step's posts and every other queue write of the main process (push,
                       post_index, renew_queue) are this table's methods. */
    Py_ssize_t *header_off, *data_off, *queue_off, *task_sem;
    Py_ssize_t ready_sem, queue_len, data_bytes;
    /* tasks dispatched but not posted (the index is no list of int64 ints, or does not fit) */
    PyObject *unposted;
    Py_ssize_t event;
} Scheduler;

/* ------------------------------------------------------------------ the table */
static int wrong(Scheduler *t, Py_ssize_t slot, unsigned expected) {
    char names[80] = "";
    for (int s = 0; s < N_SLOT_STATES; s++) {
        if (expected & (1u << s)) {
            if (names[0]) strcat(names, ", ");
            strcat(names, STATE_NAMES[s]);
        }
    }
    PyErr_Format(PyExc_AssertionError, "slot %zd is %s, expected [%s]", slot, STATE_NAMES[t->state[slot]], names);
    return -1;
}

static int in_range(Scheduler *t, Py_ssize_t slot) {
    if (slot >= 0 && slot < t->n_slots) return 0;
    PyErr_Format(PyExc_IndexError, "slot %zd is not one of the %zd slots", slot, t->n_slots);
    return -1;
}

/* slot must be in one of the states of the `expected` bit mask. */
static int expect(Scheduler *t, Py_ssize_t slot, unsigned expected) {
    if (in_range(t, slot) < 0) return -1;
    return (expected >> t->state[slot]) & 1u ? 0 : wrong(t, slot, expected);
}

#define BIT(s) (1u << (s))

static void list_append(Scheduler *t, Py_ssize_t slot) {
    t->prev[slot] = t->tail;
    t->next[slot] = NIL;
    if (t->tail != NIL) t->next[t->tail] = slot; else t->head = slot;
    t->tail = slot;
    t->n_tasks++;
}

static void list_remove(Scheduler *t, Py_ssize_t slot) {
    Py_ssize_t p = t->prev[slot], n = t->next[slot];
    if (p != NIL) t->next[p] = n; else t->head = n;
    if (n != NIL) t->prev[n] = p; else t->tail = p;
    t->prev[slot] = t->next[slot] = NIL;
    t->n_tasks--;
}

static void set_task(Scheduler *t, Py_ssize_t slot, Py_ssize_t worker, int64_t epoch, int64_t seq, PyObject *index) {
    t->worker[slot] = worker;
    t->epoch[slot] = epoch;
    t->seq[slot] = seq;
    t->needed[slot] = 0;
    Py_INCREF(index);
    Py_XSETREF(t->index[slot], index);
    list_append(t, slot);
}

static void drop_task(Scheduler *t, Py_ssize_t slot) {
    list_remove(t, slot);
    t->worker[slot] = NIL;
    Py_CLEAR(t->index[slot]);
}

static void push_free(Scheduler *t, Py_ssize_t slot) {
    t->state[slot] = SLOT_FREE;
    t->free_stack[t->n_free++] = slot;
}

/* The task leaves its worker (its result came, or it is dropped). */
static void leave_worker(Scheduler *t, Py_ssize_t slot) {
    t->load[t->worker[slot]]--;
    if (t->epoch[slot] == t->table_epoch) t->outstanding--;
}

/* FREE -> IN_FLIGHT: the free slot on top of the stack carries task `seq` of the current epoch. */
static Py_ssize_t table_dispatch(Scheduler *t, Py_ssize_t worker, int64_t seq, PyObject *index) {
    if (t->n_free == 0) {
        PyErr_SetString(PyExc_IndexError, "dispatch: no free slot");
        return -1;
    }
    Py_ssize_t slot = t->free_stack[t->n_free - 1];
    if (expect(t, slot, BIT(SLOT_FREE)) < 0) return -1;
    t->n_free--;
    t->state[slot] = SLOT_IN_FLIGHT;
    set_task(t, slot, worker, t->table_epoch, seq, index);
    t->load[worker]++;
    t->outstanding++;
    return slot;
}

/* IN_FLIGHT -> READY; a stale epoch's result goes FREE instead (0; 1 when READY). */
static int table_done(Scheduler *t, Py_ssize_t slot) {
    if (expect(t, slot, BIT(SLOT_IN_FLIGHT)) < 0) return -1;
    t->load[t->worker[slot]]--;
    if (t->epoch[slot] != t->table_epoch) {
        drop_task(t, slot);
        push_free(t, slot);
        return 0;
    }
    t->outstanding--;
    t->state[slot] = SLOT_READY;
    t->n_ready++;
    return 1;
}

/* READY -> LENT. */
static void table_take_slot(Scheduler *t, Py_ssize_t slot) {
    t->state[slot] = SLOT_LENT;
    t->n_ready--;
    drop_task(t, slot);
}

/* The READY slot of result `seq` (of the current epoch: every READY slot's), or NIL. */
static Py_ssize_t ready_slot(Scheduler *t, int64_t seq) {
    for (Py_ssize_t s = t->head; s != NIL; s = t->next[s])
        if (t->state[s] == SLOT_READY && t->seq[s] == seq) return s;
    return NIL;
}

/* The READY slot of the lowest sequence number, or NIL. */
static Py_ssize_t first_ready(Scheduler *t) {
    Py_ssize_t best = NIL;
    for (Py_ssize_t s = t->head; s != NIL; s = t->next[s])
        if (t->state[s] == SLOT_READY && (best == NIL || t->seq[s] < t->seq[best])) best = s;
    return best;
}

/* LENT -> FREE. */
static int table_give_back(Scheduler *t, Py_ssize_t slot) {
    if (expect(t, slot, BIT(SLOT_LENT)) < 0) return -1;
    push_free(t, slot);
    return 0;
}

/* ---------------------------------------------------------------- dispatching */
/* Workers whose shard goes on. */
static Py_ssize_t n_active(Scheduler *t) {
    Py_ssize_t n = 0;
    for (Py_ssize_t w = 0; w < t->n_workers; w++) n += t->active[w];
    return n;
}

/* Worker w's shard ended: it takes no more tasks this epoch. With no worker left the epoch has
   no more tasks (exhausted), whatever the sampler still has. The one way `active` changes
   within an epoch (new_epoch sets every worker active again). */
static void end_shard(Scheduler *t, Py_ssize_t w) {
    t->active[w] = 0;
    if (n_active(t) == 0) t->exhausted = 1;
}

/* The worker for the next task: the first active one from the cursor on (in order), or the
   first with fewer than its share of the cap (out of order); -1 when none can take one now.
   -1 is never "the epoch is over": out of order, every active worker may sit at its share
   while fewer than `cap` tasks exist (a shard ended, and the share floors); a result that
   comes lowers its worker's load, and the next fill picks again. */
static Py_ssize_t pick(Scheduler *t) {
    Py_ssize_t active = n_active(t);
    for (Py_ssize_t i = 0; i < t->n_workers; i++) {
        Py_ssize_t w = t->rr;
        t->rr = (w + 1) % t->n_workers;
        if (t->active[w] && (t->in_order || t->load[w] < t->cap / active)) return w;
    }
    return -1;
}

/* The next index of the epoch for a picked worker: 1 with *index (a new reference); 0 when no
   worker can take one now (nothing set: not the end) or the epoch has no more tasks (the
   sampler is exhausted: `exhausted` set); -1 on the sampler's error. */
static int next_index(Scheduler *t, PyObject *sampler, Py_ssize_t *worker, PyObject **index) {
    if (t->exhausted) return 0;
    *worker = pick(t);
    if (*worker < 0) return 0;
    *index = PyIter_Next(sampler);
    if (*index == NULL) {
        if (PyErr_Occurred()) return -1;
        t->exhausted = 1;
        return 0;
    }
    return 1;
}

/* The task queue entry and the post for `slot`'s task (view: the ring, writable). */
static int post_as(Scheduler *t, Py_buffer *view, Py_ssize_t slot, PyObject *index, int pickled) {
    Py_ssize_t w = t->worker[slot];
    Py_ssize_t entry = t->queue_off[w] + (Py_ssize_t)(t->tails[w] % t->queue_len) * 8;
    int code = shmloader_write_task(view, t->header_off[slot], t->epoch[slot], t->seq[slot], index, pickled,
                                    t->data_off[slot], t->data_bytes, entry, slot, t->task_sem[w], t->own);
    if (code == 1) t->tails[w]++;
    return code;
}

static int post(Scheduler *t, Py_buffer *view, Py_ssize_t slot) { return post_as(t, view, slot, t->index[slot], 0); }

/* Dispatch tasks while a slot is free, fewer than `cap` tasks exist and the epoch has more:
   each posted to its worker, or (an index the slot cannot take as int64s) listed unposted. */
static int fill(Scheduler *t, Py_buffer *view, PyObject *sampler) {
    while (t->n_free > 0 && t->n_tasks < t->cap && !t->exhausted) {
        Py_ssize_t worker;
        PyObject *index;
        int got = next_index(t, sampler, &worker, &index);
        if (got <= 0) return got;
        Py_ssize_t slot = table_dispatch(t, worker, t->send_seq, index);
        Py_DECREF(index);
        if (slot < 0) return -1;
        t->send_seq++;
        int code = post(t, view, slot);
        if (code == -2) return -1;
        if (code != 1) {
            PyObject *s = PyLong_FromSsize_t(slot);
            if (s == NULL || PyList_Append(t->unposted, s) < 0) {
                Py_XDECREF(s);
                return -1;
            }
            Py_DECREF(s);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ the step */
static int64_t field(Py_buffer *view, Py_ssize_t header, int f) {
    return ((const int64_t *)((const char *)view->buf + header))[f];
}

/* Slots whose base in `bases` (the lease table: slot -> array) nothing else holds: their
   batch is gone. They leave `bases` and go LENT -> FREE. */
static int reclaim(Scheduler *t, PyObject *bases) {
    PyObject *key, *value, *gone = NULL;
    Py_ssize_t pos = 0;
    while (PyDict_Next(bases, &pos, &key, &value)) {
        if (Py_REFCNT(value) != 1) continue;
        if (gone == NULL && (gone = PyList_New(0)) == NULL) return -1;
        if (PyList_Append(gone, key) < 0) goto fail;
    }
    if (gone == NULL) return 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(gone); i++) {
        PyObject *k = PyList_GET_ITEM(gone, i);
        Py_ssize_t slot = PyLong_AsSsize_t(k);
        if ((slot == -1 && PyErr_Occurred()) || table_give_back(t, slot) < 0 || PyDict_DelItem(bases, k) < 0)
            goto fail;
    }
    Py_DECREF(gone);
    return 0;
fail:
    Py_DECREF(gone);
    return -1;
}

/* Published slots, one per token (banked ones included), in dispatch order: IN_FLIGHT ->
   READY. Returns 0, or an event (its slot in t->event): a result that asks for overflow
   memory or came over the pipe (its token taken, the slot as it was), one whose echoed task
   is not its task (torn), or a stale epoch's (its token taken, the slot FREE). */
static int collect(Scheduler *t, Py_buffer *view) {
    sem_t *sem = (sem_t *)((char *)view->buf + t->ready_sem);
    while (sem_trywait(sem) == 0) t->banked++;
    Py_ssize_t s = t->head;
    while (t->banked > 0 && s != NIL) {
        Py_ssize_t slot = s, h = t->header_off[s];
        s = t->next[s];
        if (t->state[slot] != SLOT_IN_FLIGHT) continue;
        if (__atomic_load_n((const int64_t *)((const char *)view->buf + h), __ATOMIC_ACQUIRE) != STATE_DONE) continue;
        t->event = slot;
        if (field(view, h, F_R_SEQ) != t->seq[slot] || field(view, h, F_R_EPOCH) != t->epoch[slot]) return EV_TORN;
        t->banked--;
        if (field(view, h, F_STATUS) == STATUS_NEED_MEMORY) return EV_NEED_MEMORY;
        if (field(view, h, F_REGION) == REGION_PIPE) return EV_PIPE;
        int ready = table_done(t, slot);
        if (ready < 0) return FAILED;
        if (!ready) return EV_STALE;
    }
    return 0;
}

PyDoc_STRVAR(step_doc,
"step($self, bases, sampler, dispatch, take, /)\n--\n\n"
"One look of the consumer, never waiting: the per-batch path. In turn: slots whose batch is gone\n"
"(their base in `bases`, the lease table, referenced nowhere else) go back; published slots are\n"
"collected; tasks are dispatched (when `dispatch`: not while the ring is to grow); when `take`,\n"
"the next result is taken (in order: result rcvd_seq; out of order: the lowest ready) and tasks\n"
"are dispatched again for the slot it left. Returns the slot taken, holding a batch; NOT_READY (-1)\n"
"when there is none yet; or, at the first thing that is not ordinary, an event with its slot in\n"
"`event` (NEED_MEMORY, PIPE, TORN, STALE: see collect; RESULT: a result taken that is not a\n"
"batch, LENT). Tasks dispatched but not posted are listed in `unposted`. A sampler's error\n"
"propagates, with nothing dispatched for it.");

static PyObject *step(Scheduler *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyDict_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "step() takes the lease dict, the sampler, whether to dispatch and to take");
        return NULL;
    }
    if (t->ring == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "step: no ring is attached");
        return NULL;
    }
    int dispatch = PyObject_IsTrue(args[2]), take = PyObject_IsTrue(args[3]);
    if (dispatch < 0 || take < 0 || reclaim(t, args[0]) < 0) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(t->ring, &view, PyBUF_WRITABLE) < 0) return NULL;
    long code = collect(t, &view);
    if (code == FAILED) goto error;
    if (code != 0) goto answer;
    if (dispatch && fill(t, &view, args[1]) < 0) goto error;
    Py_ssize_t slot = !take ? NIL : t->in_order ? ready_slot(t, t->rcvd_seq) : first_ready(t);
    if (slot == NIL) {
        code = NOT_READY;
        goto answer;
    }
    table_take_slot(t, slot);
    if (t->in_order) t->rcvd_seq++;
    if (field(&view, t->header_off[slot], F_STATUS) != STATUS_OK) {
        t->event = slot;
        code = EV_RESULT;
        goto answer;
    }
    if (dispatch && fill(t, &view, args[1]) < 0) goto error;  /* the batch taken left the tasks */
    code = slot;
answer:
    PyBuffer_Release(&view);
    return PyLong_FromLong(code);
error:
    PyBuffer_Release(&view);
    return NULL;
}

/* ------------------------------------------------------------- the methods */
static int slot_arg(Scheduler *t, PyObject *o, Py_ssize_t *slot) {
    *slot = PyLong_AsSsize_t(o);
    if (*slot == -1 && PyErr_Occurred()) return -1;
    return in_range(t, *slot);
}

static int worker_arg(Scheduler *t, PyObject *o, Py_ssize_t *worker) {
    *worker = PyLong_AsSsize_t(o);
    if (*worker == -1 && PyErr_Occurred()) return -1;
    if (*worker >= 0 && *worker < t->n_workers) return 0;
    PyErr_Format(PyExc_IndexError, "worker %zd is not one of the %zd workers", *worker, t->n_workers);
    return -1;
}

static int i64_arg(PyObject *o, int64_t *out) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)v;
    return 0;
}

static int nargs_are(const char *name, Py_ssize_t nargs, Py_ssize_t want) {
    if (nargs == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd arguments (%zd given)", name, want, nargs);
    return -1;
}

static PyObject *task_tuple(Scheduler *t, Py_ssize_t slot) {
    PyObject *index = t->index[slot] != NULL ? t->index[slot] : Py_None; /* (NULL only after tp_clear) */
    return Py_BuildValue("(nLLOL)", t->worker[slot], (long long)t->epoch[slot], (long long)t->seq[slot], index,
                         (long long)t->needed[slot]);
}

PyDoc_STRVAR(dispatch_doc, "dispatch($self, worker, seq, index, /)\n--\n\n"
"FREE -> IN_FLIGHT: the slot on top of the free stack carries task `seq` of the current epoch\n"
"for `worker`. Returns the slot.");

static PyObject *m_dispatch(Scheduler *t, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t worker;
    int64_t seq;
    if (nargs_are("dispatch", nargs, 3) < 0 || worker_arg(t, args[0], &worker) < 0 || i64_arg(args[1], &seq) < 0)
        return NULL;
    Py_ssize_t slot = table_dispatch(t, worker, seq, args[2]);
    return slot < 0 ? NULL : PyLong_FromSsize_t(slot);
}

PyDoc_STRVAR(redispatch_doc, "redispatch($self, slot, worker, seq, index, /)\n--\n\n"
"FREE -> IN_FLIGHT: task `seq` of the current epoch, orphaned by a dead worker, again, for\n"
"`worker` (a task of another epoch is not dispatched again: its result would be dropped).");

static PyObject *m_redispatch(Scheduler *t, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot, worker;
    int64_t seq;
    if (nargs_are("redispatch", nargs, 4) < 0 || slot_arg(t, args[0], &slot) < 0 || worker_arg(t, args[1], &worker) < 0 ||
        i64_arg(args[2], &seq) < 0 || expect(t, slot, BIT(SLOT_FREE)) < 0)
        return NULL;
    Py_ssize_t i = 0;
    while (i < t->n_free && t->free_stack[i] != slot) i++;
    memmove(t->free_stack + i, t->free_stack + i + 1, (size_t)(t->n_free - i - 1) * sizeof(Py_ssize_t));
    t->n_free--;
    t->state[slot] = SLOT_IN_FLIGHT;
    set_task(t, slot, worker, t->table_epoch, seq, args[3]);
    t->load[worker]++;
    t->outstanding++;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(done_doc, "done($self, slot, /)\n--\n\n"
"IN_FLIGHT -> READY: its result was collected. A stale epoch's result goes FREE instead:\n"
"returns whether the slot is READY.");

static PyObject *m_done(Scheduler *t, PyObject *arg) {
    Py_ssize_t slot;
    if (slot_arg(t, arg, &slot) < 0) return NULL;
    int ready = table_done(t, slot);
    return ready < 0 ? NULL : PyBool_FromLong(ready);
}

PyDoc_STRVAR(overflowed_doc, "overflowed($self, slot, needed, /)\n--\n\n"
"IN_FLIGHT -> WAITING: its worker waits for `needed` bytes of overflow memory. A stale epoch's\n"
"request is not served: the slot goes FREE. Returns whether it is WAITING.");

static PyObject *m_overflowed(Scheduler *t, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot;
    int64_t needed;
    if (nargs_are("overflowed", nargs, 2) < 0 || slot_arg(t, args[0], &slot) < 0 || i64_arg(args[1], &needed) < 0 ||
        expect(t, slot, BIT(SLOT_IN_FLIGHT)) < 0)
        return NULL;
    if (t->epoch[slot] != t->table_epoch) {
        leave_worker(t, slot);
        drop_task(t, slot);
        push_free(t, slot);
        Py_RETURN_FALSE;
    }
    t->state[slot] = SLOT_WAITING;
    t->waiting_count++;
    t->needed[slot] = needed;
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(drop_doc, "drop($self, slot, /)\n--\n\n"
"WAITING -> FREE: a request for overflow memory that will not be served (a stale epoch's).");

static PyObject *m_drop(Scheduler *t, PyObject *arg) {
    Py_ssize_t slot;
    if (slot_arg(t, arg, &slot) < 0 || expect(t, slot, BIT(SLOT_WAITING)) < 0) return NULL;
    t->waiting_count--;
    leave_worker(t, slot);
    drop_task(t, slot);
    push_free(t, slot);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(granted_doc, "granted($self, slot, /)\n--\n\n"
"WAITING -> IN_FLIGHT: the worker has its memory and writes the batch.");

static PyObject *m_granted(Scheduler *t, PyObject *arg) {
    Py_ssize_t slot;
    if (slot_arg(t, arg, &slot) < 0 || expect(t, slot, BIT(SLOT_WAITING)) < 0) return NULL;
    t->waiting_count--;
    t->state[slot] = SLOT_IN_FLIGHT;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(take_doc, "take($self, seq, /)\n--\n\n"
"READY -> LENT: the slot holding result `seq` of the current epoch (KeyError: none does).");

static PyObject *m_take(Scheduler *t, PyObject *arg) {
    int64_t seq;
    if (i64_arg(arg, &seq) < 0) return NULL;
    Py_ssize_t slot = ready_slot(t, seq);
    if (slot == NIL) {
        PyErr_SetObject(PyExc_KeyError, arg);
        return NULL;
    }
    table_take_slot(t, slot);
    return PyLong_FromSsize_t(slot);
}

PyDoc_STRVAR(give_back_doc, "give_back($self, slot, /)\n--\n\n"
"LENT -> FREE: its batch was dropped or released, or its device copy completed.");

static PyObject *m_give_back(Scheduler *t, PyObject *arg) {
    Py_ssize_t slot;
    if (slot_arg(t, arg, &slot) < 0 || table_give_back(t, slot) < 0) return NULL;
    Py_RETURN_NONE;
}

/* Sort slots by their task's (epoch, seq) (insertion sort: a ring's worth at most). */
static void sort_by_task(Scheduler *t, Py_ssize_t *slots, Py_ssize_t n) {
    for (Py_ssize_t i = 1; i < n; i++) {
        Py_ssize_t s = slots[i], j = i;
        while (j > 0 && (t->epoch[slots[j - 1]] > t->epoch[s] ||
                         (t->epoch[slots[j - 1]] == t->epoch[s] && t->seq[slots[j - 1]] > t->seq[s]))) {
            slots[j] = slots[j - 1];
            j--;
        }
        slots[j] = s;
    }
}

/* The slots of the task list in the states of `mask` (and of `worker`, unless -1), in
   dispatch order, or sorted by task. A new list, or NULL. */
static PyObject *slots_where(Scheduler *t, unsigned mask, Py_ssize_t worker, int sorted) {
    Py_ssize_t *found = PyMem_New(Py_ssize_t, t->n_slots > 0 ? t->n_slots : 1), n = 0;
    if (found == NULL) return PyErr_NoMemory();
    for (Py_ssize_t s = t->head; s != NIL; s = t->next[s])
        if (((mask >> t->state[s]) & 1u) && (worker < 0 || t->worker[s] == worker)) found[n++] = s;
    if (sorted) sort_by_task(t, found, n);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *v = PyLong_FromSsize_t(found[i]);
        if (v == NULL) Py_CLEAR(out); else PyList_SET_ITEM(out, i, v);
    }
    PyMem_Free(found);
    return out;
}

PyDoc_STRVAR(orphans_doc, "orphans($self, worker, /)\n--\n\n"
"IN_FLIGHT / WAITING -> FREE for every slot of a dead `worker`. Returns [(slot, (worker, epoch,\n"
"seq, index, needed))], lowest (epoch, seq) first: the caller dispatches the current epoch's\n"
"tasks again.");

static PyObject *m_orphans(Scheduler *t, PyObject *arg) {
    Py_ssize_t worker;
    if (worker_arg(t, arg, &worker) < 0) return NULL;
    PyObject *slots = slots_where(t, BIT(SLOT_IN_FLIGHT) | BIT(SLOT_WAITING), worker, 1);
    if (slots == NULL) return NULL;
    PyObject *out = PyList_New(PyList_GET_SIZE(slots));
    for (Py_ssize_t i = 0; out != NULL && i < PyList_GET_SIZE(slots); i++) {
        Py_ssize_t slot = PyLong_AsSsize_t(PyList_GET_ITEM(slots, i));
        PyObject *task = task_tuple(t, slot), *pair = task ? PyTuple_Pack(2, PyList_GET_ITEM(slots, i), task) : NULL;
        Py_XDECREF(task);
        if (pair == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, pair);
    }
    if (out != NULL) {  /* only once every tuple is built: nothing changes on an error */
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(slots); i++) {
            Py_ssize_t slot = PyLong_AsSsize_t(PyList_GET_ITEM(slots, i));
            leave_worker(t, slot);
            if (t->state[slot] == SLOT_WAITING) t->waiting_count--;
            drop_task(t, slot);
            push_free(t, slot);
        }
    }
    Py_DECREF(slots);
    return out;
}

PyDoc_STRVAR(new_epoch_doc, "new_epoch($self, /)\n--\n\n"
"The next epoch: results nobody will take go FREE; tasks still in flight become stale (their\n"
"results are dropped when they come). The dispatch cursor and sequence numbers start over.");

static PyObject *m_new_epoch(Scheduler *t, PyObject *unused) {
    t->table_epoch++;
    Py_ssize_t s = t->head;
    while (s != NIL) {
        Py_ssize_t slot = s;
        s = t->next[s];
        if (t->state[slot] == SLOT_READY) {
            drop_task(t, slot);
            push_free(t, slot);
        }
    }
    t->n_ready = 0;
    t->outstanding = 0;
    t->send_seq = t->rcvd_seq = 0;
    t->exhausted = 0;
    t->rr = 0;
    memset(t->active, 1, (size_t)t->n_workers);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(state_of_doc, "state_of($self, slot, /)\n--\n\nThe slot's state (an int: SlotState).");

static PyObject *m_state_of(Scheduler *t, PyObject *arg) {
    Py_ssize_t slot;
    if (slot_arg(t, arg, &slot) < 0) return NULL;
    return PyLong_FromLong(t->state[slot]);
}

PyDoc_STRVAR(count_doc, "count($self, state, /)\n--\n\nHow many slots are in `state`.");

static PyObject *m_count(Scheduler *t, PyObject *arg) {
    long state = PyLong_AsLong(arg);
    if (state == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t n = 0;
    for (Py_ssize_t s = 0; s < t->n_slots; s++) n += t->state[s] == state;
    return PyLong_FromSsize_t(n);
}

PyDoc_STRVAR(task_doc, "task($self, slot, /)\n--\n\n"
"The slot's task as (worker, epoch, seq, index, needed), or None when it has none.");

static PyObject *m_task(Scheduler *t, PyObject *arg) {
    Py_ssize_t slot;
    if (slot_arg(t, arg, &slot) < 0) return NULL;
    if (t->index[slot] == NULL) Py_RETURN_NONE;
    return task_tuple(t, slot);
}

PyDoc_STRVAR(tasks_doc, "tasks($self, /)\n--\n\nThe slots that have a task, in dispatch order.");

static PyObject *m_tasks(Scheduler *t, PyObject *unused) {
    return slots_where(t, BIT(SLOT_IN_FLIGHT) | BIT(SLOT_WAITING) | BIT(SLOT_READY), -1, 0);
}

PyDoc_STRVAR(waiting_doc, "waiting($self, /)\n--\n\n"
"WAITING slots, lowest (epoch, seq) first: the order overflow memory is granted in.");

static PyObject *m_waiting(Scheduler *t, PyObject *unused) { return slots_where(t, BIT(SLOT_WAITING), -1, 1); }

PyDoc_STRVAR(of_worker_doc, "of_worker($self, worker, /)\n--\n\nIN_FLIGHT and WAITING slots of `worker`.");

static PyObject *m_of_worker(Scheduler *t, PyObject *arg) {
    Py_ssize_t worker;
    if (worker_arg(t, arg, &worker) < 0) return NULL;
    return slots_where(t, BIT(SLOT_IN_FLIGHT) | BIT(SLOT_WAITING), worker, 0);
}

PyDoc_STRVAR(ready_doc, "ready($self, /)\n--\n\nThe READY slots, lowest sequence number first.");

static PyObject *m_ready(Scheduler *t, PyObject *unused) { return slots_where(t, BIT(SLOT_READY), -1, 1); }

PyDoc_STRVAR(ready_slot_doc, "ready_slot($self, seq, /)\n--\n\n"
"The READY slot holding result `seq` of the current epoch, or -1.");

static PyObject *m_ready_slot(Scheduler *t, PyObject *arg) {
    int64_t seq;
    if (i64_arg(arg, &seq) < 0) return NULL;
    return PyLong_FromSsize_t(ready_slot(t, seq));
}

PyDoc_STRVAR(free_slots_doc, "free_slots($self, /)\n--\n\nThe free stack, bottom first (the last is dispatched next).");

static PyObject *m_free_slots(Scheduler *t, PyObject *unused) {
    PyObject *out = PyList_New(t->n_free);
    for (Py_ssize_t i = 0; out != NULL && i < t->n_free; i++) {
        PyObject *v = PyLong_FromSsize_t(t->free_stack[i]);
        if (v == NULL) Py_CLEAR(out); else PyList_SET_ITEM(out, i, v);
    }
    return out;
}

#define CHECK(cond, ...)                                      \
    if (!(cond)) {                                            \
        PyErr_Format(PyExc_AssertionError, __VA_ARGS__);      \
        goto fail;                                            \
    }

PyDoc_STRVAR(check_doc, "check($self, /)\n--\n\nAssert the invariants (native/_schedule.c): AssertionError naming the first broken one.");

static PyObject *m_check(Scheduler *t, PyObject *unused) {
    int64_t *load = PyMem_Calloc((size_t)t->n_workers + 1, sizeof(int64_t));
    uint8_t *seen = PyMem_Calloc((size_t)t->n_slots + 1, 1);
    if (load == NULL || seen == NULL) {
        PyMem_Free(load);
        PyMem_Free(seen);
        return PyErr_NoMemory();
    }
    CHECK(t->n_free >= 0 && t->n_free <= t->n_slots, "the free stack holds %zd slots of %zd", t->n_free, t->n_slots);
    for (Py_ssize_t i = 0; i < t->n_free; i++) {
        Py_ssize_t s = t->free_stack[i];
        CHECK(s >= 0 && s < t->n_slots && !seen[s], "slot %zd is listed free twice, or is no slot", s);
        CHECK(t->state[s] == SLOT_FREE, "slot %zd is listed free but is %s", s, STATE_NAMES[t->state[s]]);
        seen[s] = 1;
    }
    Py_ssize_t n_tasks = 0, prev = NIL;
    int64_t outstanding = 0, waiting = 0, ready = 0;
    for (Py_ssize_t s = t->head; s != NIL; prev = s, s = t->next[s]) {
        CHECK(n_tasks < t->n_slots && seen[s] != 2, "the task list runs in a circle");
        CHECK(t->prev[s] == prev, "the task list's links disagree at slot %zd", s);
        CHECK(t->state[s] == SLOT_IN_FLIGHT || t->state[s] == SLOT_WAITING || t->state[s] == SLOT_READY,
              "slot %zd has a task but is %s", s, STATE_NAMES[t->state[s]]);
        CHECK(t->index[s] != NULL, "slot %zd is in the task list without a task", s);
        seen[s] = 2;
        n_tasks++;
        if (t->state[s] == SLOT_READY) {
            CHECK(t->epoch[s] == t->table_epoch, "READY slot %zd holds a task of epoch %lld, not %lld", s,
                  (long long)t->epoch[s], (long long)t->table_epoch);
            ready++;
        } else {
            load[t->worker[s]]++;
            outstanding += t->epoch[s] == t->table_epoch;
            waiting += t->state[s] == SLOT_WAITING;
        }
    }
    CHECK(t->tail == prev && n_tasks == t->n_tasks, "the task list holds %zd tasks, its count says %zd", n_tasks,
          t->n_tasks);
    for (Py_ssize_t s = 0; s < t->n_slots; s++) {
        CHECK(seen[s] || t->state[s] == SLOT_LENT, "slot %zd is %s but neither free nor in the task list", s,
              STATE_NAMES[t->state[s]]);
        CHECK(seen[s] == 2 || t->index[s] == NULL, "slot %zd keeps a task it no longer has", s);
    }
    for (Py_ssize_t w = 0; w < t->n_workers; w++)
        CHECK(load[w] == t->load[w], "worker %zd has %lld tasks, its load says %lld", w, (long long)load[w],
              (long long)t->load[w]);
    CHECK(outstanding == t->outstanding, "%lld tasks of this epoch are out, outstanding says %lld",
          (long long)outstanding, (long long)t->outstanding);
    CHECK(waiting == t->waiting_count, "%lld slots wait, waiting_count says %lld", (long long)waiting,
          (long long)t->waiting_count);
    CHECK(ready == t->n_ready, "%lld slots are READY, n_ready says %lld", (long long)ready, (long long)t->n_ready);
    PyMem_Free(load);
    PyMem_Free(seen);
    Py_RETURN_NONE;
fail:
    PyMem_Free(load);
    PyMem_Free(seen);
    return NULL;
}

PyDoc_STRVAR(pick_doc, "pick($self, /)\n--\n\n"
"The worker for the next task, the round robin moved past it: the first active one from the\n"
"cursor (in order: as torch's loader sends them), or the first with fewer than its share of\n"
"`cap` tasks (out of order); -1 when none can take one.");

static PyObject *m_pick(Scheduler *t, PyObject *unused) { return PyLong_FromSsize_t(pick(t)); }

PyDoc_STRVAR(end_shard_doc, "end_shard($self, worker, /)\n--\n\n"
"Worker `worker`'s shard ended (an IterableDataset's StopIteration): it takes no more tasks this\n"
"epoch; when no worker is left, the epoch is `exhausted`. The one way `active` changes.");

static PyObject *m_end_shard(Scheduler *t, PyObject *arg) {
    Py_ssize_t w = PyLong_AsSsize_t(arg);
    if (w == -1 && PyErr_Occurred()) return NULL;
    if (w < 0 || w >= t->n_workers) {
        PyErr_Format(PyExc_IndexError, "worker %zd is not one of the %zd workers", w, t->n_workers);
        return NULL;
    }
    end_shard(t, w);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(next_task_doc, "next_task($self, sampler, /)\n--\n\n"
"(worker, seq, index) of the epoch's next task (pick, then next(sampler)), or None when there is\n"
"none now (the epoch has no more: `exhausted` is then set; or no worker has room). Nothing is\n"
"dispatched: the first batch's probe uses it.");

static PyObject *m_next_task(Scheduler *t, PyObject *sampler) {
    Py_ssize_t worker;
    PyObject *index;
    int got = next_index(t, sampler, &worker, &index);
    if (got < 0) return NULL;
    if (got == 0) Py_RETURN_NONE;
    PyObject *out = Py_BuildValue("(nLN)", worker, (long long)t->send_seq, index);
    if (out != NULL) t->send_seq++;
    return out;
}

PyDoc_STRVAR(attach_doc, "attach($self, ring, header_offsets, data_offsets, data_bytes, queue_offsets, queue_len, "
"task_sems, ready_sem, /)\n--\n\n"
"The ring `step` collects from and posts to: its mapping, the offsets of each slot's header\n"
"and data region and of each worker's task queue and task semaphore, and the ready\n"
"semaphore's. Its queues are empty: every tail starts at 0.");

/* The ints of a tuple of `n` offsets, in a new array (*out), or -1 with an exception. */
static int offsets(PyObject *tuple, Py_ssize_t n, Py_ssize_t **out, const char *what) {
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != n) {
        PyErr_Format(PyExc_ValueError, "attach: %s must be a tuple of %zd offsets", what, n);
        return -1;
    }
    Py_ssize_t *a = PyMem_New(Py_ssize_t, n > 0 ? n : 1);
    if (a == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        a[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(tuple, i));
        if (a[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(a);
            return -1;
        }
    }
    *out = a;
    return 0;
}

static PyObject *m_attach(Scheduler *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_are("attach", nargs, 8) < 0) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0) return NULL;
    Py_ssize_t len = view.len;
    PyBuffer_Release(&view);
    Py_ssize_t data_bytes = PyLong_AsSsize_t(args[3]), queue_len = PyLong_AsSsize_t(args[5]),
               ready_sem = PyLong_AsSsize_t(args[7]);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t *header_off = NULL, *data_off = NULL, *queue_off = NULL, *task_sem = NULL;
    if (offsets(args[1], t->n_slots, &header_off, "header_offsets") < 0 ||
        offsets(args[2], t->n_slots, &data_off, "data_offsets") < 0 ||
        offsets(args[4], t->n_workers, &queue_off, "queue_offsets") < 0 ||
        offsets(args[6], t->n_workers, &task_sem, "task_sems") < 0)
        goto fail;
    /* Every offset the step uses, checked once: inside the mapping, aligned. Nothing changes
       unless all of them are. */
    int ok = data_bytes >= 0 && queue_len > 0 && queue_len <= len / 8 && ready_sem >= 0 && ready_sem % 8 == 0 &&
             ready_sem <= len - (Py_ssize_t)sizeof(sem_t);
    for (Py_ssize_t s = 0; ok && s < t->n_slots; s++)
        ok = header_off[s] >= 0 && header_off[s] % 8 == 0 && header_off[s] <= len - N_HEADER_FIELDS * 8 &&
             data_off[s] >= 0 && data_off[s] <= len - data_bytes;
    for (Py_ssize_t w = 0; ok && w < t->n_workers; w++)
        ok = queue_off[w] >= 0 && queue_off[w] % 8 == 0 && queue_off[w] <= len - queue_len * 8 &&
             task_sem[w] >= 0 && task_sem[w] % 8 == 0 && task_sem[w] <= len - (Py_ssize_t)sizeof(sem_t);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "attach: an offset lies outside the ring or is misaligned");
        goto fail;
    }
    PyMem_Free(t->header_off);
    PyMem_Free(t->data_off);
    PyMem_Free(t->queue_off);
    PyMem_Free(t->task_sem);
    t->header_off = header_off;
    t->data_off = data_off;
    t->queue_off = queue_off;
    t->task_sem = task_sem;
    t->data_bytes = data_bytes;
    t->queue_len = queue_len;
    t->ready_sem = ready_sem;
    Py_INCREF(args[0]);
    Py_XSETREF(t->ring, args[0]);
    memset(t->tails, 0, (size_t)t->n_workers * sizeof(int64_t));
    Py_RETURN_NONE;
fail:
    PyMem_Free(header_off);
    PyMem_Free(data_off);
    PyMem_Free(queue_off);
    PyMem_Free(task_sem);
    return NULL;
}

/* The attached ring's mapping (writable), or -1 with RuntimeError before attach. */
static int attached(Scheduler *t, Py_buffer *view, const char *what) {
    if (t->ring == NULL) {
        PyErr_Format(PyExc_RuntimeError, "%s: the scheduler is attached to no ring", what);
        return -1;
    }
    return PyObject_GetBuffer(t->ring, view, PyBUF_WRITABLE);
}

/* The ring's view released; None, or OSError from `error` when a semaphore call failed. */
static PyObject *released(Py_buffer *view, int failed, int error) {
    PyBuffer_Release(view);
    if (!failed) Py_RETURN_NONE;
    errno = error;
    return PyErr_SetFromErrno(PyExc_OSError);
}

PyDoc_STRVAR(push_doc, "push($self, worker, entry, /)\n--\n\n"
"Queue `entry` (a slot, or STOP_TASK, RESIZE_TASK) for `worker` on the attached ring and wake it\n"
"(its task semaphore).");

static PyObject *m_push(Scheduler *t, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t w;
    if (nargs_are("push", nargs, 2) < 0 || worker_arg(t, args[0], &w) < 0) return NULL;
    long long entry = PyLong_AsLongLong(args[1]);
    if (entry == -1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (attached(t, &view, "push") < 0) return NULL;
    int64_t *queue = (int64_t *)((char *)view.buf + t->queue_off[w]);
    queue[t->tails[w] % t->queue_len] = entry; /* (the post below orders it before the worker's read) */
    int failed = sem_post((sem_t *)((char *)view.buf + t->task_sem[w])), error = errno;
    if (!failed) t->tails[w]++; /* (not queued unless posted: the entry is rewritten by the next push) */
    return released(&view, failed, error);
}

PyDoc_STRVAR(post_index_doc, "post_index($self, slot, index, pickled, /)\n--\n\n"
"Post IN_FLIGHT `slot`'s task with `index` for its index (a list of ints, or with `pickled` the\n"
"pickled index's bytes): written into the slot, queued, its worker woken, as `step` posts.\n"
"Returns 1 (posted), 0 (it does not fit the slot: nothing written or queued) or -1 (not a list\n"
"of int64 ints: pickle it).");

static PyObject *m_post_index(Scheduler *t, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot;
    if (nargs_are("post_index", nargs, 3) < 0) return NULL;
    int pickled = PyObject_IsTrue(args[2]); /* (first: it may run Python code, which must not find the slot checked) */
    if (pickled < 0 || slot_arg(t, args[0], &slot) < 0 || expect(t, slot, BIT(SLOT_IN_FLIGHT)) < 0) return NULL;
    Py_buffer view;
    if (attached(t, &view, "post_index") < 0) return NULL;
    int code = post_as(t, &view, slot, args[1], pickled);
    PyBuffer_Release(&view);
    if (code == -2) return NULL;
    return PyLong_FromLong(code);
}

PyDoc_STRVAR(renew_queue_doc, "renew_queue($self, worker, /)\n--\n\n"
"An empty queue and a fresh task semaphore for `worker` on the attached ring: its process died,\n"
"maybe inside a wait, and its replacement starts from nothing queued.");

static PyObject *m_renew_queue(Scheduler *t, PyObject *arg) {
    Py_ssize_t w;
    if (worker_arg(t, arg, &w) < 0) return NULL;
    Py_buffer view;
    if (attached(t, &view, "renew_queue") < 0) return NULL;
    int failed = sem_init((sem_t *)((char *)view.buf + t->task_sem[w]), 1, 0), error = errno;
    memset((char *)view.buf + t->queue_off[w], 0, (size_t)t->queue_len * 8);
    t->tails[w] = 0;
    return released(&view, failed, error);
}

PyDoc_STRVAR(set_idle_doc, "set_idle($self, slot, /)\n--\n\n"
"Store STATE_IDLE into `slot`'s header (a release store) before its worker is answered or its\n"
"task is sent another way: the worker's next publication of the slot is then the one read.");

static PyObject *m_set_idle(Scheduler *t, PyObject *arg) {
    Py_ssize_t slot;
    if (slot_arg(t, arg, &slot) < 0) return NULL;
    Py_buffer view;
    if (attached(t, &view, "set_idle") < 0) return NULL;
    int64_t *state = (int64_t *)((char *)view.buf + t->header_off[slot]) + F_STATE;
    __atomic_store_n(state, (int64_t)STATE_IDLE, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(take_unposted_doc, "take_unposted($self, /)\n--\n\n"
"The slots `step` dispatched without posting (their index is no list of int64 ints, or does not\n"
"fit the slot), in dispatch order; the list is then empty.");

static PyObject *m_take_unposted(Scheduler *t, PyObject *unused) {
    PyObject *out = t->unposted, *fresh = PyList_New(0);
    if (fresh == NULL) return NULL;
    t->unposted = fresh;
    return out;
}

static PyObject *m_resize(Scheduler *t, PyObject *arg);
PyDoc_STRVAR(resize_doc, "resize($self, num_slots, /)\n--\n\n"
"The table of a new ring (a grown one, or the first after the probe): `num_slots` slots, every\n"
"one FREE; the epoch, the dispatch cursor, the sequence numbers and the banked tokens stay.\n"
"Only without tasks (the old ring drained); slots still LENT stay the old ring's. Detaches\n"
"the ring: attach the new one.");

PyDoc_STRVAR(reclaim_doc, "reclaim($self, bases, /)\n--\n\n"
"What `step` does first, alone: slots whose base in `bases` (the lease table: slot -> array)\n"
"nothing else references leave it and go LENT -> FREE.");

static PyObject *m_reclaim(Scheduler *t, PyObject *bases) {
    if (!PyDict_CheckExact(bases)) {
        PyErr_SetString(PyExc_TypeError, "reclaim() takes the lease dict");
        return NULL;
    }
    if (reclaim(t, bases) < 0) return NULL;
    Py_RETURN_NONE;
}

/* --------------------------------------------------- named operations
   The only writes to the scheduler's cursors from outside it: each says what happened. */
PyDoc_STRVAR(bank_token_doc, "bank_token($self, /)\n--\n\n"
"A ready-semaphore token taken outside the step (a wait that ran out, a yield, a torn slot\n"
"left for its next publication): banked, so the next step looks for DONE slots once more.");

static PyObject *m_bank_token(Scheduler *t, PyObject *unused) {
    t->banked++;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(awaited_doc, "awaited($self, /)\n--\n\n"
"(slot, seq) of the one batch whose publication must wake a consumer that sleeps now, or None:\n"
"any result may (then any wakes it). In order, the next result to take, when its task is in\n"
"flight and no other may need the consumer first: no slot waits for overflow memory and no past\n"
"epoch's task is out (its slot may be the one the next task needs). A result that asks for\n"
"something (memory, its pipe) wakes the consumer whatever it named (see wanted).");

static PyObject *m_awaited(Scheduler *t, PyObject *unused) {
    if (t->in_order && !t->waiting_count && !PyList_GET_SIZE(t->unposted) && t->n_tasks == t->outstanding + t->n_ready)
        for (Py_ssize_t s = t->head; s != NIL; s = t->next[s])
            if (t->seq[s] == t->rcvd_seq) {
                if (t->state[s] != SLOT_IN_FLIGHT) break;
                return Py_BuildValue("(nL)", s, (long long)t->seq[s]);
            }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(wanted_doc, "wanted($self, slot, /)\n--\n\n"
"The last look of a consumer about to sleep for `slot`'s batch, its name stored and fenced (the\n"
"ring's await_result): whether a slot in flight is published that the consumer must step for:\n"
"`slot` itself, or one whose result asks for something (overflow memory, its worker's pipe). A\n"
"publication after this look sees the name, and wakes the consumer if it is one of those.");

static PyObject *m_wanted(Scheduler *t, PyObject *arg) {
    Py_ssize_t slot;
    if (slot_arg(t, arg, &slot) < 0) return NULL;
    if (t->ring == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "wanted: no ring is attached");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(t->ring, &view, PyBUF_SIMPLE) < 0) return NULL;
    int found = 0;
    for (Py_ssize_t s = t->head; s != NIL && !found; s = t->next[s]) {
        Py_ssize_t h = t->header_off[s];
        if (t->state[s] != SLOT_IN_FLIGHT ||
            __atomic_load_n((const int64_t *)((const char *)view.buf + h), __ATOMIC_ACQUIRE) != STATE_DONE)
            continue;
        found = s == slot || field(&view, h, F_STATUS) == STATUS_NEED_MEMORY || field(&view, h, F_REGION) == REGION_PIPE;
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(found);
}

PyDoc_STRVAR(skip_result_doc, "skip_result($self, seq, /)\n--\n\n"
"Result `seq` was taken outside the step (the first batch's probe, which ended its shard or\n"
"failed): results go on with seq + 1.");

static PyObject *m_skip_result(Scheduler *t, PyObject *arg) {
    long long seq = PyLong_AsLongLong(arg);
    if (seq == -1 && PyErr_Occurred()) return NULL;
    if (seq < t->rcvd_seq) {
        PyErr_Format(PyExc_ValueError, "skip_result(%lld): results are already past it (%lld)", seq,
                     (long long)t->rcvd_seq);
        return NULL;
    }
    t->rcvd_seq = seq + 1;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_own_doc, "set_own($self, own, /)\n--\n\n"
"Whether tasks posted from now on go into memory of their own, not their slot (the user holds\n"
"the ring), or into slots again.");

static PyObject *m_set_own(Scheduler *t, PyObject *arg) {
    int own = PyObject_IsTrue(arg);
    if (own < 0) return NULL;
    t->own = own;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_cap_doc, "set_cap($self, cap, /)\n--\n\n"
"The loader's depth changed (shmloader/main/depth.py): up to `cap` tasks may exist at once from\n"
"now on. Tasks beyond a lower cap are not cut short: fewer are dispatched until they are done.");

static PyObject *m_set_cap(Scheduler *t, PyObject *arg) {
    Py_ssize_t cap = PyLong_AsSsize_t(arg);
    if (cap == -1 && PyErr_Occurred()) return NULL;
    if (cap < 1) {
        PyErr_Format(PyExc_ValueError, "set_cap(%zd): at least one task must be allowed", cap);
        return NULL;
    }
    t->cap = cap;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(start_round_robin_at_doc, "start_round_robin_at($self, worker, /)\n--\n\n"
"The round robin's next worker (a resumed epoch goes on after the last worker that delivered).");

static PyObject *m_start_round_robin_at(Scheduler *t, PyObject *arg) {
    Py_ssize_t w;
    if (worker_arg(t, arg, &w) < 0) return NULL;
    t->rr = w;
    Py_RETURN_NONE;
}

static PyMethodDef scheduler_methods[] = {
    {"bank_token", (PyCFunction)m_bank_token, METH_NOARGS, bank_token_doc},
    {"awaited", (PyCFunction)m_awaited, METH_NOARGS, awaited_doc},
    {"wanted", (PyCFunction)m_wanted, METH_O, wanted_doc},
    {"skip_result", (PyCFunction)m_skip_result, METH_O, skip_result_doc},
    {"set_own", (PyCFunction)m_set_own, METH_O, set_own_doc},
    {"set_cap", (PyCFunction)m_set_cap, METH_O, set_cap_doc},
    {"start_round_robin_at", (PyCFunction)m_start_round_robin_at, METH_O, start_round_robin_at_doc},
    {"step", (PyCFunction)(void (*)(void))step, METH_FASTCALL, step_doc},
    {"reclaim", (PyCFunction)m_reclaim, METH_O, reclaim_doc},
    {"dispatch", (PyCFunction)(void (*)(void))m_dispatch, METH_FASTCALL, dispatch_doc},
    {"redispatch", (PyCFunction)(void (*)(void))m_redispatch, METH_FASTCALL, redispatch_doc},
    {"done", (PyCFunction)m_done, METH_O, done_doc},
    {"overflowed", (PyCFunction)(void (*)(void))m_overflowed, METH_FASTCALL, overflowed_doc},
    {"drop", (PyCFunction)m_drop, METH_O, drop_doc},
    {"granted", (PyCFunction)m_granted, METH_O, granted_doc},
    {"take", (PyCFunction)m_take, METH_O, take_doc},
    {"give_back", (PyCFunction)m_give_back, METH_O, give_back_doc},
    {"orphans", (PyCFunction)m_orphans, METH_O, orphans_doc},
    {"new_epoch", (PyCFunction)m_new_epoch, METH_NOARGS, new_epoch_doc},
    {"state_of", (PyCFunction)m_state_of, METH_O, state_of_doc},
    {"count", (PyCFunction)m_count, METH_O, count_doc},
    {"task", (PyCFunction)m_task, METH_O, task_doc},
    {"tasks", (PyCFunction)m_tasks, METH_NOARGS, tasks_doc},
    {"waiting", (PyCFunction)m_waiting, METH_NOARGS, waiting_doc},
    {"of_worker", (PyCFunction)m_of_worker, METH_O, of_worker_doc},
    {"ready", (PyCFunction)m_ready, METH_NOARGS, ready_doc},
    {"ready_slot", (PyCFunction)m_ready_slot, METH_O, ready_slot_doc},
    {"free_slots", (PyCFunction)m_free_slots, METH_NOARGS, free_slots_doc},
    {"check", (PyCFunction)m_check, METH_NOARGS, check_doc},
    {"pick", (PyCFunction)m_pick, METH_NOARGS, pick_doc},
    {"end_shard", (PyCFunction)m_end_shard, METH_O, end_shard_doc},
    {"next_task", (PyCFunction)m_next_task, METH_O, next_task_doc},
    {"attach", (PyCFunction)(void (*)(void))m_attach, METH_FASTCALL, attach_doc},
    {"take_unposted", (PyCFunction)m_take_unposted, METH_NOARGS, take_unposted_doc},
    {"push", (PyCFunction)(void (*)(void))m_push, METH_FASTCALL, push_doc},
    {"post_index", (PyCFunction)(void (*)(void))m_post_index, METH_FASTCALL, post_index_doc},
    {"renew_queue", (PyCFunction)m_renew_queue, METH_O, renew_queue_doc},
    {"set_idle", (PyCFunction)m_set_idle, METH_O, set_idle_doc},
    {"resize", (PyCFunction)m_resize, METH_O, resize_doc},
    {NULL, NULL, 0, NULL},
};

/* ----------------------------------------------------------- attributes */
#define GET_I64(name, expr)                                                              \
    static PyObject *get_##name(Scheduler *t, void *c) { return PyLong_FromLongLong((long long)(expr)); }

GET_I64(num_slots, t->n_slots)
GET_I64(num_workers, t->n_workers)
GET_I64(cap, t->cap)
GET_I64(epoch, t->table_epoch)
GET_I64(outstanding, t->outstanding)
GET_I64(waiting_count, t->waiting_count)
GET_I64(n_free, t->n_free)
GET_I64(n_ready, t->n_ready)
GET_I64(n_tasks, t->n_tasks)
GET_I64(event, t->event)
GET_I64(rr, t->rr)
GET_I64(send_seq, t->send_seq)
GET_I64(rcvd_seq, t->rcvd_seq)
GET_I64(banked, t->banked)

static PyObject *get_in_order(Scheduler *t, void *c) { return PyBool_FromLong(t->in_order); }
static PyObject *get_own(Scheduler *t, void *c) { return PyBool_FromLong(t->own); }

static PyObject *get_exhausted(Scheduler *t, void *c) { return PyBool_FromLong(t->exhausted); }
static PyObject *get_has_unposted(Scheduler *t, void *c) { return PyBool_FromLong(PyList_GET_SIZE(t->unposted) > 0); }


static PyObject *get_load(Scheduler *t, void *c) {
    PyObject *out = PyTuple_New(t->n_workers);
    for (Py_ssize_t w = 0; out != NULL && w < t->n_workers; w++) {
        PyObject *v = PyLong_FromLongLong((long long)t->load[w]);
        if (v == NULL) Py_CLEAR(out); else PyTuple_SET_ITEM(out, w, v);
    }
    return out;
}

static PyObject *get_tails(Scheduler *t, void *c) {
    PyObject *out = PyTuple_New(t->n_workers);
    for (Py_ssize_t w = 0; out != NULL && w < t->n_workers; w++) {
        PyObject *v = PyLong_FromLongLong((long long)t->tails[w]);
        if (v == NULL) Py_CLEAR(out); else PyTuple_SET_ITEM(out, w, v);
    }
    return out;
}

static PyObject *get_active(Scheduler *t, void *c) {
    PyObject *out = PyTuple_New(t->n_workers);
    for (Py_ssize_t w = 0; out != NULL && w < t->n_workers; w++) PyTuple_SET_ITEM(out, w, PyBool_FromLong(t->active[w]));
    return out;
}

static PyGetSetDef scheduler_getset[] = {
    {"num_slots", (getter)get_num_slots, NULL, "slots of the ring", NULL},
    {"num_workers", (getter)get_num_workers, NULL, "workers", NULL},
    {"cap", (getter)get_cap, NULL, "tasks that may exist at once (num_workers * the depth: torch's prefetch_factor, or the one that adapts)", NULL},
    {"in_order", (getter)get_in_order, NULL, "whether results are taken in sequence order", NULL},
    {"epoch", (getter)get_epoch, NULL, "the current epoch", NULL},
    {"outstanding", (getter)get_outstanding, NULL, "IN_FLIGHT and WAITING tasks of the current epoch", NULL},
    {"waiting_count", (getter)get_waiting_count, NULL, "WAITING slots", NULL},
    {"n_free", (getter)get_n_free, NULL, "FREE slots", NULL},
    {"n_ready", (getter)get_n_ready, NULL, "READY slots", NULL},
    {"n_tasks", (getter)get_n_tasks, NULL, "slots with a task (IN_FLIGHT, WAITING, READY)", NULL},
    {"load", (getter)get_load, NULL, "IN_FLIGHT and WAITING tasks per worker", NULL},
    {"tails", (getter)get_tails, NULL, "entries queued per worker on the attached ring (written here alone)", NULL},
    {"active", (getter)get_active, NULL, "workers that take tasks (an ended shard's do not): changed by end_shard", NULL},
    {"rr", (getter)get_rr, NULL, "the worker the round robin looks at next (start_round_robin_at)", NULL},
    {"send_seq", (getter)get_send_seq, NULL, "the sequence number of the next task", NULL},
    {"rcvd_seq", (getter)get_rcvd_seq, NULL, "the sequence number of the next result in order (skip_result)", NULL},
    {"banked", (getter)get_banked, NULL, "ready-semaphore tokens taken, not yet matched with a DONE slot (bank_token)",
     NULL},
    {"exhausted", (getter)get_exhausted, NULL,
     "the epoch has no more tasks: the sampler is exhausted, or every worker's shard ended", NULL},
    {"event", (getter)get_event, NULL, "the slot of the last step's event", NULL},
    {"has_unposted", (getter)get_has_unposted, NULL, "whether take_unposted has slots to give", NULL},
    {"own", (getter)get_own, NULL,
     "tasks posted from now on go into memory of their own, not their slot (the user holds the ring): set_own", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/* -------------------------------------------------------------- lifetime */
static void free_slots(Scheduler *t) {
    for (Py_ssize_t s = 0; t->index != NULL && s < t->n_slots; s++) Py_XDECREF(t->index[s]);
    PyMem_Free(t->state);
    PyMem_Free(t->worker);
    PyMem_Free(t->epoch);
    PyMem_Free(t->seq);
    PyMem_Free(t->needed);
    PyMem_Free(t->index);
    PyMem_Free(t->next);
    PyMem_Free(t->prev);
    PyMem_Free(t->free_stack);
    t->state = NULL;
    t->worker = t->next = t->prev = t->free_stack = NULL;
    t->epoch = t->seq = t->needed = NULL;
    t->index = NULL;
}

/* The per-slot arrays for `n_slots` slots, every one FREE: 0, or -1 with MemoryError. */
static int make_slots(Scheduler *t, Py_ssize_t n_slots) {
    free_slots(t);
    t->n_slots = n_slots;
    t->state = PyMem_Calloc((size_t)n_slots, 1);
    t->worker = PyMem_New(Py_ssize_t, n_slots);
    t->epoch = PyMem_Calloc((size_t)n_slots, sizeof(int64_t));
    t->seq = PyMem_Calloc((size_t)n_slots, sizeof(int64_t));
    t->needed = PyMem_Calloc((size_t)n_slots, sizeof(int64_t));
    t->index = PyMem_Calloc((size_t)n_slots, sizeof(PyObject *));
    t->next = PyMem_New(Py_ssize_t, n_slots);
    t->prev = PyMem_New(Py_ssize_t, n_slots);
    t->free_stack = PyMem_New(Py_ssize_t, n_slots);
    if (t->state == NULL || t->worker == NULL || t->epoch == NULL || t->seq == NULL || t->needed == NULL ||
        t->index == NULL || t->next == NULL || t->prev == NULL || t->free_stack == NULL) {
        free_slots(t);
        t->n_slots = 0;
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t s = 0; s < n_slots; s++) {
        t->worker[s] = t->next[s] = t->prev[s] = NIL;
        t->free_stack[s] = n_slots - 1 - s;  /* a stack: slot 0 is dispatched first */
    }
    t->n_free = n_slots;
    t->head = t->tail = NIL;
    t->n_tasks = t->n_ready = t->waiting_count = 0;
    return 0;
}

static PyObject *m_resize(Scheduler *t, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1 || n > (1 << 24)) {
        PyErr_Format(PyExc_ValueError, "resize: %zd slots", n);
        return NULL;
    }
    if (t->n_tasks) {
        PyErr_Format(PyExc_AssertionError, "resize: %zd slots still have tasks", t->n_tasks);
        return NULL;
    }
    if (make_slots(t, n) < 0) return NULL;
    Py_CLEAR(t->ring);
    Py_RETURN_NONE;
}

/* The Python objects it holds (tasks' indices, the ring's mapping, unposted slots) may make
   cycles through a user's sampler or dataset: the collector sees them. */
static int scheduler_traverse(Scheduler *t, visitproc visit, void *arg) {
    for (Py_ssize_t s = 0; t->index != NULL && s < t->n_slots; s++) Py_VISIT(t->index[s]);
    Py_VISIT(t->ring);
    Py_VISIT(t->unposted);
    return 0;
}

static int scheduler_clear(Scheduler *t) {
    for (Py_ssize_t s = 0; t->index != NULL && s < t->n_slots; s++) Py_CLEAR(t->index[s]);
    Py_CLEAR(t->ring);
    return 0; /* (unposted stays a list: it holds ints only) */
}

static void scheduler_dealloc(Scheduler *t) {
    PyObject_GC_UnTrack(t);
    free_slots(t);
    PyMem_Free(t->load);
    PyMem_Free(t->active);
    PyMem_Free(t->header_off);
    PyMem_Free(t->data_off);
    PyMem_Free(t->queue_off);
    PyMem_Free(t->task_sem);
    Py_XDECREF(t->ring);
    PyMem_Free(t->tails);
    Py_XDECREF(t->unposted);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* Made whole in tp_new (there is no tp_init): no instance exists without its table, so no
   method or attribute ever meets an uninitialised one. */
static int scheduler_fill_in(Scheduler *t, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"num_slots", "num_workers", "cap", "in_order", "epoch", NULL};
    Py_ssize_t n_slots, n_workers, cap = -1;
    int in_order = 1;
    long long epoch = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nn|n$pL:Scheduler", kwlist, &n_slots, &n_workers, &cap,
                                     &in_order, &epoch))
        return -1;
    if (n_slots < 1 || n_workers < 1 || n_slots > (1 << 24) || n_workers > (1 << 16)) {
        PyErr_Format(PyExc_ValueError, "Scheduler: %zd slots and %zd workers: each must be positive", n_slots, n_workers);
        return -1;
    }
    t->n_workers = n_workers;
    t->cap = cap < 0 ? n_slots : cap;
    t->in_order = in_order;
    t->table_epoch = epoch;
    t->load = PyMem_Calloc((size_t)n_workers, sizeof(int64_t));
    t->tails = PyMem_Calloc((size_t)n_workers, sizeof(int64_t));
    t->active = PyMem_Malloc((size_t)n_workers);
    t->unposted = PyList_New(0);
    if (t->load == NULL || t->tails == NULL || t->active == NULL || t->unposted == NULL) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    memset(t->active, 1, (size_t)n_workers);
    return make_slots(t, n_slots);
}

static PyObject *scheduler_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    Scheduler *t = (Scheduler *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    if (scheduler_fill_in(t, args, kwargs) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

PyDoc_STRVAR(scheduler_doc,
"Scheduler(num_slots, num_workers, cap=num_slots, *, in_order=True, epoch=0)\n--\n\n"
"Every slot's state and the epoch's tasks (the slot table), the dispatch cursor, and the\n"
"consumer's per-batch step over the ring it is attached to. See native/_schedule.c.");

static PyTypeObject SchedulerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmloader._native.Scheduler",
    .tp_basicsize = sizeof(Scheduler),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = scheduler_doc,
    .tp_new = scheduler_new,
    .tp_dealloc = (destructor)scheduler_dealloc,
    .tp_traverse = (traverseproc)scheduler_traverse,
    .tp_clear = (inquiry)scheduler_clear,
    .tp_methods = scheduler_methods,
    .tp_getset = scheduler_getset,
};

int shmloader_schedule_init(PyObject *module) {
    if (PyType_Ready(&SchedulerType) < 0) return -1;
    Py_INCREF(&SchedulerType);
    if (PyModule_AddObject(module, "Scheduler", (PyObject *)&SchedulerType) < 0) {
        Py_DECREF(&SchedulerType);
        return -1;
    }
    return PyModule_AddIntConstant(module, "NOT_READY", NOT_READY) < 0 ||
           PyModule_AddIntConstant(module, "EV_NEED_MEMORY", EV_NEED_MEMORY) < 0 ||
           PyModule_AddIntConstant(module, "EV_PIPE", EV_PIPE) < 0 ||
           PyModule_AddIntConstant(module, "EV_TORN", EV_TORN) < 0 ||
           PyModule_AddIntConstant(module, "EV_STALE", EV_STALE) < 0 ||
           PyModule_AddIntConstant(module, "EV_RESULT", EV_RESULT) < 0
               ? -1
               : 0;
}
