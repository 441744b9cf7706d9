"""Builds the compiled index core (``native/``) as part of ``pip install``."""

from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(
        "native._core",
        ["native/_core.pyx"],
        language="c++",
        extra_compile_args=["-O3", "-std=c++17"],
    ),
]

setup(ext_modules=cythonize(extensions, language_level=3, compiler_directives={"boundscheck": False, "wraparound": False}))
