"""The training process: everything that runs where ``next(iterator)`` is called.

``iterator`` (torch's iterator protocol over the ring), ``lifecycle`` (start, growth,
recovery, shutdown), ``pool`` (worker processes), ``scheduler`` (every slot's state, the
per-batch step), ``dispatch``, ``delivery`` and ``lease`` (a taken slot to the user's batch and
back), ``overflow`` and ``budget`` (memory), ``wait`` (sync and async waits), ``device`` (CUDA).
It starts workers from ``shmloader.worker`` and reads the ring through ``shmloader.wire``.
"""
