"""What `prepare_kv_cache` returns: the per-batch page tables and token slots.

Built once per batch from Python lists with a handful of vectorised numpy ops (no per-user
torch ops) and moved to the device in two copies (one int64, one int32 buffer).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class KVCacheMetadata:
    """Per-batch cache layout; tensors are on the cache device, B users in the order given to prepare.

    Token position p of user b lives at slot `page * page_size + (p - cached_start_pos[b]) % page_size`
    with `page = pages_b[(p - cached_start_pos[b]) // page_size]`.
    """

    user_ids: tuple[int, ...]
    cached_start_pos: Tensor  # [B] int64, position of the first cached token (= start_pos if nothing cached)
    cached_lengths: Tensor  # [B] int64, tokens already cached and reused
    new_lengths: Tensor  # [B] int64
    total_lengths: Tensor  # [B] int64, cached + new
    kv_offsets: Tensor  # [B+1] int64, offsets of each user's tokens in kv_slots
    new_offsets: Tensor  # [B+1] int64, offsets of each user's new tokens in new_token_slots
    kv_slots: Tensor  # [sum total] int64, slot of every token (cached, then new) of every user: what attention gathers
    new_token_slots: Tensor  # [sum new] int64, slots of the new tokens: where append writes
    page_indices: Tensor  # [sum pages] int32, the users' page tables concatenated
    page_indptr: Tensor  # [B+1] int32
    last_page_lens: Tensor  # [B] int32, tokens in each user's last page (0 when it has none)
    prepare_id: int = field(repr=False)  # identifies the pending prepare for commit/rollback

    @property
    def batch_size(self) -> int:
        return len(self.user_ids)

    @property
    def num_new_tokens(self) -> int:
        return int(self.new_token_slots.numel())

    @property
    def num_kv_tokens(self) -> int:
        return int(self.kv_slots.numel())


def token_slots(pages: np.ndarray, npages: np.ndarray, lo: np.ndarray, hi: np.ndarray, page_size: int) -> np.ndarray:
    """Slots of tokens [lo[b], hi[b]) (relative to each user's first cached token), users concatenated.

    `pages` are the users' page lists concatenated; user b owns `npages[b]` of them.
    """
    if pages.size == 0:
        return np.zeros(0, dtype=np.int64)
    user_of_page = np.repeat(np.arange(len(npages)), npages)
    first_token = (np.arange(pages.size) - np.repeat(np.cumsum(npages) - npages, npages)) * page_size
    in_page = np.arange(page_size)
    begin = (lo[user_of_page] - first_token)[:, None]
    end = (hi[user_of_page] - first_token)[:, None]
    mask = (in_page >= begin) & (in_page < end)
    return (pages[:, None] * page_size + in_page)[mask]


def build_metadata(
    prepare_id: int,
    user_ids: Sequence[int],
    cached_start_pos: Sequence[int],
    cached_lengths: Sequence[int],
    new_lengths: Sequence[int],
    page_lists: Sequence[Sequence[int]],
    page_size: int,
    device: torch.device,
    pin_memory: bool,
) -> KVCacheMetadata:
    """`page_lists[b]` must hold exactly ceil((cached + new) / page_size) pages."""
    cached = np.asarray(cached_lengths, dtype=np.int64)
    new = np.asarray(new_lengths, dtype=np.int64)
    total = cached + new
    npages = np.fromiter(map(len, page_lists), dtype=np.int64, count=len(page_lists))
    pages = np.fromiter(chain.from_iterable(page_lists), dtype=np.int64, count=int(npages.sum()))
    kv_slots = token_slots(pages, npages, np.zeros_like(total), total, page_size)
    new_slots = token_slots(pages, npages, cached, total, page_size)
    last_page_lens = np.where(npages > 0, total - (npages - 1) * page_size, 0)

    i64 = _to_device(
        [np.asarray(cached_start_pos, dtype=np.int64), cached, new, total,
         _offsets(total), _offsets(new), kv_slots, new_slots],
        np.int64, device, pin_memory,
    )
    i32 = _to_device([pages, _offsets(npages), last_page_lens], np.int32, device, pin_memory)
    return KVCacheMetadata(tuple(user_ids), *i64, *i32, prepare_id=prepare_id)


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _to_device(parts: list[np.ndarray], dtype: type, device: torch.device, pin_memory: bool) -> list[Tensor]:
    """Concatenate, move in one copy (pinned + asynchronous on CUDA), split back into views."""
    sizes = [len(p) for p in parts]
    flat = torch.from_numpy(np.concatenate(parts).astype(dtype, copy=False))
    if device.type != "cpu":
        if pin_memory:
            flat = flat.pin_memory()
        flat = flat.to(device, non_blocking=pin_memory)
    return list(torch.split(flat, sizes))
