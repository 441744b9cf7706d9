"""Builds the compiled index core (``native/``) as part of ``pip install``.

``native/_core.pyx`` wraps the C++ tables in ``native/index_core.h`` and the hash in
``native/hash64.h``; ``native/_residency.pyx`` the routing core's predicted residency
(``native/residency_core.h``); ``native/_byte_tokens.pyx`` the byte-level tokenizer's ids;
``-O3`` matters (the hash's multiplies and the table probes inline).
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(
        "native._core",
        ["native/_core.pyx"],
        include_dirs=["native"],
        depends=[
            "native/_hashing.pxi",
            "native/hash64.h",
            "native/index_core.h",
            "native/table.h",
        ],
        language="c++",
        extra_compile_args=["-O3", "-std=c++17", "-fno-strict-aliasing"],
    ),
    Extension(
        "native._residency",
        ["native/_residency.pyx"],
        include_dirs=["native"],
        depends=["native/hash64.h", "native/residency_core.h"],
        language="c++",
        extra_compile_args=["-O3", "-std=c++17", "-fno-strict-aliasing"],
    ),
    Extension(
        "native._byte_tokens",
        ["native/_byte_tokens.pyx"],
        extra_compile_args=["-O3"],
    ),
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False},
    ),
)
