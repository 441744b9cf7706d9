"""The Dockerfile's build steps, replayed in scratch folders without a Docker daemon.

Each stage gets a folder standing for its filesystem root; ``WORKDIR``, ``COPY`` (from the
build context, honouring ``.dockerignore``, or ``--from`` an earlier stage) and ``RUN`` are
replayed there. A ``RUN`` is split at ``&&``; each command is one the replay knows:

- ``pip ...``: this interpreter's pip, with the stage's paths mapped into its folder;
  ``pip install`` goes into the stage's own virtual environment, without dependencies (they
  come from this interpreter's environment at import time, so nothing is downloaded but the
  build backend);
- ``python -c CODE``: the stage's environment, run in the stage's working directory (the
  point: what sits there is on ``sys.path`` first, exactly as in the image);
- ``rm -rf PATH``: removed in the stage's folder;
- ``apt-get``, ``useradd``, ``rm -rf /var/lib/apt/...``: system set-up, skipped.

Any other command fails the replay loudly, so a new kind of step is noticed, not ignored.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Stage", "parse_dockerfile", "replay"]

_SKIPPED = ("apt-get", "useradd", "groupadd")


@dataclass
class Stage:
    """One ``FROM`` block: its name and its instructions as (keyword, argument) pairs."""

    name: str
    base: str
    steps: list[tuple[str, str]] = field(default_factory=list)


def parse_dockerfile(text: str) -> list[Stage]:
    """Split a Dockerfile into stages of (instruction, argument) steps; a ``FROM`` that names a
    global ``ARG`` reads that argument's default."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines()
                                          if not line.lstrip().startswith("#")))
    stages: list[Stage] = []
    args: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        keyword, _, argument = line.strip().partition(" ")
        keyword = keyword.upper()
        if keyword == "ARG" and not stages:
            name, _, default = argument.partition("=")
            args[name.strip()] = default.strip()
        elif keyword == "FROM":
            argument = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], argument)
            parts = argument.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name, parts[0]))
        else:
            assert stages, "a Dockerfile starts with FROM"
            stages[-1].steps.append((keyword, " ".join(argument.split())))
    return stages


def _ignored(context: Path) -> list[str]:
    file = context / ".dockerignore"
    if not file.exists():
        return []
    return [p.strip().removeprefix("**/") for p in file.read_text().splitlines()
            if p.strip() and not p.startswith("#")]


@dataclass
class _Replay:
    context: Path
    scratch: Path
    roots: dict[str, Path] = field(default_factory=dict)
    venvs: dict[str, Path] = field(default_factory=dict)

    def root(self, stage: str) -> Path:
        return self.roots.setdefault(stage, self.scratch / f"stage-{stage}")

    def path(self, stage: str, workdir: str, p: str) -> Path:
        absolute = p if p.startswith("/") else f"{workdir.rstrip('/')}/{p}"
        return self.root(stage) / absolute.lstrip("/")

    def python(self, stage: str) -> Path:
        venv = self.venvs.get(stage)
        if venv is None:
            venv = self.venvs[stage] = self.scratch / f"venv-{stage}"
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)],
                           check=True)
            purelib = Path(sysconfig.get_path("purelib", vars={"base": str(venv),
                                                                "platbase": str(venv)}))
            # Dependencies from this environment, after the stage's own packages; a plain
            # path line, so its .pth files (an editable kvroute) are not processed.
            (purelib / "_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
        return venv / "bin" / "python"

    def copy(self, stage: str, workdir: str, argument: str) -> None:
        args = argument.split()
        source_root = self.context
        if args[0].startswith("--from="):
            source_root = self.root(args.pop(0).removeprefix("--from="))
        *sources, dest = args
        ignore = _ignored(self.context) if source_root == self.context else []
        target = self.path(stage, workdir, dest)
        for source in sources:
            src = source_root / source.lstrip("/")
            into = target / src.name if dest.endswith("/") or len(sources) > 1 else target
            if src.is_dir():
                shutil.copytree(src, into, dirs_exist_ok=True, ignore=lambda d, names: [
                    n for n in names
                    if any(fnmatch.fnmatch(os.path.relpath(Path(d) / n, self.context), p)
                           or fnmatch.fnmatch(n, p) for p in ignore)])
            else:
                into.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, into)

    def run(self, stage: str, workdir: str, argument: str) -> None:
        cwd = self.path(stage, workdir, ".")
        for command in argument.split("&&"):
            argv = shlex.split(command)
            if argv[0] in _SKIPPED or (argv[:2] == ["rm", "-rf"]
                                       and argv[2].startswith("/var/lib/apt")):
                continue
            mapped = [self._map(stage, workdir, a) for a in argv[1:]]
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            if argv[0] == "pip" and mapped[0] == "install":
                cmd = [sys.executable, "-m", "pip", "--python", str(self.python(stage)),
                       "install", "--no-deps", *mapped[1:]]
            elif argv[0] == "pip":
                cmd = [sys.executable, "-m", "pip", *mapped]
            elif argv[0] == "python":
                cmd = [str(self.python(stage)), *argv[1:]]
            elif argv[:2] == ["rm", "-rf"]:
                for p in mapped[1:]:
                    shutil.rmtree(p, ignore_errors=True)
                continue
            else:
                raise AssertionError(f"the replay does not know how to run {command.strip()!r}")
            result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                                    check=False)
            if result.returncode != 0:
                raise AssertionError(f"RUN {command.strip()!r} failed:\n{result.stdout}\n"
                                     f"{result.stderr}")

    def _map(self, stage: str, workdir: str, arg: str) -> str:
        if not arg.startswith("/"):
            return arg
        mapped = str(self.path(stage, workdir, arg))
        found = sorted(glob.glob(mapped))
        return found[0] if found else mapped


def replay(context: Path, scratch: Path, dockerfile: str = "Dockerfile") -> Path:
    """Replay every stage's WORKDIR, COPY and RUN steps; returns the last stage's working
    directory (its root folder stands for ``/``).

    Raises:
        AssertionError: a step failed, or is one the replay does not know.
    """
    state = _Replay(context, scratch)
    workdir = "/"
    for stage in parse_dockerfile((context / dockerfile).read_text()):
        workdir = "/"
        for keyword, argument in stage.steps:
            if keyword == "WORKDIR":
                workdir = argument
                state.path(stage.name, workdir, ".").mkdir(parents=True, exist_ok=True)
            elif keyword == "COPY":
                state.copy(stage.name, workdir, argument)
            elif keyword == "RUN":
                state.run(stage.name, workdir, argument)
    return state.path(stage.name, workdir, ".")
