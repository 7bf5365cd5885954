"""Builds dedupcore's native core: ext/_core.pyx (hashing, Bloom and binary fuse filters,
sharding) as dedupcore._core and ext/_engine.pyx (the embedded store's claim engine) as
dedupcore._engine."""

import os
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup

compile_args = [] if sys.platform == "win32" else ["-O3", "-fno-strict-aliasing"]

extensions = [
    Extension(
        "dedupcore._core",
        sources=["ext/_core.pyx"],
        include_dirs=["ext"],
        depends=[
            "ext/dc_status.h",
            "ext/dc_hash.h",
            "ext/dc_fuse.h",
            "ext/dc_sync.h",
            "ext/dc_wire.h",
            "ext/_status.pxi",
        ],
        extra_compile_args=compile_args,
    ),
    Extension(
        "dedupcore._engine",
        sources=["ext/_engine.pyx"],
        include_dirs=["ext"],
        depends=[
            "ext/dc_status.h",
            "ext/dc_hash.h",
            "ext/dc_engine.h",
            "ext/dc_mdb.h",
            "ext/_status.pxi",
        ],
        extra_compile_args=compile_args,
    ),
]

setup(
    ext_modules=cythonize(
        extensions,
        # Both sources at once, and both extensions compiled at once: a fresh
        # `./dev demo` spends most of its setup here.
        nthreads=os.cpu_count() or 1,
        compiler_directives={"language_level": "3", "embedsignature": True},
    ),
    options={"build_ext": {"parallel": os.cpu_count() or 1}},
)
