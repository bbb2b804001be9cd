"""Both Triton kernels compile for an H100 (sm90) up to PTX on this CPU machine, for every variant
the presets launch, within the H100's shared memory per block (model/kernel_compile.py).

The interpreter the other kernel tests run in cannot catch a variant the GPU compiler refuses or
one that needs more shared memory than a block gets: this can."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO_ROOT, subprocess_env

pytest.importorskip("triton")
from model import kernel_compile

pytestmark = pytest.mark.slow

_MISSING = kernel_compile.missing_toolchain()
if _MISSING:
    pytest.skip(f"cannot compile for CUDA here: {_MISSING}", allow_module_level=True)


def _compiling_env() -> dict[str, str]:
    """A child's environment without TRITON_INTERPRET: Triton decides at import whether it compiles or interprets."""
    return {name: value for name, value in subprocess_env().items() if name != "TRITON_INTERPRET"}


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    run = subprocess.run([sys.executable, "-m", "model.kernel_compile"], cwd=REPO_ROOT, env=_compiling_env(),
                         capture_output=True, text=True, timeout=900)
    variants = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert variants, run.stderr[-3000:]
    return variants


def test_every_preset_variant_compiles_within_the_h100_shared_memory(compiled):
    from model.attention.triton_attention import allowed_splits
    from model.config import PRESET_NAMES, preset

    failures = [v for v in compiled if not v["ok"]]
    assert not failures, failures
    assert all(v["shared_bytes"] <= kernel_compile.H100_SHARED_BYTES_PER_BLOCK for v in compiled)
    attention = {(v["kernel"], v["head_dim"], v["dtype"], v["page_size"]): v for v in compiled
                 if v["kernel"].startswith("hstu_attention")}
    head_dims = {preset(name).head_dim for name in PRESET_NAMES}
    assert set(attention) == {(k, d, t, p) for k in ("hstu_attention", "hstu_attention_tag_match") for d in head_dims
                              for t in ("fp32", "bf16") for p in (0, 32)}
    # One binary per variant serves every split the planner may choose (the count is a runtime argument).
    assert all(tuple(v["splits"]) == allowed_splits() for v in attention.values())
    assert {v["dtype"] for v in compiled if v["kernel"] == "kv_append"} == {"fp32", "bf16"}
    decodes = {(v["kernel"], v["dtype"], v["head_dim"]) for v in compiled if v["kernel"].startswith("int8_decode")}
    assert decodes == {(k, t, d) for k in ("int8_decode", "int8_decode_u8_low") for t in ("fp32", "bf16") for d in head_dims}


def test_bf16_dots_compile_to_hopper_tensor_cores(compiled):
    """Under the interpreter bf16 takes the fp32 upcast branch; on sm90 it must be wgmma, or bf16 serving is slow."""
    bf16 = [v for v in compiled if v["kernel"].startswith("hstu_attention") and v["dtype"] == "bf16"]
    assert bf16 and all(v["tensor_core_dots"] for v in bf16)


def test_a_head_dim_the_interpreter_accepts_is_refused_for_sm90():
    """head_dim 8 runs under the interpreter but tl.dot needs K >= 16 on the GPU: what config.py's guard names."""
    code = ("import torch; from model.kernel_compile import compile_attention; "
            "print(compile_attention(8, torch.bfloat16, 32, 81, 92).error)")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=_compiling_env(), capture_output=True,
                         text=True, timeout=300)
    assert "K >= 16" in run.stdout, run.stdout + run.stderr[-2000:]
