"""The setup pipe's messages: what the main process and a worker say to each other outside the
ring (multiprocessing connections, pickled). Each is a small named tuple; a message that hands
over a descriptor is followed on the connection by that descriptor.

Start, in this order: ``Probe`` (main) -> ``Probed`` (worker), any number of times; then
``NewRing`` and the segment's fd (main) -> ``Attached`` (worker). Served: ``Memory`` (and its
fd when ``size > 0``) answers a slot published NEED_MEMORY; ``Index`` carries an index too large
for its slot; ``Grown`` and the new segment's fd follow a ``RESIZE_TASK`` -> ``Attached``;
``Stop`` at any time. (shmloader/README.md: the protocols.)
"""

from __future__ import annotations

from typing import Any, NamedTuple

from shmloader.wire.layout import RingGeometry


class Probe(NamedTuple):
    """Make batch ``seq`` of ``epoch`` privately and keep it (only the latest probe's)."""

    epoch: int
    seq: int
    index: Any


class Probed(NamedTuple):
    """A probe's outcome: its status (``layout.Status``), the bytes the batch needs, its error."""

    status: int
    needed: int
    error: Any


class NewRing(NamedTuple):
    """The ring (its segment's fd follows): attach, then write the kept probe's batch into slot
    ``pending`` (-1: none)."""

    geometry: RingGeometry
    pending: int


class Grown(NamedTuple):
    """The grown ring (its segment's fd follows), after the worker took RESIZE_TASK."""

    geometry: RingGeometry


class Attached(NamedTuple):
    """The worker mapped the ring it was sent."""


class Memory(NamedTuple):
    """Overflow memory for ``slot``: ``size`` bytes (its memfd follows); 0: drop the batch; -1:
    send it pickled over the connection instead."""

    slot: int
    size: int


class Index(NamedTuple):
    """``slot``'s task's pickled index, too large for the slot."""

    slot: int
    payload: bytes


class Stop(NamedTuple):
    """Exit."""
