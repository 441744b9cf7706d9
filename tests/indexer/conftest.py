"""One fixture runs every index and hashing test against both implementations."""

from __future__ import annotations

import types

import pytest

import indexer.hashing
import indexer.radix


def _native() -> types.SimpleNamespace:
    try:
        import native._core as core
    except ImportError as exc:  # the build is part of `pip install -e .`: missing is a bug
        pytest.fail(f"the compiled core is not built ({exc}); run `pip install -e .`")
    return types.SimpleNamespace(
        name="native",
        PrefixIndex=core.PrefixIndex,
        block_hashes=core.block_hashes,
        scope_seed=core.scope_seed,
        identity_hash=core.identity_hash,
    )


def _reference() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name="reference",
        PrefixIndex=indexer.radix.PrefixIndex,
        block_hashes=indexer.hashing.block_hashes,
        scope_seed=indexer.hashing.scope_seed,
        identity_hash=indexer.hashing.identity_hash,
    )


@pytest.fixture(params=["reference", "native"])
def impl(request: pytest.FixtureRequest) -> types.SimpleNamespace:
    """The hashing functions and ``PrefixIndex`` of one implementation."""
    return _reference() if request.param == "reference" else _native()


@pytest.fixture(scope="session")
def both() -> tuple[types.SimpleNamespace, types.SimpleNamespace]:
    """The reference and the native implementation, for differential tests."""
    return _reference(), _native()
