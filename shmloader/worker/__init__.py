"""A worker process: everything that runs in a DataLoader worker.

``loop`` (the entry points: setup pipe, task queue, publication, overflow and resize),
``produce`` (torch's worker setup; an index to samples to a batch) and ``collate`` (collate into
a slot; the native stacking through ``shmloader._accel``). Imports nothing of ``shmloader.main``:
``tests/unit/test_package_layout.py`` holds that.
"""
