"""``python -m shmloader bench ...`` (also the ``shmloader`` console script)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "bench":
        print("usage: shmloader bench [options]   (shmloader bench --help for the options)", file=sys.stderr)
        return 2
    from shmloader._bench import main as bench

    return bench(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
