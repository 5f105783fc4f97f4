"""``python -m shmloader bench ...`` and ``python -m shmloader info`` (also the ``shmloader``
console script)."""

from __future__ import annotations

import sys

USAGE = """usage: shmloader info                 versions, whether the fast path is on, shared memory
       shmloader bench [options]      shmloader against torch's DataLoader (--help for the options)"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["info", "--help"], ["info", "-h"]):
        print(USAGE)
        return 0
    if argv == ["info"]:
        from shmloader._info import main as info

        return info()
    if not argv or argv[0] != "bench":
        print(USAGE, file=sys.stderr)
        return 2
    from shmloader._bench import main as bench

    return bench(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
