"""Memory: K/V bytes per user, device pages per batch, what limits the batch, memory per served user.

K/V bytes follow from the page layout (`kvcache.PageLayout`: pages of `page_size` tokens, K and V
of every layer plus each token's int64 time), so they are computed for every preset and dtype.
The batch limits combine them with what the visits section measured: a batch of B users of
history L needs B x pages(L) device pages while it is served (the users of a batch cannot evict
one another) and the working memory of a cached visit of B users, split from the peaks measured
at two batch sizes into a part per batch and a part per user, beside the model's weights (the
preset's real embedding tables). The pool is whatever the device budget leaves; the batch stops
where pages plus working memory fill it. A model with a sliding attention window of W events holds
only the pages its window still reads (`kvcache.ReadWindow`, kvcache/page_release.py): the bytes and
the batch limits are given per window (0: every key read).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache import PageLayout
from kvcache.page_release import PageRelease
from model.cache_config import page_layout
from model.config import HSTUConfig, preset
from model.recommender import HSTURecommender

from .visits import VisitRow


@dataclass(frozen=True)
class KVBytesRow:
    preset: str
    dtype: str
    history: int
    kv_bytes: int  # the user's pages (K/V of every layer, token times)
    window: int = 0  # the model's attention window (0: every key): its pages outside it are released


@dataclass(frozen=True)
class BatchLimit:
    history: int
    window: int  # the attention window the pages are counted for (0: every key)
    pages_per_user: int
    page_bytes: int
    kv_bytes_per_user: int
    cached_work_per_batch: int  # a cached visit's working memory that does not grow with its users
    cached_work_per_user: int  # ... and what each user adds
    free_bytes: int  # device budget - weights
    max_batch_cached: int  # users served at once with the cache
    limited_by: str  # "K/V pages" or "working memory": the larger per-user term


@dataclass(frozen=True)
class UserMemory:
    history: int
    without_cache: int  # device bytes while a full-recompute visit runs
    with_cache_device: int  # the user's pages + a cached visit's working memory
    with_cache_resident: int  # the user's pages, held between visits (device or a host tier)


def user_pages(config: HSTUConfig, layout: PageLayout, history: int, window: int = 0) -> int:
    """Device pages a user of `history` tokens holds between visits, its window's unread pages released."""
    return PageRelease(config.replace(attention_window=window).cache_read_window, layout, sink_page=-1).live_pages(history)


def kv_bytes_table(presets: list[str], dtypes: list[torch.dtype], histories: list[int],
                   windows: list[int] = (0,)) -> list[KVBytesRow]:
    rows = []
    for name in presets:
        config = preset(name)
        for dtype in dtypes:
            layout = page_layout(config, dtype)
            rows += [KVBytesRow(name, str(dtype).removeprefix("torch."), h,
                                user_pages(config, layout, h, w) * layout.page_nbytes, w)
                     for w in windows for h in histories]
    return rows


def weights_bytes(preset_name: str, dtype: torch.dtype) -> int:
    """Bytes of the preset's parameters at `dtype`, its full embedding tables included (built on the
    meta device: nothing is allocated)."""
    model = HSTURecommender(preset(preset_name), device="meta")
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def batch_limits(config: HSTUConfig, dtype: torch.dtype, visits: list[VisitRow], budget_bytes: int,
                 weights: int, windows: list[int] = (0,)) -> list[BatchLimit]:
    layout = page_layout(config, dtype)
    free = max(budget_bytes - weights, 0)
    rows = []
    for w, v in ((w, v) for w in windows for v in visits):
        pages = user_pages(config, layout, v.history, w)
        kv = pages * layout.page_nbytes
        per_user = max((v.cached_peak_bytes_batch - v.cached_peak_bytes) // max(v.memory_batch - 1, 1), 0)
        per_batch = max(v.cached_peak_bytes - per_user, 0)
        limited_by = "K/V pages" if kv >= per_user else "working memory"
        max_batch = max(free - per_batch, 0) // (kv + per_user)
        rows.append(BatchLimit(v.history, w, pages, layout.page_nbytes, kv, per_batch, per_user, free, max_batch,
                               limited_by))
    return rows


def pages_for_batches(limit: BatchLimit, batches: list[int]) -> list[int]:
    """Device pages a batch of each size needs at this history."""
    return [b * limit.pages_per_user for b in batches]


def pool_pages(limit: BatchLimit, batch: int) -> int:
    """Pages that fit beside the weights and the working memory of a cached visit of `batch` users."""
    work = limit.cached_work_per_batch + batch * limit.cached_work_per_user
    return max(limit.free_bytes - work, 0) // limit.page_bytes


def memory_per_user(visits: list[VisitRow]) -> list[UserMemory]:
    return [UserMemory(v.history, v.full_peak_bytes, v.kv_bytes + v.cached_peak_bytes, v.kv_bytes) for v in visits]
