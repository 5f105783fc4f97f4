"""Builds the C extension shmloader._native: a C compiler and Python's headers, nothing of torch
(its stack_into learns torch's tensors at import: native/_tensors.c), so one build serves every
torch and `pip install .` builds it in an isolated environment.

SHMLOADER_DEBUG=1 builds it with -O0 -g and assertions; SHMLOADER_SANITIZE=1 adds
AddressSanitizer and UBSan (run Python with LD_PRELOAD=$(gcc -print-file-name=libasan.so)).
"""
import glob
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    """Links without the run paths this Python's own build put in its link command (a pyenv
    Python's lib directory, say): the extension needs nothing but libc, and a wheel must not
    point into the machine that built it."""

    def build_extensions(self) -> None:
        linker = self.compiler.linker_so
        self.compiler.linker_so = [a for a in linker if not a.startswith(("-Wl,-rpath", "-Wl,-R"))]
        super().build_extensions()


compile_args = ["-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-O3"]
link_args: list[str] = ["-pthread"]
if os.environ.get("SHMLOADER_DEBUG"):
    compile_args += ["-O0", "-g", "-UNDEBUG"]
if os.environ.get("SHMLOADER_SANITIZE"):
    flags = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"]
    compile_args += flags
    link_args += flags

setup(cmdclass={"build_ext": BuildExt}, ext_modules=[
    Extension(
        "shmloader._native",
        sources=sorted(glob.glob("native/*.c")),
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        libraries=["dl"],  # dlopen/dlsym: torch's C shim (glibc before 2.34 keeps them in libdl)
    )
])
