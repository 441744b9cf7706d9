"""The image builds: the Dockerfile's steps, replayed without Docker, install a kvroute
whose compiled index core is the one Python imports in the image's working directory."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.deploy.dockerfile import parse_dockerfile, replay

pytestmark = pytest.mark.process  # starts child processes

REPO = Path(__file__).resolve().parents[2]
CHECK = "import indexer.index as i; assert i.IMPLEMENTATION == 'native'"


def test_the_image_is_multi_stage_slim_and_non_root() -> None:
    stages = parse_dockerfile((REPO / "Dockerfile").read_text())
    assert len(stages) >= 2
    runtime = stages[-1]
    assert runtime.base.endswith("-slim")
    keywords = [k for k, _ in runtime.steps]
    assert ("USER", "10001:10001") in runtime.steps
    assert keywords.index("USER") > max(i for i, k in enumerate(keywords) if k == "RUN")
    # No compiler and no source tree in the runtime stage: only the built wheel is copied.
    assert all(a.startswith("--from=") for k, a in runtime.steps if k == "COPY")
    assert not any("g++" in a for k, a in runtime.steps if k == "RUN")
    assert any(CHECK in a for k, a in runtime.steps if k == "RUN")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_dockerfile_steps_build_an_image_with_the_native_core(tmp_path: Path) -> None:
    workdir = replay(REPO, tmp_path)  # the RUN check inside passed, or this raised
    venv_python = tmp_path / "venv-1" / "bin" / "python"
    # The replay can tell: the same check, run where a bare source native/ shadows the
    # installed package, fails as the single-stage image's did.
    shadowed = tmp_path / "shadowed"
    shadowed.mkdir()
    (shadowed / "native").mkdir()
    (shadowed / "native" / "__init__.py").write_text("")
    bad = subprocess.run([str(venv_python), "-c", CHECK], cwd=shadowed, capture_output=True,
                         text=True, check=False)
    assert bad.returncode != 0 and "AssertionError" in bad.stderr
    good = subprocess.run([str(venv_python), "-c", CHECK + "; import kvroute.cli, router.epp"],
                          cwd=workdir, capture_output=True, text=True, check=False)
    assert good.returncode == 0, good.stderr
