"""What a new user meets first: every command of the README's development table runs from a
fresh clone's tree (its check variant: ``--help``, ``--quick`` or ``make -n``), and no file of
the repository reaches outside it."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def tracked_files() -> list[str]:
    """The repository's files as a clone has them (tracked by git)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the clone's tree is unknown")
    done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [name for name in done.stdout.decode().split("\0") if name and (ROOT / name).is_file()]


def commands_table() -> list[tuple[str, str]]:
    """(command, its check) for each row of the README's development table."""
    rows = []
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[2].startswith("`"):
            rows.append((cells[0].strip("`"), cells[2].strip("`")))
    return rows


def test_the_readme_has_a_commands_table_with_a_check_per_command() -> None:
    rows = commands_table()
    assert len(rows) >= 8, rows
    for command, check in rows:
        words, checked = shlex.split(command), shlex.split(check)
        if words[0] == "make":  # a make target: its plan (make -n), not a build
            assert checked == ["make", "-n", *words[1:]], (command, check)
        else:  # the command itself, made quick: a help text, or a small run
            assert checked[: len(words)] == words, (command, check)
            assert {"--help", "--quick", "--batches"} & set(checked[len(words):]), check


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The tracked tree, copied, with this checkout's built extension beside it (a clone builds
    its own with ``make`` or ``pip install -e .``; the commands run from the tree, not the
    install)."""
    tree = tmp_path_factory.mktemp("clone")
    for name in tracked_files():
        target = tree / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    for built in (ROOT / "shmloader").glob("_native*.so"):
        shutil.copy2(built, tree / "shmloader" / built.name)
    return tree


@pytest.mark.slow
@pytest.mark.parametrize("command,check", commands_table(), ids=[c for c, _ in commands_table()])
def test_each_readme_command_runs_from_a_fresh_clone(clone: pathlib.Path, command: str, check: str) -> None:
    argv = shlex.split(check)
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "make" and shutil.which("make") is None:
        pytest.skip("make is not installed")
    env = {**os.environ, "PYTHONPATH": str(clone), "MPLBACKEND": "Agg"}
    done = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{check}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert done.stdout.strip(), check  # it said something: a help text, a table, make's plan


# A path that climbs out of the repository: ../ sequences, or the team's folders beside it.
_CLIMB = re.compile(r"(?:\.\./)+[\w.\-/]*")
_OUTSIDE = re.compile("|".join([r"\bshared/bench\b", "/" + "work/", r"\." + "library"]))  # (split: not found here)


def test_no_file_reaches_outside_the_repository() -> None:
    found = []
    for name in tracked_files():
        path = ROOT / name
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # (a binary file: an image)
        for match in _CLIMB.finditer(text):
            target = (path.parent / match.group()).resolve()
            if ROOT not in (target, *target.parents):
                found.append(f"{name}: {match.group()}")
        found += [f"{name}: {m.group()}" for m in _OUTSIDE.finditer(text)]
    assert found == [], found
