"""A real container runtime for the compose end-to-end test: podman with runc.

No registry is reached from here, so no base image can be pulled: the stand-in for
``python:3.11-slim`` is built from Debian's own packages. ``debootstrap --variant=minbase``
makes a root filesystem from the mirror apt is configured with, ``podman import`` turns it into
an image, and ``e2e/containers/python.Containerfile`` adds Debian's Python 3.11 in a virtual
environment on ``PATH`` (as the official image has ``python`` and ``pip``). The project's own
``Dockerfile`` is then built on it through its ``BASE_IMAGE`` argument, exactly as users build
it on ``python:3.11-slim``.

Inside a build, pip reaches PyPI only with this host's certificate authorities, so the host's
CA bundle and a ``pip.conf`` naming it are mounted read-only for the build's ``RUN`` steps;
nothing of them is written into an image.

The sandbox this runs in needs two settings, written to a ``containers.conf`` that only these
commands read (``CONTAINERS_CONF``): runc instead of crun (crun fails on ``setrlimit``), no
default ulimits, and cgroupfs instead of systemd. Healthchecks need systemd timers, which are
not here; podman-compose then starts services without waiting for ``service_healthy``, and the
test waits for the router's ``/ready`` itself.

:func:`unusable` says which check failed when no container can run here; the test skips with
that message and nothing else.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: Where the runtime's configuration and the root filesystem (while it is made) live.
HOME = REPO / "build" / "containers"
RUNC = "/usr/sbin/runc"
DEBIAN_IMAGE = "localhost/kvroute-e2e/debian:bookworm"
PYTHON_IMAGE = "localhost/kvroute-e2e/python:3.11-bookworm"
#: The compose file's image name (``image: kvroute:latest``), as podman spells it.
PROJECT_IMAGE = "localhost/kvroute:latest"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")

CONTAINERS_CONF = """\
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
"""


class Runtime:
    """podman and podman-compose, configured for this sandbox, with their work in ``home``.

    Args:
        home: a folder for the configuration and the root filesystem (kept small: the rootfs
            is removed once imported).
    """

    def __init__(self, home: Path) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        conf = home / "containers.conf"
        conf.write_text(CONTAINERS_CONF)
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def podman(self, *args: str, timeout: float = 120, check: bool = True,
               input: bytes | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``podman ARGS`` and return what it printed; raise with its output on failure."""
        return self._run(["podman", *args], timeout, check, input)

    def compose(self, project: str, compose_file: Path, *args: str, env: dict[str, str],
                timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Run ``podman-compose -p PROJECT -f FILE ARGS`` with ``env`` added."""
        argv = [sys.executable, "-m", "podman_compose", "-p", project, "-f", str(compose_file),
                *args]
        return self._run(argv, timeout, True, None, extra_env=env)

    def _run(self, argv: Sequence[str], timeout: float, check: bool, input: bytes | None,
             extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(list(argv), env={**self.env, **(extra_env or {})},
                              capture_output=True, timeout=timeout, check=False, input=input)
        result = subprocess.CompletedProcess(done.args, done.returncode,
                                             done.stdout.decode(errors="replace"),
                                             done.stderr.decode(errors="replace"))
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(argv[:4])} ... exited {result.returncode}:\n"
                                 f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def image_exists(self, name: str) -> bool:
        return self.podman("image", "exists", name, check=False).returncode == 0

    def debian_image(self) -> str:
        """Debian bookworm (minbase) as an image, made with debootstrap once per machine."""
        if not self.image_exists(DEBIAN_IMAGE):
            rootfs = self.home / "rootfs"
            shutil.rmtree(rootfs, ignore_errors=True)
            done = subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs)],
                                  capture_output=True, text=True, timeout=900, check=False)
            if done.returncode != 0:
                raise AssertionError(f"debootstrap failed:\n{done.stdout[-2000:]}"
                                     f"\n{done.stderr[-2000:]}")
            tar = subprocess.run(["tar", "-C", str(rootfs), "-c", "."], capture_output=True,
                                 check=True, timeout=300)
            self.podman("import", "-", DEBIAN_IMAGE, input=tar.stdout, timeout=300)
            shutil.rmtree(rootfs, ignore_errors=True)
        return DEBIAN_IMAGE

    def python_image(self) -> str:
        """The stand-in for ``python:3.11-slim``: Debian's Python 3.11 with pip on PATH."""
        if not self.image_exists(PYTHON_IMAGE):
            base = self.debian_image()
            self.podman("build", "--build-arg", f"DEBIAN_IMAGE={base}", "-t", PYTHON_IMAGE,
                        "-f", str(REPO / "e2e" / "containers" / "python.Containerfile"),
                        str(REPO / "e2e" / "containers"), timeout=900)
        return PYTHON_IMAGE

    def build_project(self) -> str:
        """Build the project's Dockerfile on the stand-in base; returns the image's name."""
        base = self.python_image()
        pip_conf = self.home / "pip.conf"
        pip_conf.write_text(f"[global]\ncert = {CA_BUNDLE}\n")
        mounts = ["-v", f"{pip_conf}:/etc/pip.conf:ro"]
        if CA_BUNDLE.exists():
            mounts += ["-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro"]
        self.podman("build", "--build-arg", f"BASE_IMAGE={base}", *mounts, "-t", PROJECT_IMAGE,
                    "-f", str(REPO / "Dockerfile"), str(REPO), timeout=900)
        return PROJECT_IMAGE

    def containers(self, project: str) -> list[str]:
        """Names of the compose project's containers, running or not."""
        out = self.podman("ps", "-a", "--filter", f"label=io.podman.compose.project={project}",
                          "--format", "{{.Names}}").stdout
        return sorted(line for line in out.splitlines() if line.strip())


def unusable(home: Path) -> str | None:
    """Why no container can run here (the first check that failed), or None when one can."""
    why = _no_podman(home)
    if why is not None:
        return why
    try:
        import podman_compose  # noqa: F401
    except ImportError:
        return "podman-compose is not installed in this environment (pip install podman-compose)"
    return None


def _no_podman(home: Path) -> str | None:
    for tool in ("podman", "debootstrap", "tar"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make test installs podman, runc and debootstrap " \
                   "from Debian's packages when run as root)"
    if not os.access(RUNC, os.X_OK):
        return f"{RUNC} is missing (Debian package runc)"
    if os.geteuid() != 0:
        return "not root: debootstrap and rootful podman need root"
    runtime = Runtime(home)
    probe = runtime.podman("info", "--format", "{{.Host.OCIRuntime.Name}}", check=False)
    if probe.returncode != 0:
        return f"podman info failed: {probe.stderr.strip()[-300:]}"
    return None


def main() -> int:
    """``python -m e2e.containers`` (``make containers``): make the base images the compose
    test builds on, once per machine, and the project's image on them, or say why no
    container can run here (exit 0: the test then skips saying the same). The test builds
    the project's image again (from podman's cache of each step, unless the sources changed
    since), so a failed build here is printed and left to the test to report. Needs only the
    standard library, not the project's venv."""
    why = _no_podman(HOME)
    if why is not None:
        print(f"containers: no base image made: {why}")
        return 0
    runtime = Runtime(HOME)
    print(f"containers: base image {runtime.python_image()} ready")
    try:
        print(f"containers: project image {runtime.build_project()} built")
    except (AssertionError, subprocess.TimeoutExpired) as exc:
        print(f"containers: the project image did not build here (the compose test builds "
              f"it again): {str(exc)[-2000:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
