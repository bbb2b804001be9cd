"""A read window: what leaves the device holds zeros for the tokens a sliding-window model never reads
again, the rest exact, and compressing tiers rewrite pages that went unread (kvcache/read_window.py)."""
from __future__ import annotations

import pytest
import torch

from kvcache import KVCacheConfig, KVCacheManager, ReadWindow
from kvcache.page_data import decoded, empty_pages
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


def host_kv(mgr: KVCacheManager, user: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the host tier holds of the user: K/V [2, num_layers, length, H, D] and times [length]."""
    entry = mgr.host_storage.read(user)
    pages = decoded(entry.pages)
    kv = pages.kv.permute(2, 1, 0, 3, 4, 5).flatten(2, 3)[:, :, : entry.length]
    return kv, pages.times.flatten()[: entry.length]


def live_tokens(length: int) -> list[int]:
    return list(range(WINDOW.sink)) + list(range(WINDOW.unread_end(length), length))


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
    assert torch.equal(pages.times, torch.where(dead.view(5, PAGE), 0, torch.arange(40).view(5, PAGE)))


@pytest.mark.parametrize("codec", ["raw", "zstd-channel"])
def test_the_host_holds_zeros_exactly_where_nothing_reads_and_the_device_frees_those_pages(codec):
    layout = KVCacheConfig(num_layers=2, num_heads=2, head_dim=4, page_size=PAGE).page_layout
    with manager(codec) as mgr:
        serve(mgr, [7], [0], [70])
        # tokens [3, 50) unread: pages 1..5 (tokens 8..47) hold nothing else and are freed at commit
        assert mgr.stats().pages_in_use == mgr.stats().pages_owned == 9 - 5
        mgr.offload_kv_cache([7])
        stored, times = host_kv(mgr, 7)
        got = reloaded_kv(mgr, 7, 70)
        assert mgr.stats().pages_in_use == mgr.stats().pages_owned == 9 - 5  # the onload allocates the live pages only
        live = live_tokens(70)
        assert torch.equal(mgr.read_times(7)[live], expected_times(7, 0, 70)[live])
    unread = torch.zeros(70, dtype=torch.bool)
    unread[3:50] = True
    assert torch.equal(times, torch.where(unread, 0, expected_times(7, 0, 70)))
    for layer, (k, v) in enumerate(got):
        reference = torch.stack(expected_kv(layout, 7, 0, 70, layer))
        assert torch.equal(stored[:, layer], torch.where(unread.view(70, 1, 1), 0.0, reference))
        assert torch.equal(torch.stack([k, v])[:, live], reference[:, live])


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
        stored, _ = host_kv(mgr, 7)
        got = reloaded_kv(mgr, 7, length)
    incremental = max(page_writes) <= 2
    assert incremental != rewrites
    # whatever was rewritten or not, every token a later query reads is exact
    live = live_tokens(length)
    for layer, (k, v) in enumerate(got):
        k_ref, v_ref = expected_kv(mgr.config.page_layout, 7, 0, length, layer)
        assert torch.equal(k[live], k_ref[live]) and torch.equal(v[live], v_ref[live])
        stored_k = stored[0, layer]
        if rewrites:  # at most `size` tokens of lag left unzeroed
            assert (stored_k[WINDOW.sink : WINDOW.unread_end(length) - WINDOW.size] == 0).all()
        else:  # only the first write zeroed; what went unread later stays as it was written
            unread_later = slice(WINDOW.unread_end(30), WINDOW.unread_end(length))
            assert torch.equal(stored_k[unread_later], k_ref[unread_later])


def test_the_worked_examples_in_the_docstrings_hold():
    import doctest

    from kvcache import page_release, read_window

    for module in (read_window, page_release):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
