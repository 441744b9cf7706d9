"""Where a ``--tokenizer`` value points: a local folder or ``tokenizer.json``, or a Hugging
Face model id already in the local Hugging Face cache. Nothing is downloaded at run time.

The cache is ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``, laid
out as the ``huggingface_hub`` client writes it: ``models--ORG--NAME/snapshots/REVISION/``,
with ``refs/main`` naming the revision to use. Every failure is one line that says what to do.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

__all__ = ["hf_cache", "resolve_tokenizer"]

#: ``org/name`` (or ``name``) as the Hub spells model ids; a path has a slash at its start,
#: a dot segment or more than one slash.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def hf_cache() -> Path:
    """The local Hugging Face hub cache folder."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def resolve_tokenizer(name: str) -> Path:
    """The local file or folder ``name`` names.

    Args:
        name: a folder holding ``tokenizer.json``, the file itself, or a Hugging Face model
            id (``Qwen/Qwen3-8B``) whose tokenizer is in the local cache.

    Raises:
        ValueError: nothing local by that name; the message says how to get one.
    """
    path = Path(name).expanduser()
    if path.exists():
        return path
    if "/" not in name or not _HUB_ID.fullmatch(name) or name.startswith((".", "/")):
        raise ValueError(f"tokenizer path {name} does not exist: give --tokenizer a folder "
                         "holding tokenizer.json (or the file itself)")
    cached = _cached_snapshot(name)
    if cached is not None:
        return cached
    raise ValueError(
        f"tokenizer {name} is no local path and not in the Hugging Face cache "
        f"({hf_cache()}); nothing is downloaded at run time: fetch it first "
        f"(huggingface-cli download {name} tokenizer.json tokenizer_config.json) or give "
        "--tokenizer a folder holding tokenizer.json")


def _cached_snapshot(model: str) -> Path | None:
    repo = hf_cache() / f"models--{model.replace('/', '--')}"
    snapshots = repo / "snapshots"
    try:
        main = (repo / "refs" / "main").read_text().strip()
    except OSError:
        main = ""
    candidates = [snapshots / main] if main else []
    with contextlib.suppress(OSError):
        candidates += sorted((p for p in snapshots.iterdir() if p.is_dir()),
                             key=lambda p: p.stat().st_mtime, reverse=True)
    return next((c for c in candidates if (c / "tokenizer.json").is_file()), None)
