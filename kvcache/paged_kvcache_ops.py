"""Registered torch ops that move tokens between a layer's paged K/V cache and flat tensors.

A layer's cache is `[num_pages, page_size, num_heads, head_dim]`; a token's *slot* is
`page * page_size + slot_in_page`, so the cache seen as `[num_pages * page_size, H, D]` is
indexed by slot. Both ops are one pass over the layer:

    append_kvcache(k_cache, v_cache, new_k, new_v, new_token_slots)   # in place, new_k/new_v [N, H, D]
    k, v = gather_kvcache(k_cache, v_cache, kv_slots)                 # [T, H, D] each
    append_times(times_cache, new_times, new_token_slots)             # in place, new_times [N] int64

The tokens' times (`KVCacheManager.times_cache()`, `[num_pages, page_size]` int64) are written once
per batch, not per layer, at the same slots.

They are `torch.library` custom ops (namespace `hstu_kvcache`) with fake implementations, so
they trace under `torch.compile`. On CUDA, append is one Triton launch for K and V of the whole
batch (kvcache/triton_append.py; `index_copy_` when triton is missing); the CPU kernels move each
token row as 16-byte words, which runs at memcpy speed where the element-wise CPU path does not
(bit-exact either way). The default kernel of any other device is `index_copy_` / `index_select`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import triton_append

NAMESPACE = "hstu_kvcache"
_WIDE = torch.complex128  # a 16-byte element used to move rows of any dtype on CPU


def _check(k_cache: Tensor, v_cache: Tensor, slots: Tensor, slots_name: str) -> None:
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_pages, page_size, num_heads, head_dim], got shape {tuple(k_cache.shape)}.")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or v_cache.device != k_cache.device:
        raise ValueError(
            f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} {v_cache.device} must match "
            f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} {k_cache.device}."
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous.")
    if slots.dim() != 1 or slots.dtype != torch.int64:
        raise ValueError(f"{slots_name} must be a 1-D int64 tensor, got {slots.dtype} of shape {tuple(slots.shape)}.")
    if slots.device != k_cache.device:
        raise ValueError(f"{slots_name} is on {slots.device} but the cache is on {k_cache.device}.")


def _check_append(k_cache: Tensor, v_cache: Tensor, new_k: Tensor, new_v: Tensor, slots: Tensor) -> None:
    _check(k_cache, v_cache, slots, "new_token_slots")
    expected = (slots.shape[0], k_cache.shape[2], k_cache.shape[3])
    for name, t in (("new_k", new_k), ("new_v", new_v)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must have shape [N, num_heads, head_dim] = {list(expected)}, got {list(t.shape)}.")
        if t.dtype != k_cache.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but the cache holds {k_cache.dtype}.")
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device} but the cache is on {k_cache.device}.")


def _rows(t: Tensor) -> Tensor:
    """`t` as [rows, H, D] where a row is one token."""
    return t.view(-1, t.shape[-2], t.shape[-1])


def as_words(*tensors: Tensor) -> tuple[Tensor, ...] | None:
    """The tensors with their last dim seen as 16-byte words, or None unless all of them allow it.

    CPU copies of whole rows (index_copy_, index_select) run element by element; as 16-byte
    words they run at memcpy speed, bit-exact for any dtype. A tensor allows it when its last
    dim is contiguous, a whole number of words, and its data is 16-byte aligned.
    """
    out = []
    for t in tensors:
        if t.dim() == 0 or t.data_ptr() % 16 or (t.shape[-1] * t.element_size()) % 16:
            return None
        try:
            out.append(t.view(_WIDE))
        except RuntimeError:  # strides or offset not in whole words
            return None
    return tuple(out)


@torch.library.custom_op(f"{NAMESPACE}::append_kvcache", mutates_args=("k_cache", "v_cache"))
def append_kvcache(k_cache: Tensor, v_cache: Tensor, new_k: Tensor, new_v: Tensor, new_token_slots: Tensor) -> None:
    """Write token i of new_k/new_v into slot new_token_slots[i] of k_cache/v_cache (in place)."""
    _check_append(k_cache, v_cache, new_k, new_v, new_token_slots)
    _rows(k_cache).index_copy_(0, new_token_slots, new_k)
    _rows(v_cache).index_copy_(0, new_token_slots, new_v)


@append_kvcache.register_kernel("cpu")
def _append_kvcache_cpu(k_cache: Tensor, v_cache: Tensor, new_k: Tensor, new_v: Tensor, new_token_slots: Tensor) -> None:
    _check_append(k_cache, v_cache, new_k, new_v, new_token_slots)
    for cache, new in ((k_cache, new_k), (v_cache, new_v)):
        dst, src = _rows(cache), new.contiguous()
        words = as_words(dst.flatten(1), src.flatten(1))
        if words is None:
            dst.index_copy_(0, new_token_slots, src)
        else:
            words[0].index_copy_(0, new_token_slots, words[1])


@append_kvcache.register_kernel("cuda")
def _append_kvcache_cuda(k_cache: Tensor, v_cache: Tensor, new_k: Tensor, new_v: Tensor, new_token_slots: Tensor) -> None:
    _check_append(k_cache, v_cache, new_k, new_v, new_token_slots)
    if triton_append.available():
        triton_append.append_rows(k_cache, v_cache, new_k, new_v, new_token_slots)
    else:
        _rows(k_cache).index_copy_(0, new_token_slots, new_k)
        _rows(v_cache).index_copy_(0, new_token_slots, new_v)


@append_kvcache.register_fake
def _append_kvcache_fake(k_cache: Tensor, v_cache: Tensor, new_k: Tensor, new_v: Tensor, new_token_slots: Tensor) -> None:
    _check_append(k_cache, v_cache, new_k, new_v, new_token_slots)


def append_times(times_cache: Tensor, new_times: Tensor, new_token_slots: Tensor) -> None:
    """Write new_times[i] into slot new_token_slots[i] of times_cache (in place): one op for the batch."""
    if times_cache.dim() != 2 or times_cache.dtype != torch.int64 or not times_cache.is_contiguous():
        raise ValueError(f"times_cache must be a contiguous [num_pages, page_size] int64 tensor, got "
                         f"{times_cache.dtype} of shape {tuple(times_cache.shape)}.")
    if new_times.dtype != torch.int64 or new_times.shape != new_token_slots.shape:
        raise ValueError(f"new_times must be int64 of shape {tuple(new_token_slots.shape)} (one per slot), got "
                         f"{new_times.dtype} of shape {tuple(new_times.shape)}.")
    times_cache.view(-1).index_copy_(0, new_token_slots, new_times)


@torch.library.custom_op(f"{NAMESPACE}::gather_kvcache", mutates_args=())
def gather_kvcache(k_cache: Tensor, v_cache: Tensor, kv_slots: Tensor) -> tuple[Tensor, Tensor]:
    """Read the tokens at kv_slots: returns (k, v), each [len(kv_slots), num_heads, head_dim]."""
    _check(k_cache, v_cache, kv_slots, "kv_slots")
    return _rows(k_cache).index_select(0, kv_slots), _rows(v_cache).index_select(0, kv_slots)


@gather_kvcache.register_kernel("cpu")
def _gather_kvcache_cpu(k_cache: Tensor, v_cache: Tensor, kv_slots: Tensor) -> tuple[Tensor, Tensor]:
    _check(k_cache, v_cache, kv_slots, "kv_slots")
    out = []
    for cache in (k_cache, v_cache):
        rows = _rows(cache)
        words = as_words(rows.flatten(1))
        if words is None:
            out.append(rows.index_select(0, kv_slots))
        else:
            out.append(words[0].index_select(0, kv_slots).view(cache.dtype).view(-1, *rows.shape[1:]))
    return out[0], out[1]


@gather_kvcache.register_fake
def _gather_kvcache_fake(k_cache: Tensor, v_cache: Tensor, kv_slots: Tensor) -> tuple[Tensor, Tensor]:
    _check(k_cache, v_cache, kv_slots, "kv_slots")
    shape = (kv_slots.shape[0], k_cache.shape[2], k_cache.shape[3])
    return k_cache.new_empty(shape), v_cache.new_empty(shape)
