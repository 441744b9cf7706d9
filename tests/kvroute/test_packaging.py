"""The package as a user installs it: a wheel that holds every package and data file, and a
non-editable install whose every command runs from a folder outside the checkout.

One wheel is built per module (the Cython core compiles once, ~30 s) and installed into a
scratch virtual environment whose dependencies come from the test run's own environment.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOP_LEVEL = ("kvroute", "indexer", "httpapi", "workers", "router", "bench", "native")

pytestmark = [pytest.mark.slow, pytest.mark.process]


def source_packages() -> set[str]:
    """Every package of the source tree, as dotted names."""
    found = set()
    for top in TOP_LEVEL:
        for init in (REPO / top).rglob("__init__.py"):
            found.add(".".join(init.parent.relative_to(REPO).parts))
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(REPO)],
        check=True, timeout=600, cwd=out)
    (built,) = out.glob("kvroute-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel; its dependencies are this environment's site-packages."""
    env = tmp_path_factory.mktemp("venv")
    venv.create(env, with_pip=False)
    purelib = Path(sysconfig.get_paths(vars={"base": str(env), "platbase": str(env)})["purelib"])
    # A path line in a .pth adds the folder without running the .pth files inside it, so the
    # editable install of the checkout stays out of the scratch environment.
    (purelib / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install", "-q",
         "--no-deps", "--no-index", str(wheel)],
        check=True, timeout=300)
    return env


def test_the_wheel_holds_every_package_and_the_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    packaged = {str(Path(n).parent).replace("/", ".") for n in names if n.endswith("__init__.py")}
    assert source_packages() - packaged == set()
    assert "bench/data/mooncake_synthetic_trace.jsonl" in names
    assert "bench/data/h200_llama1b_random.json" in names
    assert any(n.startswith("native/_core.") and n.endswith(".so") for n in names)
    assert not any(n.startswith(("tests/", "e2e/")) for n in names)


def run(env: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True,
                          timeout=180, env={"PATH": f"{env / 'bin'}:/usr/bin:/bin"})
    assert done.returncode == 0, f"{argv}: {done.stderr[-2000:]}"
    return done


def test_every_command_runs_from_an_installed_wheel(installed: Path, tmp_path: Path) -> None:
    kvroute = installed / "bin" / "kvroute"
    python = installed / "bin" / "python"
    where = run(installed, python, "-c",
                "import indexer.index as i, router, bench.policies as p; "
                "print(i.IMPLEMENTATION, router.__file__, p.__file__)", cwd=tmp_path).stdout
    implementation, router_file, policies_file = where.split()
    assert implementation == "native"
    assert router_file.startswith(str(installed)) and policies_file.startswith(str(installed))
    for command in (["--help"], ["router", "--help"], ["worker", "--help"], ["up", "--help"],
                    ["events", "tail", "--help"], ["bench", "replay", "--help"]):
        assert "usage: kvroute" in run(installed, kvroute, *command, cwd=tmp_path).stdout
    # The default trace ships in the package: a replay with no --trace reads it.
    out = run(installed, kvroute, "bench", "replay", "--requests", "12", "--workers", "2",
              "--policies", "kvroute,round_robin", "--json", tmp_path / "out.json",
              cwd=tmp_path).stdout
    assert "mooncake_synthetic_trace.jsonl" in out and "round_robin" in out
    for module in ("bench.gpu_routing", "bench.router", "bench.replay"):
        assert "usage:" in run(installed, python, "-m", module, "--help", cwd=tmp_path).stdout


def test_the_command_line_loads_no_benchmark_at_start() -> None:
    code = ("import sys, kvroute.cli as c; c.build_parser(); "
            "print(sorted(m for m in sys.modules if m == 'bench' or m.startswith('bench.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=REPO, check=True).stdout
    assert out.strip() == "[]"
