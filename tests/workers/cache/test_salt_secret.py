"""A worker with a cluster salt secret publishes keyed salt tags and says so."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import pytest

from indexer.hashing import SALT_TAG_HMAC, SALT_TAG_SHA256
from indexer.wire import BlockStored, encode_batch
from workers.cache import block_pool as pool
from workers.cache.block_keys import Prompt, RequestBlocks, Scope
from workers.cache.event_sink import EventSink
from workers.runtime import WorkerRuntime
from workers.settings import WorkerSettings, WorkerSettingsError, load_worker_settings


def first_extra_keys(salt_key: bytes | None) -> list[str]:
    blocks = RequestBlocks(Prompt([1, 2, 3, 4], scope=Scope(salt="tenant-a")), 2)
    sink = EventSink(salt_key=salt_key)
    sink.capture([pool.BlocksCommitted("GPU", (blocks.block(0), blocks.block(1)))])
    batch = sink.next_batch(0.0, 0)
    assert batch is not None and b"tenant-a" not in encode_batch(batch)
    (event,) = batch.events
    assert isinstance(event, BlockStored) and event.extra_keys is not None
    keys = event.extra_keys[0]
    assert isinstance(keys, list)
    return keys


def test_the_salt_tag_is_keyed_by_the_cluster_secret() -> None:
    keyed = hmac.new(b"cluster-secret", b"tenant-a", hashlib.sha256).hexdigest()[:16]
    assert first_extra_keys(b"cluster-secret") == ["salt:" + keyed]
    assert first_extra_keys(None) == ["salt:" + hashlib.sha256(b"tenant-a").hexdigest()[:16]]


def test_model_info_names_the_tagging(tmp_path: Path) -> None:
    secret_file = tmp_path / "salt"
    secret_file.write_text("from-a-file\n")
    settings = load_worker_settings({"salt_secret_file": str(secret_file),
                                     "events_port": "none"}, env={})
    assert settings.salt_key == b"from-a-file"
    assert "from-a-file" not in repr(settings)
    assert WorkerRuntime(settings).model_info()["salt_hashing"] == SALT_TAG_HMAC
    plain = WorkerSettings(events_port=None)
    assert WorkerRuntime(plain).model_info()["salt_hashing"] == SALT_TAG_SHA256


def test_bad_salt_secrets_are_refused(tmp_path: Path) -> None:
    with pytest.raises(WorkerSettingsError, match="salt_secret_file"):
        load_worker_settings({"salt_secret_file": str(tmp_path / "missing")}, env={})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(WorkerSettingsError, match="empty"):
        load_worker_settings({"salt_secret_file": str(tmp_path / "empty")}, env={})
