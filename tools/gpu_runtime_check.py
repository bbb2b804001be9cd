"""Does this machine run the GPU path? Checked before the CUDA test run (`make test DEVICE=cuda`).

    python tools/gpu_runtime_check.py      # exit 0 when every check passes; each failure names its fix

A green CPU-fallback test run proves nothing on a GPU machine: with a CPU torch, or a driver too old
for torch's CUDA, `torch.cuda.is_available()` is simply False and every CUDA test skips. These checks
fail loudly instead, one line per problem:

    torch build     torch is a CUDA build (pip may have taken a local CPU wheel of the same version)
    driver          the NVIDIA driver is new enough for torch's CUDA major version
    cuda            torch.cuda.is_available() and a kernel runs
    fbgemm-gpu      fbgemm_gpu imports and one of its CUDA ops runs (an ABI mismatch with torch fails here)
    torchrec        torchrec imports (it loads fbgemm_gpu's ops)
    triton          triton is the version torch declares
"""
from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

# The oldest driver each CUDA major version runs on (NVIDIA's minor-version compatibility table).
MIN_DRIVER = {11: 450, 12: 525, 13: 580}
OLDER_TORCH = "or a torch built for CUDA 12 (pip install torch --index-url https://download.pytorch.org/whl/cu126)"


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str  # what was found; on failure, also the fix


def required_driver(cuda_version: str) -> int | None:
    """'13.0' -> 580: the oldest driver for that CUDA major (None when unknown)."""
    return MIN_DRIVER.get(int(cuda_version.split(".")[0]))


def driver_major(nvidia_smi_output: str) -> int | None:
    """'580.65.06\\n' -> 580 (the first GPU's driver)."""
    match = re.match(r"\s*(\d+)\.", nvidia_smi_output)
    return int(match.group(1)) if match else None


def declared_triton(torch_requirements: list[str]) -> str | None:
    """The triton version torch pins ('triton==3.5.0; platform_system == "Linux"' -> '3.5.0')."""
    for requirement in torch_requirements:
        match = re.match(r"\s*(?:pytorch-)?triton\s*==\s*([^\s;,]+)", requirement)
        if match:
            return match.group(1)
    return None


def _torch_build() -> CheckResult:
    import torch

    if torch.version.cuda is None:
        return CheckResult("torch build", False, f"torch {torch.__version__} is a CPU build: reinstall the CUDA set "
                           "from PyPI (`make venv DEVICE=cuda` with no local wheel directory in pip's find-links)")
    return CheckResult("torch build", True, f"torch {torch.__version__}, CUDA {torch.version.cuda}")


def _driver() -> CheckResult:
    import torch

    if shutil.which("nvidia-smi") is None:
        return CheckResult("driver", False, "nvidia-smi not found: is the NVIDIA driver installed?")
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30).stdout
    have, need = driver_major(out), required_driver(torch.version.cuda or "0")
    if have is None:
        return CheckResult("driver", False, f"could not read the driver version from nvidia-smi: {out.strip()!r}")
    if need is not None and have < need:
        return CheckResult("driver", False, f"driver {have} is older than R{need}, which CUDA {torch.version.cuda} "
                           f"needs: update the driver, {OLDER_TORCH}")
    return CheckResult("driver", True, f"driver {out.strip()}")


def _cuda() -> CheckResult:
    import torch

    if not torch.cuda.is_available():
        return CheckResult("cuda", False, "torch.cuda.is_available() is False (see the driver check)")
    x = torch.arange(4, device="cuda", dtype=torch.float32)
    if float((x * 2).sum()) != 12.0:
        return CheckResult("cuda", False, "a CUDA kernel gave a wrong result")
    return CheckResult("cuda", True, torch.cuda.get_device_name())


def _fbgemm() -> CheckResult:
    import torch

    try:
        import fbgemm_gpu  # noqa: F401

        lengths = torch.tensor([1, 2, 3], device="cuda", dtype=torch.int64)
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
    except Exception as exc:  # an import or ABI failure: report it, do not crash the report
        return CheckResult("fbgemm-gpu", False, f"{type(exc).__name__}: {exc} (fbgemm-gpu must be the CUDA build "
                           "made for this torch version)")
    if offsets.tolist() != [0, 1, 3, 6]:
        return CheckResult("fbgemm-gpu", False, f"asynchronous_complete_cumsum gave {offsets.tolist()}")
    return CheckResult("fbgemm-gpu", True, f"fbgemm-gpu {importlib.metadata.version('fbgemm-gpu')}")


def _torchrec() -> CheckResult:
    try:
        import torchrec  # noqa: F401
    except Exception as exc:
        return CheckResult("torchrec", False, f"{type(exc).__name__}: {exc}")
    return CheckResult("torchrec", True, f"torchrec {importlib.metadata.version('torchrec')}")


def _triton() -> CheckResult:
    want = declared_triton(importlib.metadata.requires("torch") or [])
    try:
        have = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return CheckResult("triton", False, f"triton is not installed (torch declares {want})")
    if want is not None and have != want:
        return CheckResult("triton", False, f"triton {have}, but torch declares {want}: pip install triton=={want}")
    return CheckResult("triton", True, f"triton {have}")


# (name, check, whether it needs a usable CUDA torch: the torch build and driver checks passed)
CHECKS: tuple[tuple[str, Callable[[], CheckResult], bool], ...] = (
    ("torch build", _torch_build, False), ("driver", _driver, False), ("cuda", _cuda, True),
    ("fbgemm-gpu", _fbgemm, True), ("torchrec", _torchrec, False), ("triton", _triton, False),
)


def run_checks() -> list[CheckResult]:
    """Every check; those that need CUDA are reported as not run once CUDA is known to be missing."""
    results: list[CheckResult] = []
    for name, check, needs_cuda in CHECKS:
        if needs_cuda and not all(r.ok for r in results[:2]):
            results.append(CheckResult(name, False, "not run: no usable CUDA torch"))
        else:
            results.append(check())
    return results


def main() -> int:
    results = run_checks()
    for r in results:
        print(f"{'ok   ' if r.ok else 'error'} {r.name:<12} {r.detail}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
