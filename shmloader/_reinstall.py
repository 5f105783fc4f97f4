"""The command that reinstalls this shmloader, and nothing else: what every piece of advice
the package prints ends with (a stale build, an unknown torch), for a user of a clone (editable
or not), of a wheel file, or of the package index alike."""

from __future__ import annotations

import json
import os
import shlex
import sys
from importlib import metadata
from urllib.parse import unquote

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def installed_from() -> tuple[str, str, str]:
    """How this shmloader was installed, where from, and at which commit: ("tree", its
    directory, "") for a source tree (a clone, editable or on the path); ("file", a path, "") for
    a wheel file or a directory installed without -e; ("url", a pip requirement, a commit or "")
    for a VCS or a remote archive; ("index", "shmloader", "") for the package index."""
    tree = os.path.dirname(PACKAGE_DIR)
    if os.path.isfile(os.path.join(tree, "setup.py")) and os.path.isdir(os.path.join(tree, "native")):
        return "tree", tree, ""
    try:
        direct = json.loads(metadata.distribution("shmloader").read_text("direct_url.json") or "null")
    except (metadata.PackageNotFoundError, ValueError):
        direct = None
    direct = direct if isinstance(direct, dict) else {}
    url, vcs = str(direct.get("url", "")), direct.get("vcs_info")
    if url.startswith("file://"):
        return "file", unquote(url.removeprefix("file://")), ""
    if url and isinstance(vcs, dict):
        return "url", f"{vcs.get('vcs', 'git')}+{url}", str(vcs.get("commit_id", ""))
    return ("url", url, "") if url else ("index", "shmloader", "")


def _pip(args: str) -> str:
    return f"{shlex.quote(sys.executable)} -m pip install --no-deps {args}"


def reinstall_command() -> str:
    """The command that reinstalls this shmloader, as it was installed, and nothing else."""
    how, where, commit = installed_from()
    pinned = where + ("@" + commit if commit else "")
    return _pip(f"--force-reinstall {'-e ' if how == 'tree' else ''}{shlex.quote(pinned)}")


def upgrade_command() -> str:
    """The command that puts a newer shmloader in its place, and nothing else: a source tree is
    brought up to date and built again, a VCS install follows its branch, a wheel file or an
    index install takes the index's newest."""
    how, where, _ = installed_from()
    if how == "tree":
        return f"git -C {shlex.quote(where)} pull && {reinstall_command()}"
    return _pip(f"--upgrade {shlex.quote(where) if how == 'url' else 'shmloader'}")
