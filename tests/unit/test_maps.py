"""The maps a newcomer reads match the tree: every path the internals README names exists, every
module of the package and file of native/ is in its table, and ``_native.pyi`` says exactly the
names and signatures the built module has."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

from shmloader import _native

ROOT = pathlib.Path(__file__).resolve().parents[2]
INTERNALS = ROOT / "shmloader" / "README.md"
PATH = re.compile(r"`((?:[\w.]+/)*[\w.]+\.(?:py|pyi|c|h|md))`")


def named_paths() -> set[str]:
    return set(PATH.findall(INTERNALS.read_text()))


def test_every_path_the_internals_readme_names_exists() -> None:
    missing = [p for p in sorted(named_paths())
               if not any((base / p).exists() for base in (ROOT, ROOT / "shmloader"))]
    assert missing == []


def test_every_module_and_native_file_is_in_the_internals_readme() -> None:
    named = named_paths()
    modules = {p.relative_to(ROOT / "shmloader").as_posix() for p in (ROOT / "shmloader").rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py") and "_bench" not in p.parts[:-1]}
    native = {p.relative_to(ROOT).as_posix() for p in (ROOT / "native").iterdir() if p.suffix in (".c", ".h")}
    assert sorted((modules | native) - named) == []


def stub() -> ast.Module:
    return ast.parse((ROOT / "shmloader" / "_native.pyi").read_text())


def test_the_stub_names_what_the_module_has_and_nothing_else() -> None:
    declared: set[str] = set()
    for node in stub().body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            declared.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            declared.add(node.target.id)
    built = {name for name in dir(_native) if not name.startswith("__")}
    assert sorted(built - declared) == [] and sorted(declared - built) == []


def parameters(fn: ast.FunctionDef) -> list[tuple[str, str]]:
    a = fn.args
    out = [(p.arg, "POSITIONAL_ONLY") for p in a.posonlyargs if p.arg != "self"]
    out += [(p.arg, "POSITIONAL_OR_KEYWORD") for p in a.args if p.arg != "self"]
    out += [(a.vararg.arg, "VAR_POSITIONAL")] if a.vararg else []
    out += [(p.arg, "KEYWORD_ONLY") for p in a.kwonlyargs]
    return out + ([(a.kwarg.arg, "VAR_KEYWORD")] if a.kwarg else [])


def test_the_stub_s_signatures_are_the_module_s_text_signatures() -> None:
    """Every function and method whose C docstring carries a signature line (``PyDoc_STRVAR``
    with ``--``) has the stub's parameters, names and kinds alike."""
    checked = 0
    for node in stub().body:
        owner, functions = _native, [node]
        if isinstance(node, ast.ClassDef):
            owner, functions = getattr(_native, node.name), list(node.body)
        for fn in functions:
            if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("__"):
                continue
            try:
                signature = inspect.signature(getattr(owner, fn.name))
            except (ValueError, TypeError):
                continue  # (no text signature: METH_VARARGS without one)
            built = [(p.name, p.kind.name) for p in signature.parameters.values() if p.name != "self"]
            assert built == parameters(fn), f"{getattr(owner, '__name__', owner)}.{fn.name}"
            checked += 1
    assert checked >= 20
