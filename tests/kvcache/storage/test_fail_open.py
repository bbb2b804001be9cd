"""FailOpenStorage: a tier that raises, hangs or returns bad data costs recomputation, never a visit;
and the manager's paths where a tier reported data it then cannot return."""
import gc
import logging
import threading
import time
import weakref

import pytest
import torch

from helpers import TINY_LAYOUT_ARGS
from kvcache import (
    FailOpenStorage,
    HostPages,
    InMemoryHostStorage,
    KVCacheConfig,
    KVCacheManager,
    KVCacheStaleError,
    PageData,
    PageLayout,
    TierDataError,
    TieredHostStorage,
)
from kvcache.storage import fail_open
from kvcache.testing import expected_kv, serve

LAYOUT = PageLayout(**TINY_LAYOUT_ARGS)
PAGE = LAYOUT.page_nbytes


class FlakyTier(InMemoryHostStorage):
    """An in-memory tier whose calls misbehave on demand (`mode`; "hang" hangs the page moves only)."""

    def __init__(self, capacity_bytes=1 << 20):
        super().__init__(capacity_bytes)
        self.mode = "ok"
        self.release = threading.Event()  # ends a "hang"
        self.calls = 0

    def _misbehave(self, moves_pages=True):
        self.calls += 1
        if self.mode == "raise":
            raise ConnectionError("tier unreachable")
        if self.mode == "hang" and moves_pages:
            self.release.wait(10)

    def info(self, user_id):
        self._misbehave(moves_pages=False)
        return super().info(user_id)

    def read(self, user_id):
        self._misbehave()
        hp = super().read(user_id)
        if hp is not None and self.mode == "bad_shape":
            return hp._replace(pages=PageData(hp.pages.kv[:, :1], hp.pages.times))
        if hp is not None and self.mode == "bad_times":
            return hp._replace(pages=PageData(hp.pages.kv, hp.pages.times.double()))
        if hp is not None and self.mode == "short":
            return hp._replace(pages=hp.pages[:0])
        if hp is not None and self.mode == "data_error":
            raise TierDataError(f"user {user_id}: checksum mismatch")
        return hp

    def write(self, user_id, start_pos, length, first_page, fill, protect=(), tag=b""):
        self._misbehave()
        return super().write(user_id, start_pos, length, first_page, fill, protect, tag)

    def drop(self, user_id):
        self._misbehave()
        return super().drop(user_id)


def _manager(timeout_s=None, retry_after_s=0.0, host_pages=2, num_pages=16):
    """Device pool -> a small in-memory tier -> a flaky tier behind FailOpenStorage."""
    flaky = FlakyTier()
    guarded = FailOpenStorage(flaky, "flaky", timeout_s=timeout_s, retry_after_s=retry_after_s)
    host = TieredHostStorage([InMemoryHostStorage(host_pages * PAGE), guarded])
    cfg = KVCacheConfig(num_layers=2, num_heads=1, head_dim=2, page_size=4, num_pages=num_pages)
    return KVCacheManager(cfg, host_storage=host), flaky, guarded


def _visit(mgr, users, new=3):
    """What a session does: ask, prepare from the answer (re-plan on a stale refusal), commit, offload."""
    for _ in range(3):
        start, length = mgr.get_user_kvdata_info(users)
        try:
            serve(mgr, users, (start + length).tolist(), [new] * len(users))
            break
        except KVCacheStaleError:
            continue
    else:
        raise AssertionError("re-planning did not converge")
    mgr.offload_kv_cache(users)
    return start, length


def _assert_data(mgr, users):
    for u in users:
        start, length = (t.item() for t in mgr.get_user_kvdata_info([u]))
        for layer in range(2):
            k, v = mgr.read_kv(u, layer)
            ek, ev = expected_kv(mgr.config.page_layout, u, start, length, layer)
            assert torch.equal(k, ek) and torch.equal(v, ev)


def test_a_tier_that_raises_is_served_around_and_warned_about_once(caplog):
    mgr, flaky, guarded = _manager()
    _visit(mgr, [1, 2, 3])
    flaky.mode = "raise"
    with caplog.at_level(logging.WARNING, logger="kvcache"):
        for _ in range(4):
            _visit(mgr, [1, 2, 3, 4])
            mgr.evict_kv_cache()  # users come back from the in-memory tier, or are recomputed
        warnings = [r for r in caplog.records if r.name == "kvcache"]
    assert len(warnings) == 1 and "'flaky' failed" in warnings[0].getMessage()
    stats = mgr.stats()
    assert stats.tier_failures > 4 and guarded.failures == stats.tier_failures
    _assert_data(mgr, [1, 2, 3, 4])
    flaky.mode = "ok"
    with caplog.at_level(logging.WARNING, logger="kvcache"):
        _visit(mgr, [5])
    assert any("answers again" in r.getMessage() for r in caplog.records)
    mgr.check_invariants()


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def monotonic(self):
        return self.now


def test_a_failing_tier_is_skipped_for_the_back_off_period_and_a_lost_drop_hides_the_user(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(fail_open, "time", clock)
    flaky = FlakyTier()
    guarded = FailOpenStorage(flaky, "flaky", retry_after_s=1.0, max_retry_after_s=2.0)
    guarded.bind(LAYOUT)
    assert guarded.write(1, 0, 4, 0, lambda dst: dst.kv.fill_(1.0)).stored
    flaky.mode = "raise"
    assert guarded.info(2) is None and flaky.calls == 2
    for u in range(10):
        assert guarded.info(u) is None and guarded.read(u) is None
    assert flaky.calls == 2 and guarded.skipped == 20
    assert not guarded.drop(1)  # not made: user 1 is hidden from now on
    clock.now += 1.0
    assert guarded.info(2) is None and flaky.calls == 3  # retried once, failed again: 2 s now
    clock.now += 1.5
    assert guarded.info(2) is None and flaky.calls == 3
    flaky.mode = "ok"
    clock.now += 0.5
    assert guarded.info(2) is None and flaky.calls == 4 and guarded.counters()["failures"] == 2
    assert flaky.info(1) is not None and guarded.info(1) is None and guarded.read(1) is None  # invalidated
    assert guarded.drop(1) and flaky.info(1) is None


def test_a_hanging_tier_is_abandoned_after_the_timeout_and_used_again_once_it_returns():
    mgr, flaky, guarded = _manager(timeout_s=0.5)
    _visit(mgr, [1, 2])
    flaky.mode = "hang"
    t0 = time.monotonic()
    _visit(mgr, [3], new=6)  # its write to the hanging tier is abandoned after 0.5 s
    assert time.monotonic() - t0 < 5 and guarded.timeouts == 1
    calls = flaky.calls
    _visit(mgr, [4])  # the tier is skipped while the abandoned call runs
    assert flaky.calls == calls and guarded.skipped >= 1 and guarded.timeouts == 1
    mgr.evict_kv_cache([3])
    serve(mgr, [9], [0], [40])  # reuses user 3's device pages before the abandoned write runs
    flaky.mode = "ok"
    flaky.release.set()
    deadline = time.monotonic() + 5
    while guarded.info(3) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    stored = flaky.read(3)  # written from a private copy of the pages, not from the reused device pages
    kv = stored.pages.kv.permute(2, 1, 0, 3, 4, 5).reshape(2, 2, -1, 1, 2)[:, :, : stored.length]
    assert stored.entry == (0, 6, b"") and torch.equal(kv[0, 1], expected_kv(LAYOUT, 3, 0, 6, 1)[0])
    _visit(mgr, [5])
    assert mgr.stats().tier_timeouts == 1
    _assert_data(mgr, [1, 2, 3, 4, 5, 9])


@pytest.mark.parametrize("mode", ["bad_shape", "bad_times", "short", "data_error"])
def test_bad_data_from_a_tier_is_a_miss_that_is_recomputed(mode, caplog):
    mgr, flaky, guarded = _manager(host_pages=0)  # the flaky tier is the only one holding anything
    _visit(mgr, [1, 2], new=6)
    mgr.evict_kv_cache()
    flaky.mode = mode
    with caplog.at_level(logging.WARNING, logger="kvcache"):
        _start, length = _visit(mgr, [1, 2])  # stale once (reported, then unreadable), then recomputed
    assert length.tolist() == [0, 0] and mgr.stats().tier_corrupt_reads >= 1
    assert guarded.info(1) == guarded.info(2) == (0, 3, b"")  # the bad entries were replaced by the recomputed ones
    assert sum("bad data" in r.getMessage() for r in caplog.records) == 1
    assert mgr.stats().refusals == 1
    flaky.mode = "ok"
    _assert_data(mgr, [1, 2])


def test_fill_errors_are_the_callers_and_propagate():
    guarded = FailOpenStorage(FlakyTier(), "flaky")
    guarded.bind(LAYOUT)

    def broken(dst):
        raise RuntimeError("device copy failed")

    with pytest.raises(RuntimeError, match="device copy failed"):
        guarded.write(1, 0, 4, 0, broken)
    assert guarded.failures == 0


def test_data_lost_between_the_report_and_the_prepare_is_refused_as_stale():
    mgr, flaky, _guarded = _manager(host_pages=0)
    _visit(mgr, [1], new=6)
    mgr.evict_kv_cache()
    start, length = mgr.get_user_kvdata_info([1])
    assert length.item() == 6
    flaky.drop(1)  # another node's eviction, a TTL: the manager is not told
    with pytest.raises(KVCacheStaleError):
        mgr.prepare_kv_cache([1], start + length, [2], expected_cached_lengths=length)
    assert mgr.get_user_kvdata_info([1])[1].item() == 0
    serve(mgr, [1], [0], [8])
    _assert_data(mgr, [1])


def test_an_entry_that_info_reports_but_read_cannot_return_is_dropped_and_refused_as_stale():
    class Unreadable(InMemoryHostStorage):
        def read(self, user_id):
            return None

    cfg = KVCacheConfig(num_layers=2, num_heads=1, head_dim=2, page_size=4, num_pages=16)
    mgr = KVCacheManager(cfg, host_storage=Unreadable(1 << 20))
    serve(mgr, [1], [0], [6])
    mgr.offload_kv_cache()
    mgr.evict_kv_cache()
    start, length = mgr.get_user_kvdata_info([1])
    for _ in range(2):  # the same stale plan is refused again, not taken as a new user
        with pytest.raises(KVCacheStaleError):
            mgr.prepare_kv_cache([1], start + length, [2], expected_cached_lengths=length)
    assert mgr.host_storage.info(1) is None and mgr.stats().pages_in_use == 0
    assert mgr.get_user_kvdata_info([1])[1].item() == 0
    serve(mgr, [1], [0], [8])
    _assert_data(mgr, [1])


def test_read_results_are_validated():
    guarded = FailOpenStorage(FlakyTier(), "flaky")
    guarded.bind(LAYOUT)
    guarded.write(1, 0, 6, 0, lambda dst: dst.kv.fill_(1.0))
    assert isinstance(guarded.read(1), HostPages)
    guarded.inner.read = lambda u: HostPages(0, 6, torch.zeros((2, *LAYOUT.page_shape), dtype=torch.float32))
    assert guarded.read(1) is None and guarded.corrupt_reads == 1  # a bare tensor, not PageData
    wrong_dtype = PageData(torch.zeros((2, *LAYOUT.page_shape), dtype=torch.float64), torch.zeros((2, 4), dtype=torch.int64))
    guarded.inner.read = lambda u: HostPages(0, 6, wrong_dtype)
    assert guarded.read(1) is None and guarded.corrupt_reads == 2


class FreshPagesTier(InMemoryHostStorage):
    """Returns every read in a new tensor (as the disk and Redis tiers do), so its lifetime can be watched."""

    def read(self, user_id):
        hp = super().read(user_id)
        return None if hp is None else hp._replace(pages=hp.pages.clone())


def test_the_worker_thread_keeps_nothing_of_a_call_and_close_joins_it():
    """A daemon thread still in torch while the interpreter finalises aborts the process ("terminate called
    without an active exception"): the worker must not free a call's result, and must be gone after close."""
    tier = FailOpenStorage(FreshPagesTier(1 << 20), "fresh", timeout_s=5.0)
    tier.bind(LAYOUT)
    for u in (1, 2):
        assert tier.write(u, 0, 6, 0, lambda dst: dst.kv.fill_(1.0)).stored
    pages = weakref.ref(tier.read(1).pages)
    assert tier.read(2) is not None  # a later call on the worker: it is done with the first one
    gc.collect()
    assert pages() is None  # freed here, by the caller: the worker held no reference to it
    tier.close()
    assert not tier._worker.alive


def test_a_hung_call_does_not_hang_close():
    mgr, flaky, guarded = _manager(timeout_s=0.05)
    _visit(mgr, [1])
    mgr.evict_kv_cache([1])
    mgr.host_storage.tiers[0].drop(1)
    flaky.mode = "hang"
    mgr.get_user_kvdata_info([1])
    _visit(mgr, [1])  # the read hangs past the timeout: abandoned, recomputed
    assert guarded.timeouts >= 1
    mgr.close()  # joins the worker for at most the timeout, then leaves the hung call behind
    flaky.release.set()
    guarded._worker.close()
    assert not guarded._worker.alive
