"""A ring's segment has no name once it exists: only its fd reaches the workers, so a kill at
any moment (during start-up, or while the ring grows and workers re-attach) cannot leave it
in /dev/shm."""

from __future__ import annotations

import os

from shmloader._layout import RingGeometry
from shmloader._ring import AttachedRing, Ring


def test_the_segment_has_no_name_and_attaches_through_its_fd() -> None:
    ring = Ring(RingGeometry(num_workers=2, num_slots=5, data_bytes=4096))
    try:
        assert ring.segment.lstrip("/") not in os.listdir("/dev/shm")
        worker = AttachedRing.by_fd(ring.geometry, os.dup(ring.fd), 1)
        ring.headers[3][2] = 12345  # the same memory, seen from the worker's mapping
        assert worker.headers[3][2] == 12345
        ring.push_task(1, 3)
        assert worker.next_task(0.0) == 3
    finally:
        ring.close()
