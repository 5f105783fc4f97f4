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


def reinstall_command() -> str:
    """The command that reinstalls this shmloader, as it was installed, and nothing else."""
    pip = f"{shlex.quote(sys.executable)} -m pip install --no-deps --force-reinstall"
    tree = os.path.dirname(PACKAGE_DIR)
    if os.path.isfile(os.path.join(tree, "setup.py")) and os.path.isdir(os.path.join(tree, "native")):
        return f"{pip} -e {shlex.quote(tree)}"  # a source tree (a clone, editable or on the path): built in place
    try:
        direct = json.loads(metadata.distribution("shmloader").read_text("direct_url.json") or "null")
    except (metadata.PackageNotFoundError, ValueError):
        direct = None
    url = str((direct or {}).get("url", ""))
    if url.startswith("file://"):  # a wheel file, or a directory installed without -e
        return f"{pip} {shlex.quote(unquote(url.removeprefix('file://')))}"
    return f"{pip} shmloader"  # the package index
