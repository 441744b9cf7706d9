"""The prefix index and block hashing the rest of kvroute imports: compiled when built.

``native._core`` (the Cython core) is used when it is importable; the pure-Python reference
(:mod:`indexer.radix`, :mod:`indexer.hashing`) when the environment sets
``KVROUTE_PURE_PYTHON=1`` or the core is not built (then with a warning: the reference is two
orders of magnitude slower). Both export the same names with the same results; type checkers
read the reference. :data:`IMPLEMENTATION` says which one is active.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

from indexer.hashing import UnhashableStore, event_hash_input
from indexer.radix import STAT_NAMES

__all__ = [
    "GLOBAL_SEED",
    "IMAGE_WORD",
    "IMPLEMENTATION",
    "STAT_NAMES",
    "PrefixIndex",
    "UnhashableStore",
    "block_hashes",
    "event_hash_input",
    "identity_hash",
    "scope_seed",
]

if TYPE_CHECKING or os.environ.get("KVROUTE_PURE_PYTHON", "") not in ("", "0"):
    from indexer.hashing import GLOBAL_SEED, IMAGE_WORD, block_hashes, identity_hash, scope_seed
    from indexer.radix import PrefixIndex

    IMPLEMENTATION = "reference"
else:
    try:
        from native._core import (
            GLOBAL_SEED,
            IMAGE_WORD,
            PrefixIndex,
            block_hashes,
            identity_hash,
            scope_seed,
        )

        IMPLEMENTATION = "native"
    except ImportError as exc:
        warnings.warn(
            f"kvroute's compiled index core is not built ({exc}); using the pure-Python "
            "reference, which is far slower. Rebuild with `pip install -e .`.",
            RuntimeWarning,
            stacklevel=2,
        )
        from indexer.hashing import (
            GLOBAL_SEED,
            IMAGE_WORD,
            block_hashes,
            identity_hash,
            scope_seed,
        )
        from indexer.radix import PrefixIndex

        IMPLEMENTATION = "reference"
