"""Builds the C extension shmloader._native.

SHMLOADER_DEBUG=1 builds it with -O0 -g and assertions; SHMLOADER_SANITIZE=1 adds
AddressSanitizer and UBSan (run Python with LD_PRELOAD=$(gcc -print-file-name=libasan.so)).
"""
import glob
import os

from setuptools import Extension, setup

compile_args = ["-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-O3"]
link_args: list[str] = ["-pthread"]
if os.environ.get("SHMLOADER_DEBUG"):
    compile_args += ["-O0", "-g", "-UNDEBUG"]
if os.environ.get("SHMLOADER_SANITIZE"):
    flags = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"]
    compile_args += flags
    link_args += flags

setup(
    ext_modules=[
        Extension(
            "shmloader._native",
            sources=sorted(glob.glob("native/*.c")),
            extra_compile_args=compile_args,
            extra_link_args=link_args,
        )
    ]
)
