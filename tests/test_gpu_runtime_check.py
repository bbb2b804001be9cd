"""tools/gpu_runtime_check.py: the pre-flight of a CUDA test run. Its parsing is tested here; on a
machine without a CUDA torch (this one, CI) the whole check must fail, naming the fix."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import gpu_runtime_check as check


def test_driver_requirements_follow_the_cuda_major():
    assert check.required_driver("13.0") == 580
    assert check.required_driver("12.6") == 525
    assert check.required_driver("99.1") is None
    assert check.driver_major("580.65.06\n535.1.1\n") == 580
    assert check.driver_major("NVIDIA-SMI has failed") is None


def test_the_declared_triton_is_read_from_torchs_requirements():
    requires = ["filelock", 'triton==3.5.0; platform_system == "Linux" and platform_machine == "x86_64"', "sympy>=1"]
    assert check.declared_triton(requires) == "3.5.0"
    assert check.declared_triton(["pytorch-triton==3.6.0+git1234"]) == "3.6.0+git1234"
    assert check.declared_triton(["filelock"]) is None


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA torch: `make test DEVICE=cuda` runs the check itself")
def test_without_a_cuda_torch_the_check_fails_and_names_the_fix():
    out = subprocess.run([sys.executable, str(Path(check.__file__))], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert lines[0].startswith("error torch build") and "CPU build" in lines[0] and "DEVICE=cuda" in lines[0]
    assert any(line.startswith("error cuda") and "not run" in line for line in lines)
    assert [line.split()[1] for line in lines] == ["torch", "driver", "cuda", "fbgemm-gpu", "torchrec", "triton"]
