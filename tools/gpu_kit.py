"""Assemble `.gpu-kit/` for a GPU machine that cannot install packages (`make gpu-kit`).

    python tools/gpu_kit.py [--shared ../shared/gpu-kit] [--out .gpu-kit]

The shared kit (its README) holds what such a machine lacked when it was made: torchrec,
fbgemm-gpu-cpu for its torch, tensordict and their small dependencies, and a `setup.sh` that
installs every wheel in its `wheels/`. The project has since added packages the serving path and
its tests import (the HTTP stack, metrics, zstd), which the machine lacks too: without them the
test run stops at collection. This copies the shared kit to --out and downloads into its `wheels/`
the CPython 3.12 manylinux wheels of those packages and of their dependencies, at the versions
this venv runs (the machine's Python is 3.12). Needs the package index; nothing is installed here.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
# What the serving path and the CUDA test run import beyond the shared kit and the machine's image
# (a CUDA torch, triton, numpy, pyarrow, tqdm, pytest, hypothesis, matplotlib).
SERVING_PACKAGES = ("aiohttp", "httptools", "prometheus-client", "zstandard")
PYTHON_VERSION, ABI = "3.12", "cp312"
# The machine's interpreter, for the requirements' markers (no extras: only what the packages need).
TARGET_ENVIRONMENT = {"python_version": PYTHON_VERSION, "python_full_version": f"{PYTHON_VERSION}.0",
                      "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                      "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(names: tuple[str, ...]) -> dict[str, str]:
    """{canonical name: installed version} of `names` and everything they require (no extras), from this
    interpreter's installed metadata."""
    found: dict[str, str] = {}
    todo = list(names)
    while todo:
        name = canonical(todo.pop())
        if name in found:
            continue
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            raise SystemExit(f"gpu_kit: {name} is not installed in this venv (make venv first)") from None
        found[name] = dist.version
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate(TARGET_ENVIRONMENT):
                todo.append(requirement.name)
    return found


def kit_packages(wheels: Path) -> set[str]:
    """Canonical names of the wheels already in the kit (a wheel's name is `name-version-...whl`)."""
    return {canonical(w.name.split("-")[0]) for w in wheels.glob("*.whl")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shared", type=Path, default=REPO.parent / "shared" / "gpu-kit", help="the shared kit to copy")
    p.add_argument("--out", type=Path, default=REPO / ".gpu-kit", help="the kit to write (replaced)")
    args = p.parse_args(argv)
    if not (args.shared / "setup.sh").exists():
        raise SystemExit(f"gpu_kit: {args.shared} holds no setup.sh: is it the shared gpu-kit?")
    shutil.rmtree(args.out, ignore_errors=True)
    shutil.copytree(args.shared, args.out)
    wheels = args.out / "wheels"
    have = kit_packages(wheels)
    pins = [f"{name}=={version}" for name, version in sorted(closure(SERVING_PACKAGES).items()) if name not in have]
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", PYTHON_VERSION, "--implementation", "cp", "--abi", ABI, *platforms,
                    "--dest", str(wheels), *pins], check=True)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"{args.out}: the shared kit and {len(pins)} more wheels ({', '.join(pins)}), {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
