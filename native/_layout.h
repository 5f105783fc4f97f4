/*
 * The slot layout as the C side reads and writes it: header field indices, a slot's
 * publication states, result statuses and regions, and the consumer's slot states. One
 * definition for every native/ file. shmloader/wire/layout.py describes the same layout for
 * Python and checks, at import, that it agrees with this one (the module constant LAYOUT:
 * every name below with its value), so a stale build cannot read other fields.
 */
#ifndef SHMLOADER_LAYOUT_H
#define SHMLOADER_LAYOUT_H

/* Header fields (int64 each): shmloader/wire/layout.py's Field. */
#define F_STATE 0
#define F_EPOCH 1
#define F_SEQ 2
#define F_TASK_LEN 3
#define F_STATUS 4
#define F_WORKER 5
#define F_TABLE_OFF 6
#define F_TABLE_LEN 7
#define F_PICKLED_OFF 8
#define F_PICKLED_LEN 9
#define F_NEEDED 10
#define F_R_EPOCH 11
#define F_R_SEQ 12
#define F_DATASET_STATE_OFF 13
#define F_DATASET_STATE_LEN 14
#define F_REGION 15
#define F_OWN 16 /* task: 1 when the batch goes into memory of its own (the consumer holds the ring) */
#define N_HEADER_FIELDS 17

/* STATE: a task pending (the consumer posted it) or a result complete (the worker published it). */
#define STATE_IDLE 0
#define STATE_DONE 1

/* STATUS of a result: shmloader/wire/layout.py's Status. */
#define STATUS_OK 0
#define STATUS_NEED_MEMORY 3

/* REGION of a result: shmloader/wire/layout.py's Region. */
#define REGION_SLOT 0
#define REGION_OVERFLOW 1
#define REGION_PIPE 2
#define REGION_LEAVES 3 /* leaves in the overflow memory; skeleton, leaf table, state in the slot */

/* The awaited word (shmloader/wire/layout.py, RingGeometry.awaited_word): which result a sleeping
   synchronous consumer waits for. AWAIT_NONE: it does not sleep; AWAIT_ANY: any result wakes
   it; otherwise the result's seq + 1 (a fresh segment's zeros read as AWAIT_NONE). */
#define AWAIT_NONE 0
#define AWAIT_ANY (-1)

/* A slot as the consumer sees it: shmloader/main/scheduler.py's SlotState. */
enum { SLOT_FREE, SLOT_IN_FLIGHT, SLOT_WAITING, SLOT_READY, SLOT_LENT, N_SLOT_STATES };

/* Every name above with its value, for the module constant LAYOUT. */
#define SHMLOADER_LAYOUT_NAMES(X)                                                                                   \
    X(F_STATE) X(F_EPOCH) X(F_SEQ) X(F_TASK_LEN) X(F_STATUS) X(F_WORKER) X(F_TABLE_OFF) X(F_TABLE_LEN)              \
    X(F_PICKLED_OFF) X(F_PICKLED_LEN) X(F_NEEDED) X(F_R_EPOCH) X(F_R_SEQ) X(F_DATASET_STATE_OFF)                   \
    X(F_DATASET_STATE_LEN) X(F_REGION) X(F_OWN) X(N_HEADER_FIELDS) X(STATE_IDLE) X(STATE_DONE) X(STATUS_OK)                  \
    X(STATUS_NEED_MEMORY) X(REGION_SLOT) X(REGION_OVERFLOW) X(REGION_PIPE) X(REGION_LEAVES) X(SLOT_FREE) X(SLOT_IN_FLIGHT)           \
    X(SLOT_WAITING) X(SLOT_READY) X(SLOT_LENT) X(AWAIT_NONE) X(AWAIT_ANY)

#endif
