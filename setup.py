"""Builds the C extension shmloader._native and, where torch is importable at build time (make
installs it first and builds without isolation), the C++ extension shmloader._tensors.

SHMLOADER_DEBUG=1 builds them with -O0 -g and assertions; SHMLOADER_SANITIZE=1 adds
AddressSanitizer and UBSan to _native (run Python with LD_PRELOAD=$(gcc -print-file-name=libasan.so)).
SHMLOADER_NO_TENSORS=1 leaves _tensors out, as does a failure to build it (a warning): shmloader
then runs the same batches through torch.stack and torch.from_numpy.
"""
import glob
import os

from setuptools import Extension, setup

compile_args = ["-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-O3"]
link_args: list[str] = ["-pthread"]
debug = ["-O0", "-g", "-UNDEBUG"] if os.environ.get("SHMLOADER_DEBUG") else []
compile_args += debug
if os.environ.get("SHMLOADER_SANITIZE"):
    flags = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"]
    compile_args += flags
    link_args += flags

extensions = [
    Extension(
        "shmloader._native",
        sources=sorted(glob.glob("native/*.c")),
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    )
]


def tensors_extension() -> Extension | None:
    """shmloader._tensors against the torch this build sees (None without one): its headers and
    libraries, its C++ ABI, and its version, which shmloader checks before using the module."""
    if os.environ.get("SHMLOADER_NO_TENSORS"):
        return None
    try:
        import torch
    except ImportError:
        return None
    root = os.path.dirname(torch.__file__)
    lib = os.path.join(root, "lib")
    return Extension(
        "shmloader._tensors",
        sources=["native/_tensors.cpp"],
        language="c++",
        include_dirs=[os.path.join(root, "include")],
        library_dirs=[lib],
        runtime_library_dirs=[lib],
        libraries=["c10", "torch", "torch_cpu", "torch_python"],
        define_macros=[
            ("SHMLOADER_TORCH_VERSION", torch.__version__),
            ("_GLIBCXX_USE_CXX11_ABI", str(int(torch._C._GLIBCXX_USE_CXX11_ABI))),
        ],
        extra_compile_args=["-std=c++20", "-O3", "-Wall", "-Wno-unused-parameter", *debug],
        optional=True,  # no C++20 compiler, or headers that do not build: the package without it
    )


tensors = tensors_extension()
setup(ext_modules=extensions + ([tensors] if tensors is not None else []))
