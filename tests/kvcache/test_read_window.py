"""A read window: what leaves the device holds zeros for the tokens a sliding-window model never reads
again, the rest exact, and compressing tiers rewrite pages that went unread (kvcache/read_window.py)."""
from __future__ import annotations

import pytest
import torch

from kvcache import KVCacheConfig, KVCacheManager, ReadWindow
from kvcache.page_data import empty_pages
from kvcache.read_window import zero_unread
from kvcache.testing import expected_kv, expected_times, serve

WINDOW = ReadWindow(size=20, sink=3)
PAGE = 8


def manager(codec: str = "zstd-channel", window: ReadWindow | None = WINDOW, **extra) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_layers=2, num_heads=2, head_dim=4, page_size=PAGE, num_pages=64,
                                        kv_codec=codec, read_window=window, **extra))


def reloaded_kv(mgr: KVCacheManager, user: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The user's K/V of every layer after an offload, an eviction and an onload (a prepare of nothing new)."""
    mgr.offload_kv_cache([user])
    mgr.evict_kv_cache([user])
    meta = mgr.prepare_kv_cache([user], [length], [0])
    mgr.commit(meta)
    assert mgr.stats().onloaded_bytes > 0
    return [mgr.read_kv(user, layer) for layer in range(mgr.config.num_layers)]


def test_unread_end_and_validation():
    assert WINDOW.unread_end(100) == 80
    assert WINDOW.unread_end(22) == 3  # nothing unread yet: [3, 3)
    for bad in ({"size": 0}, {"size": 4, "sink": -1}, {"size": True}, {"size": 2.0}):
        with pytest.raises(ValueError, match="ReadWindow"):
            ReadWindow(**bad)
    with pytest.raises(ValueError, match="read_window"):
        KVCacheConfig(num_layers=1, num_heads=1, head_dim=4, read_window=(20, 3))


def test_compaction_waits_for_a_window_of_unread_tokens():
    # incremental write from page 12 (length 100); zeros stored up to token 70: 10 more unread, not yet
    assert WINDOW.compact_from(100, 70, 12, PAGE) == 12
    # zeros up to 60: 20 (= size) more unread -> rewrite from the page holding token 60
    assert WINDOW.compact_from(100, 60, 12, PAGE) == 60 // PAGE
    assert WINDOW.compact_from(100, 0, 12, PAGE) == 0  # nothing zeroed yet: from the sink's page


@pytest.mark.parametrize("first_page, unread", [(0, (3, 45)), (2, (3, 45)), (0, (9, 16)), (1, (3, 8)), (4, (3, 30))])
def test_zero_unread_zeroes_exactly_that_range(first_page, unread):
    layout = KVCacheConfig(num_layers=2, num_heads=2, head_dim=4, page_size=PAGE).page_layout
    pages = empty_pages(layout, 5)
    pages.kv.uniform_(1, 2)
    pages.times.copy_(torch.arange(40).view(5, PAGE))
    before = pages.kv.clone()
    zero_unread(pages, first_page, unread, PAGE)
    token = torch.arange(5 * PAGE).view(5, 1, 1, PAGE, 1, 1) + first_page * PAGE
    dead = (token >= unread[0]) & (token < unread[1])
    assert torch.equal(pages.kv, torch.where(dead, 0.0, before))
    assert torch.equal(pages.times, torch.arange(40).view(5, PAGE))


@pytest.mark.parametrize("codec", ["raw", "zstd-channel"])
def test_an_onloaded_user_holds_zeros_exactly_where_nothing_reads(codec):
    with manager(codec) as mgr:
        serve(mgr, [7], [0], [70])
        got = reloaded_kv(mgr, 7, 70)
        assert torch.equal(mgr.read_times(7), expected_times(7, 0, 70))
    unread = torch.zeros(70, dtype=torch.bool)
    unread[3:50] = True
    for layer, (k, v) in enumerate(got):
        k_ref, v_ref = expected_kv(mgr.config.page_layout, 7, 0, 70, layer)
        shape = (70, 1, 1)
        assert torch.equal(k, torch.where(unread.view(shape), 0.0, k_ref))
        assert torch.equal(v, torch.where(unread.view(shape), 0.0, v_ref))


def test_without_a_read_window_everything_comes_back():
    with manager(window=None) as mgr:
        serve(mgr, [7], [0], [70])
        got = reloaded_kv(mgr, 7, 70)
    for layer, kv in enumerate(got):
        assert all(map(torch.equal, kv, expected_kv(mgr.config.page_layout, 7, 0, 70, layer)))


def test_a_compressing_tier_stores_the_unread_pages_in_few_bytes():
    used = {}
    for window in (WINDOW, None):
        with manager("zstd-channel", window) as mgr:
            serve(mgr, [7], [0], [200], values=lambda u, pos: torch.randn(2, 2, len(pos), 2, 4))
            mgr.offload_kv_cache([7])
            used[window] = mgr.host_storage.bytes_used
    # 177 of 200 tokens unread: the zeroed pages cost a few hundred bytes each
    assert used[WINDOW] < 0.25 * used[None]


@pytest.mark.parametrize("codec, rewrites", [("zstd-channel", True), ("raw", False)])
def test_visits_that_grow_a_user_rewrite_unread_pages_only_when_they_pay(codec, rewrites):
    """Visits of 6 tokens after a first of 30: incremental writes append; with a compressing codec, once
    `size` tokens went unread since the last zeroing, a write goes back to rewrite them."""
    with manager(codec) as mgr:
        serve(mgr, [7], [0], [30])
        mgr.offload_kv_cache([7])
        length, page_writes = 30, []
        for _ in range(20):
            before = mgr.stats().offloaded_bytes
            serve(mgr, [7], [length], [6])
            length += 6
            mgr.offload_kv_cache([7])
            page_writes.append((mgr.stats().offloaded_bytes - before) // mgr.config.page_layout.page_nbytes)
        got = reloaded_kv(mgr, 7, length)
    incremental = max(page_writes) <= 2
    assert incremental != rewrites
    # whatever was rewritten or not, every token a later query reads is exact
    for layer, (k, v) in enumerate(got):
        k_ref, v_ref = expected_kv(mgr.config.page_layout, 7, 0, length, layer)
        live = list(range(WINDOW.sink)) + list(range(WINDOW.unread_end(length), length))
        assert torch.equal(k[live], k_ref[live]) and torch.equal(v[live], v_ref[live])
        if rewrites:  # at most `size` tokens of lag left unzeroed
            assert (k[WINDOW.sink : WINDOW.unread_end(length) - WINDOW.size] == 0).all()
        else:  # only the first write zeroed; what went unread later stays as it was written
            unread_later = slice(WINDOW.unread_end(30), WINDOW.unread_end(length))
            assert torch.equal(k[unread_later], k_ref[unread_later])
