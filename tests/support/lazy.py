"""Modules a test module needs only while its tests run: PyTorch and what is built on it.

Collecting the suite imports every test module on every pytest-xdist runner; importing torch
there (with :mod:`workers.torch.model`, about 3-4 s a runner) made every run pay for it,
``-k`` runs of a router test included. A torch test module instead says
``require("torch")`` (a module-level skip where torch is not installed, found without
importing it) and names its modules through :class:`LazyModule`, which imports on the first
attribute read, that is in a test's body. A skip condition that needs torch is a string
(``skipif("not torch.cuda.is_available()")``), which pytest evaluates in the test module's
namespace when the test is set up. conftest.py fails a collection that imported torch anyway.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

import pytest

__all__ = ["REQUIRED_BY", "LazyModule", "require"]

#: The modules that called :func:`require`, by the name they required; conftest.py runs the
#: tests of those that required torch at import on one pytest-xdist runner, so one runner, not
#: each, pays for importing torch and its first model build (about 6 s and 6 s).
REQUIRED_BY: dict[str, set[str]] = {}


def require(name: str) -> None:
    """Skip the calling test module when ``name`` is not installed (without importing it)."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed", allow_module_level=True)
    REQUIRED_BY.setdefault(name, set()).add(sys._getframe(1).f_globals["__name__"])


class LazyModule:
    """Stands for the module ``name``, imported when an attribute is first read or set.

    Reads, writes and deletions go to the module itself, so ``monkeypatch.setattr`` on the
    stand-in patches (and restores) the real module's attribute. Names that start with an
    underscore are not passed on: collecting a test module probes each of its globals for a few
    (``__wrapped__``, ``_mock_name``), which would import the module; a test that needs one
    imports the module itself."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_lazy_name", name)

    def _load(self) -> ModuleType:
        return importlib.import_module(object.__getattribute__(self, "_lazy_name"))

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(self._load(), attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(self._load(), attr, value)

    def __delattr__(self, attr: str) -> None:
        delattr(self._load(), attr)

    def __repr__(self) -> str:
        return f"<lazy module {object.__getattribute__(self, '_lazy_name')!r}>"
