"""Compile the project's Triton kernels for an H100 (sm90) up to PTX, on a machine without a GPU.

CPU CI runs the kernels in Triton's interpreter, which accepts what the GPU compiler refuses (a
head_dim of 8, a bf16 `tl.dot` it never takes) and has no shared memory to run out of. This runs
Triton's own pipeline (ttir -> ttgir -> llir -> ptx) for `SM90`, for every variant a deployment
launches, and checks each one's shared memory per block against the H100's limit:

    python -m model.kernel_compile            # prints one JSON line per variant; exit 1 on any failure

The attention kernel's variants are its constexprs (`triton_attention.KernelConstants`) for every
preset's head_dim and relative bias, fp32 and bf16, contiguous keys and the serving page size. Its
split count, history row offset and key window are runtime arguments that Triton does not
specialise on, so one binary serves every allowed split and window; the KV append kernel has one
variant per dtype (row widths are runtime), and the int8 decode of the KV cache's onload one per
pool dtype, code type (int8 without a low, uint8 with one) and preset head_dim. Pointers and strides
are compiled 16-divisible where every launch of these shapes passes them so, so the binary is the one
Triton builds when serving.

Triton decides at import whether kernels compile or interpret: run this without TRITON_INTERPRET
(the tests run it in a subprocess). It needs no CUDA driver, only the ptxas of the triton wheel.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

SM90 = ("cuda", 90, 32)  # (backend, compute capability, warp size): triton's GPUTarget of an H100
H100_SHARED_BYTES_PER_BLOCK = 227 * 1024  # 228 KiB of shared memory per SM, 1 KiB of it reserved per block
SERVING_PAGE_SIZES = (0, 32)  # contiguous keys (full recompute) and the KV cache's default page size
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
_DIVISIBLE = [["tt.divisibility", 16]]


@dataclass(frozen=True)
class CompiledVariant:
    kernel: str  # "hstu_attention" (+ "_tag_match"), "kv_append" or "int8_decode" (+ "_u8_low" for codes with a low)
    dtype: str
    head_dim: int  # 0 for kv_append (its row width is a runtime argument)
    page_size: int
    splits: tuple[int, ...]  # the split counts this one binary serves
    shared_bytes: int  # shared memory per block
    num_warps: int
    ptx_chars: int
    tensor_core_dots: bool  # the PTX multiplies with Hopper's wgmma (what bf16 tl.dot should compile to)
    seconds: float
    error: str = ""  # the compiler's message when it refused the variant

    @property
    def ok(self) -> bool:
        return not self.error and self.shared_bytes <= H100_SHARED_BYTES_PER_BLOCK


def missing_toolchain() -> str | None:
    """Why this installation cannot compile for CUDA without a GPU, or None when it can."""
    try:
        import triton.backends.nvidia.compiler as nvidia
    except ImportError as err:
        return f"triton has no CUDA backend ({err})"
    try:
        nvidia.get_ptxas(SM90[1]).path  # noqa: B018  (resolving it runs `ptxas --version`)
    except Exception as err:  # the PTX stage asks ptxas which PTX version it reads
        return f"triton's CUDA backend finds no ptxas ({type(err).__name__}: {err}); the triton wheel ships one"
    return None


def compile_to_ptx(fn, signature: dict[str, str], constexprs: dict[str, object], divisible: set[str],
                   num_warps: int, num_stages: int) -> tuple[str, dict]:
    """Triton's compile pipeline for SM90 up to its PTX stage (the cubin stage would run ptxas on it).
    -> (ptx, metadata); metadata["shared"] is the shared memory per block."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend

    target = GPUTarget(*SM90)
    backend = make_backend(target)
    attrs = {(fn.arg_names.index(name),): _DIVISIBLE for name in divisible}
    src = ASTSource(fn, signature, constexprs, attrs)
    options = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages})
    metadata = {"target": target, **options.__dict__}
    stages: dict = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    for ext, stage in stages.items():
        module = stage(module, metadata)
        if ext == "ptx":
            return module, metadata
    raise RuntimeError("the CUDA backend has no ptx stage")


def _attention_signature(dtype: torch.dtype) -> tuple[dict[str, str], set[str]]:
    from model.attention.triton_attention import _hstu_attention_kernel as kernel

    t = _TRITON_TYPES[dtype]
    pointers = {"Q": t, "K": t, "V": t, "KEYS": t, "VALUES": t, "OUT": "fp32", "QUERY_STAMPS": "i64", "KEY_STAMPS": "i64",
                "POSITION_BIAS": "fp32", "TIME_BIAS": "fp32", "TAG_BIAS": "fp32"}
    signature, divisible = {}, set()
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
            divisible.add(name)
        elif name in ("alpha", "inv_normalizer"):
            signature[name] = "fp32"
        elif name.startswith("stride_"):
            signature[name] = "i32"
            divisible.add(name)
        elif name in ("history_rows", "num_splits", "key_window", "key_sink"):  # do_not_specialize: any value, no attributes
            signature[name] = "i32"
        else:  # the plan's int32 arrays
            signature[name] = "*i32"
            divisible.add(name)
    return signature, divisible


def attention_variants() -> list[tuple[int, int, int, bool]]:
    """(head_dim, position_buckets, time_buckets, tag_match) of every preset, with and without the tag
    match (a preset trained on a catalogue with tags may have it)."""
    from model.config import PRESET_NAMES, preset

    shapes = {(c.head_dim, c.num_position_buckets, c.num_time_buckets) for c in map(preset, PRESET_NAMES)}
    return sorted((*shape, tag_match) for shape in shapes for tag_match in (False, True))


def compile_attention(head_dim: int, dtype: torch.dtype, page_size: int, position_buckets: int, time_buckets: int,
                      tag_match: bool = False) -> CompiledVariant:
    from model.attention import triton_attention

    constants = triton_attention.kernel_constants(page_size, head_dim, dtype, position_buckets, time_buckets,
                                                  tag_match, interpreted=False)
    signature, divisible = _attention_signature(dtype)
    name = "hstu_attention" + ("_tag_match" if tag_match else "")
    return _compile(name, triton_attention._hstu_attention_kernel, signature, constants.constexprs(),
                    divisible, constants.num_warps, constants.num_stages, dtype, head_dim, page_size,
                    triton_attention.allowed_splits())


def compile_kv_append(dtype: torch.dtype) -> CompiledVariant:
    from kvcache import triton_append

    t = _TRITON_TYPES[dtype]
    signature = {"K_CACHE": "*" + t, "V_CACHE": "*" + t, "NEW_K": "*" + t, "NEW_V": "*" + t, "SLOTS": "*i64",
                 "row_elems": "i32", "stride_k": "i32", "stride_v": "i32", "BLOCK_E": "constexpr"}
    divisible = set(signature) - {"BLOCK_E"}
    return _compile("kv_append", triton_append._append_kernel, signature, {"BLOCK_E": triton_append.BLOCK}, divisible,
                    triton_append.NUM_WARPS, 1, dtype, 0, 0, ())


def compile_int8_decode(dtype: torch.dtype, head_dim: int, has_low: bool) -> CompiledVariant:
    from kvcache.codecs import triton_int8

    kernel = triton_int8._decode_kernel
    pointers = {"OUT": "*" + _TRITON_TYPES[dtype], "PAGE_IDS": "*i64", "CODES": "*u8" if has_low else "*i8",
                "SCALE": "*fp32", "LOW": "*fp32"}
    constexprs = {"HAS_LOW": has_low, "BLOCK_R": triton_int8.ROWS_PER_PROGRAM,
                  "BLOCK_D": triton_int8.block_dims(head_dim)}
    signature = {p.name: "constexpr" if p.is_constexpr else pointers.get(p.name, "i32") for p in kernel.params}
    # Only the pool and the ids are surely 16-byte aligned: codes and scales sit at any 8-byte offset of a row.
    return _compile("int8_decode" + ("_u8_low" if has_low else ""), kernel, signature, constexprs,
                    {"OUT", "PAGE_IDS"}, triton_int8.NUM_WARPS, 1, dtype, head_dim, 0, ())


def _compile(kernel, fn, signature, constexprs, divisible, num_warps, num_stages, dtype, head_dim, page_size, splits
             ) -> CompiledVariant:
    started = time.perf_counter()
    common = dict(kernel=kernel, dtype=_TRITON_TYPES[dtype], head_dim=head_dim, page_size=page_size, splits=splits,
                  num_warps=num_warps)
    try:
        ptx, metadata = compile_to_ptx(fn, signature, constexprs, divisible, num_warps, num_stages)
    except Exception as err:  # the compiler's refusal is the finding: report it, go on with the others
        return CompiledVariant(**common, shared_bytes=0, ptx_chars=0, tensor_core_dots=False,
                               seconds=round(time.perf_counter() - started, 2),
                               error=f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err) else ''}")
    return CompiledVariant(**common, shared_bytes=int(metadata["shared"]), ptx_chars=len(ptx),
                           tensor_core_dots="wgmma.mma_async" in ptx, seconds=round(time.perf_counter() - started, 2))


def compile_all() -> Iterator[CompiledVariant]:
    """Every variant a deployment of the presets launches, compiled for SM90 (one at a time)."""
    for dtype in DTYPES.values():
        yield compile_kv_append(dtype)
    for head_dim in sorted({variant[0] for variant in attention_variants()}):
        for dtype in DTYPES.values():
            for has_low in (False, True):
                yield compile_int8_decode(dtype, head_dim, has_low)
    for head_dim, position_buckets, time_buckets, tag_match in attention_variants():
        for dtype in DTYPES.values():
            for page_size in SERVING_PAGE_SIZES:
                yield compile_attention(head_dim, dtype, page_size, position_buckets, time_buckets, tag_match)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    failed = 0
    for variant in compile_all():
        failed += not variant.ok
        print(json.dumps({**asdict(variant), "ok": variant.ok}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
