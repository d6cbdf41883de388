"""What the device check carries to a GPU machine as cp312 wheels, and what it takes from the
machine's image: the list, its download on a CPU machine (``scripts/device-wheels``), and the check
that the ``gpu`` tests import nothing that neither gives."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["CARRIED", "FROM_THE_IMAGE", "download_wheels", "missing_on_the_machine", "requirements"]

ROOT = Path(__file__).resolve().parent.parent

#: What the project needs beside what a GPU machine's image brings: every runtime dependency except
#: numpy (the machine's torch, torchvision and cupy are built against its own), at the versions the
#: CPU machines test, the build backend of the editable install, and what the benchmarks and the
#: ``gpu`` tests' modules import beside them (``bench/_peers.py`` the Redis client,
#: ``tests/client/test_wrap.py`` simplejpeg).
CARRIED = (
    "grpcio",
    "grpcio-health-checking",
    "protobuf",
    "prometheus-client",
    "PyYAML",
    "fsspec",
    "google-crc32c",
    "tqdm",
    "setuptools",
    "pytest-timeout",
    "redis",
    "simplejpeg",
)
#: What the parts import from the machine's own image.
FROM_THE_IMAGE = (
    "torch",
    "torchvision",
    "numpy",
    "cupy",
    "cuda.bindings",
    "pynvml",
    "matplotlib",
    "pytest",
    "PIL",
    "sklearn",
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def requirements() -> list[str]:
    """``name==version`` of every carried wheel, at the version installed here."""
    pinned = []
    for name in CARRIED:
        try:
            pinned.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError as exc:
            raise SystemExit(f"device-check: {name} is not installed here, so its version is unknown") from exc
    return pinned


def download_wheels(dest: Path, python: str) -> int:
    """Download the carried wheels for CPython 3.12 on x86-64 Linux into ``dest`` (replacing it)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    argv = [python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    argv += ["--implementation", "cp", *[f"--platform={p}" for p in PLATFORMS], "-d", str(dest), *requirements()]
    done = subprocess.run(argv, check=False)
    size = sum(p.stat().st_size for p in dest.glob("*.whl"))
    print(f"device-check: {len(list(dest.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {dest}", file=sys.stderr)
    return done.returncode


def missing_on_the_machine(files: list[str]) -> set[str]:
    """Top-level modules the ``gpu`` test files import (through the tests' own modules too) that
    neither the standard library, the project, the GPU machine's image nor the carried wheels give."""
    given = {m.split(".")[0] for m in FROM_THE_IMAGE} | {"kspeed", "tests"}
    distributions = importlib.metadata.packages_distributions()
    carried = {_distribution(name) for name in CARRIED}
    given |= {module for module, dists in distributions.items() if any(_distribution(d) in carried for d in dists)}
    seen: set[Path] = set()
    imported: set[str] = set()
    queue = [ROOT / f for f in files]
    while queue:
        path = queue.pop()
        if path in seen or not path.exists():
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.split(".")[0] == "tests":  # follow the tests' own modules
                    queue.append(ROOT / (name.replace(".", "/") + ".py"))
                imported.add(name.split(".")[0])
    return {m for m in imported if m not in given and m not in sys.stdlib_module_names}


def _distribution(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
