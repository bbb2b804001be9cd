"""What `prepare_kv_cache` returns: the per-batch page tables and token slots, on the host.

Built once per batch from the users' page lists with a handful of vectorised numpy ops (no
per-user torch ops). It stays on the host: a serving forward packs it with the rest of its
per-batch metadata and moves everything to the device in one copy; `to(device)` is for callers
driving the cache ops by hand.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from itertools import chain

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class KVCacheMetadata:
    """Per-batch cache layout: CPU tensors (views of numpy arrays), B users in the order given to prepare.

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
    page_size: int
    prepare_id: int = field(repr=False)  # identifies the pending prepare for commit/rollback

    @property
    def batch_size(self) -> int:
        return len(self.user_ids)

    @property
    def num_new_tokens(self) -> int:
        return int(self.new_token_slots.numel())

    def to(self, device: torch.device | str) -> KVCacheMetadata:
        """The same metadata with every tensor on `device` (for callers driving the cache ops by hand)."""
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self) if isinstance(getattr(self, f.name), Tensor)}
        return replace(self, **moved)


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
    t = torch.from_numpy
    return KVCacheMetadata(
        tuple(user_ids),
        cached_start_pos=t(np.asarray(cached_start_pos, dtype=np.int64)),
        cached_lengths=t(cached),
        new_lengths=t(new),
        total_lengths=t(total),
        kv_offsets=t(_offsets(total)),
        new_offsets=t(_offsets(new)),
        kv_slots=t(kv_slots),
        new_token_slots=t(new_slots),
        page_indices=t(pages.astype(np.int32)),
        page_indptr=t(_offsets(npages).astype(np.int32)),
        last_page_lens=t(last_page_lens.astype(np.int32)),
        page_size=page_size,
        prepare_id=prepare_id,
    )


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out
