"""The package by process: ``shmloader/wire`` (the shared format) imports nothing of
``shmloader/main`` (the training process) or ``shmloader/worker`` (a worker); the worker imports
nothing of the training process; no module of the package imports itself back through others.
Read from the source (every import statement, those inside functions included), and by
importing the worker's entry point in a fresh interpreter.

And the seams with torch: its DataLoader's private attributes are read (or replaced) only in
``shmloader/_torch_private.py``; elsewhere only as ``self``'s own, in the classes that inherit
them. No parameter named for an iterator or a loader is typed ``Any`` in the modules that reach
ours (the checkpoint, the lifecycle): they go through typed interfaces."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import torch.utils.data.dataloader

import shmloader

PACKAGE = pathlib.Path(shmloader.__file__).parent


def module_of(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """module -> the package's modules it names in an import (packages' own files included)."""
    modules = {module_of(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):  # (imports only a type checker runs are none)
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                node.body = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package up
                    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
                    package = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{package}.{base}" if base else package
                for alias in node.names:
                    found |= {m for m in (f"{base}.{alias.name}", base) if m in modules}
                    if base == "shmloader" and alias.name in LAZY:  # a public name: its module, on first use
                        found.add(f"shmloader.{LAZY[alias.name]}")
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names if alias.name in modules}
        graph[name] = found - {name}
    return graph


LAZY: dict[str, str] = shmloader._LAZY  # public name -> the module __getattr__ imports it from


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others (packages' __init__ included)."""
    seen, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_shared_format_and_the_worker_import_nothing_of_the_training_process() -> None:
    # Through any chain: a top-level module the worker imports may not import main/ either.
    graph = imports()
    for name in graph:
        found = reachable(graph, name)
        if name.startswith("shmloader.wire"):
            assert not {t for t in found if t.startswith(("shmloader.main", "shmloader.worker"))}, name
        if name.startswith("shmloader.worker"):
            assert not {t for t in found if t.startswith("shmloader.main")}, name


def test_no_import_circle() -> None:
    graph = {name: targets - {"shmloader"} for name, targets in imports().items()}  # (every module enters
    # through the package's __init__: that edge is no circle)
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph.get(name, ())):
            assert state.get(target) != 1, " -> ".join([*path, name, target])
            if target not in state:
                visit(target, [*path, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_a_worker_process_loads_nothing_of_the_training_process() -> None:
    code = ("import sys\nimport shmloader.worker.loop\n"
            "print(sorted(m for m in sys.modules if m.startswith('shmloader.main')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_public_names_are_the_packages() -> None:
    for name in shmloader.__all__:
        assert getattr(shmloader, name) is not None, name


def torch_private_names() -> set[str]:
    """Every private attribute and method torch's DataLoader and its iterators have (read from
    torch's ``dataloader.py``: what its classes set on ``self`` and the methods they define)."""
    tree = ast.parse(pathlib.Path(torch.utils.data.dataloader.__file__).read_text())
    names = set()
    for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
            elif isinstance(node, ast.FunctionDef):
                names.add(node.name)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


# (module, name): another library's attribute of the same name, not torch's
NOT_TORCHS = {("shmloader/_bench/loaders.py", "_shutdown")}  # torchdata.nodes' iterators'


def test_torchs_private_attributes_are_read_in_one_adapter_module() -> None:
    private = torch_private_names()
    assert {"_index_sampler", "_dataset_kind", "_iterator", "_num_yielded", "_shutdown_workers"} <= private
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE.parent).as_posix()
        if where == "shmloader/_torch_private.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            named, owner = None, None
            if isinstance(node, ast.Attribute):
                named, owner = node.attr, node.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant)):
                named, owner = node.args[1].value, node.args[0]
            own = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
            inherited = isinstance(owner, ast.Call) and ast.unparse(owner) == "super()"
            if named in private and not own and not inherited and (where, named) not in NOT_TORCHS:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_the_seams_to_the_iterator_are_typed() -> None:
    for module in ("_checkpoint.py", "main/lifecycle.py", "main/scope.py", "main/resume.py"):
        tree = ast.parse((PACKAGE / module).read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args:
                    if arg.arg in ("it", "iterator", "dying", "life") and arg.annotation is not None:
                        assert ast.unparse(arg.annotation) != "Any", f"{module}: {node.name}({arg.arg}: Any)"
        for node in ast.walk(tree):  # (a set of iterators typed Any let the lifecycle call into them)
            if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("WeakSet"):
                assert ast.unparse(node.slice) != "Any", module


def test_a_function_of_more_than_five_parameters_says_why() -> None:
    # (the benchmark command's loader makers take the benchmark's settings: not the package's code)
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "_bench" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
                count = len(names) - (1 if names and names[0] in ("self", "cls") else 0)
                if count > 5 and "parameters" not in (ast.get_docstring(node) or ""):
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {count}")
    assert long == []
