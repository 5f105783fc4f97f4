"""The shared format: what both processes read and write in the ring's segment.

``layout`` (header fields, states, codes, geometry; checked against native/_layout.h),
``shm`` (POSIX shared memory: create, unlink, free space, mappings) and ``ring`` (the segment's
views: slot headers, task queues, process-shared semaphores, release/acquire slot state; the
main process's ``Ring``, a worker's ``AttachedRing``). The leaf-table codec is native
(``shmloader._native``). Imports nothing of ``shmloader.main`` or ``shmloader.worker``.
"""
