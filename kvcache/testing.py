"""Helpers for tests, benchmarks and tools that drive the cache without a model.

`token_kv` gives every (user, position, layer) a deterministic K and V, and `token_times` every
(user, position) a time, so a reader can check any cached token without keeping a copy; `serve`
runs one batch the way the model does (prepare, append the times and every layer, commit).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from . import paged_kvcache_ops
from .manager import KVCacheManager
from .metadata import KVCacheMetadata
from .page_layout import PageLayout

ValueFn = Callable[[int, Tensor], Tensor]  # (user_id, positions [N]) -> [2, num_layers, N, H, D]


def token_kv(layout: PageLayout, user_id: int, positions: Tensor, salt: int = 0) -> Tensor:
    """Deterministic K/V of a user's tokens: [2, num_layers, N, num_heads, head_dim] in layout.dtype.

    Values are integers below 2**20 (exact in float32); `salt` (e.g. an epoch bumped at each
    invalidation) makes a restarted history differ from the old one.
    """
    shape = (2, layout.num_layers, 1, layout.num_heads, layout.head_dim)
    lane = torch.arange(2 * layout.num_layers * layout.num_heads * layout.head_dim, dtype=torch.int64).view(shape)
    pos = positions.to(torch.int64).view(1, 1, -1, 1, 1)
    mixed = (user_id * 1_000_003 + salt * 15_485_863 + pos * 7_919 + lane * 104_729) % (1 << 20)
    return mixed.to(layout.dtype)


def token_times(user_id: int, positions: Tensor) -> Tensor:
    """Deterministic time of a user's tokens: [N] int64 (distinct across users and positions)."""
    return 1_600_000_000_000 + user_id * 1_000_000_000 + positions.to(torch.int64) * 1_000


def new_token_times(meta: KVCacheMetadata) -> Tensor:
    """`token_times` of every new token of a prepared batch, users concatenated: [N] int64."""
    first = (meta.cached_start_pos + meta.cached_lengths).tolist()
    parts = [token_times(u, torch.arange(s, s + n)) for u, s, n in zip(meta.user_ids, first, meta.new_lengths.tolist())]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def append_batch(mgr: KVCacheManager, meta: KVCacheMetadata, kv: Tensor) -> None:
    """Append `kv` ([2, num_layers, N, H, D], N = meta.num_new_tokens) into every layer and the tokens'
    `token_times`, as the model does."""
    kv = kv.to(mgr.config.device)
    slots = meta.new_token_slots.to(mgr.config.device)
    paged_kvcache_ops.append_times(mgr.times_cache(), new_token_times(meta).to(mgr.config.device), slots)
    for layer in range(mgr.config.num_layers):
        paged_kvcache_ops.append_kvcache(mgr.k_cache(layer), mgr.v_cache(layer), kv[0, layer], kv[1, layer], slots)


def new_token_kv(layout: PageLayout, meta: KVCacheMetadata, start_pos: Sequence[int], values: ValueFn) -> Tensor:
    """K/V of every new token of a prepared batch, users concatenated: [2, num_layers, N, H, D]."""
    parts = [
        values(u, torch.arange(s, s + n))
        for u, s, n in zip(meta.user_ids, start_pos, meta.new_lengths.tolist())
    ]
    if not parts:
        return torch.zeros((2, layout.num_layers, 0, layout.num_heads, layout.head_dim), dtype=layout.dtype)
    return torch.cat(parts, dim=2)


def serve(
    mgr: KVCacheManager,
    user_ids: Sequence[int],
    start_pos: Sequence[int],
    new_lengths: Sequence[int],
    values: ValueFn | None = None,
) -> KVCacheMetadata:
    """prepare -> append (all layers) -> commit; rolls back and re-raises if appending fails."""
    layout = mgr.config.page_layout
    values = values or (lambda u, pos: token_kv(layout, u, pos))
    meta = mgr.prepare_kv_cache(user_ids, start_pos, new_lengths)
    try:
        append_batch(mgr, meta, new_token_kv(layout, meta, start_pos, values))
    except BaseException:
        mgr.rollback(meta)
        raise
    mgr.commit(meta)
    return meta


def expected_times(user_id: int, start: int, length: int) -> Tensor:
    """What `read_times(user_id)` must return for tokens [start, start + length) appended by `append_batch`."""
    return token_times(user_id, torch.arange(start, start + length))


def expected_kv(layout: PageLayout, user_id: int, start: int, length: int, layer: int, salt: int = 0) -> tuple[Tensor, Tensor]:
    """What `read_kv(user_id, layer)` must return for tokens [start, start + length) made by `token_kv`."""
    kv = token_kv(layout, user_id, torch.arange(start, start + length), salt)
    return kv[0, layer], kv[1, layer]


def copy_users(src: KVCacheManager, dst: KVCacheManager, user_ids: Sequence[int]) -> int:
    """Give `dst` the committed tokens (range, tag, K/V and times) `src` holds of each user, then offload
    and evict them from `dst`'s device, so that each is served from `dst`'s host tiers (its codec); one
    user at a time (dst's pool needs room for the largest). Returns the tokens copied."""
    copied = 0
    for u in user_ids:
        start, length = (int(x[0]) for x in src.get_user_kvdata_info([u]))
        if not length:
            continue
        meta = dst.prepare_kv_cache([u], [start], [length], tags=src.get_user_tags([u]))
        slots = meta.new_token_slots.to(dst.config.device)
        paged_kvcache_ops.append_times(dst.times_cache(), src.read_times(u).to(dst.config.device), slots)
        for layer in range(dst.config.num_layers):
            k, v = src.read_kv(u, layer)
            paged_kvcache_ops.append_kvcache(dst.k_cache(layer), dst.v_cache(layer), k.to(dst.config.device),
                                             v.to(dst.config.device), slots)
        dst.commit(meta)
        dst.offload_kv_cache([u])
        dst.evict_kv_cache([u])
        copied += length
    dst.wait()
    return copied
