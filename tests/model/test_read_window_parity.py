"""A sliding-window model served through a cache that offloads its unread K/V as zeros
(`HSTUConfig.cache_read_window`, kvcache/read_window.py): every returning user's logits are
bit-identical to a cache that keeps them, while compressing tiers store far fewer bytes; a candidate
that would read behind the cached end is recomputed instead."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from data.dataset import InferenceDataset
from helpers import build_processed, returning_users, sensitive_model
from kvcache import KVCacheManager, ReadWindow
from model.attention import triton_attention
from model.cache_config import kv_cache_config
from model.cached_serving import serve_through_cache
from model.config import config_for_dataset, preset
from model.inference import InferenceSession

WINDOW = 6  # events: the tiny data's users have tens of them, so most of a returning user's window goes unread


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    dataset = InferenceDataset(build_processed(tmp_path_factory.mktemp("read_window")))
    model = sensitive_model(config_for_dataset("tiny", dataset).replace(attention_window=WINDOW), 0)
    return dataset, model


def cache_for(model, keep_unread_kv: bool) -> KVCacheManager:
    return KVCacheManager(kv_cache_config(
        model.config, num_pages=300, keep_unread_kv=keep_unread_kv, host_capacity_bytes=1 << 23, kv_codec="zstd-channel",
    ))


def test_the_model_names_its_window():
    config = preset("tiny", user_feature_cardinalities=(3, 4))
    assert sensitive_model(config, 0).config.cache_read_window is None
    windowed = sensitive_model(config.replace(attention_window=9), 0)
    assert windowed.config.cache_read_window == ReadWindow(size=9, sink=windowed.layout.num_prefix)


@pytest.mark.parametrize("backend, count", [
    ("blocked", 60),
    pytest.param("triton", 24, marks=pytest.mark.skipif(not triton_attention.available(), reason="triton is not installed")),
])
def test_unread_kv_released_and_offloaded_as_zeros_leave_every_logit_unchanged(world, monkeypatch, backend, count):
    """Through either attention backend (Triton: its interpreter on the CPU), which read the sink page
    where a user's pages were released, under the window's mask."""
    dataset, model = world
    monkeypatch.setattr(model, "attention_backend", backend)
    assert model.resolved_attention_backend().name == backend
    kept, kept_bytes = returning_users(model, dataset, count, kv_codec="zstd-channel")
    zeroed, zeroed_bytes = returning_users(model, dataset, count, keep_unread_kv=False, kv_codec="zstd-channel")
    assert torch.equal(kept, zeroed)
    assert zeroed_bytes < 0.8 * kept_bytes


def returning_visit(dataset) -> tuple[int, int]:
    """(an earlier visit, the same user's next one): the earlier with a history of several windows."""
    req = dataset.requests
    for i in range(len(req)):
        prev = np.flatnonzero(req.user_id[:i] == req.user_id[i])
        if len(prev) and req.end[prev[-1]] >= 4 * WINDOW:
            return int(prev[-1]), i
    raise AssertionError("the test data has no returning user with a long history")


def test_a_candidate_reading_behind_the_cached_end_is_recomputed(world):
    """Only queries at or after the cached end are guaranteed their keys: a candidate that sees an
    earlier history end is served by recomputing its user's window, as without a cache."""
    dataset, model = world
    earlier, visit = returning_visit(dataset)
    req = dataset.requests
    cache = cache_for(model, keep_unread_kv=False)
    session = InferenceSession(model, dataset, kv_cache=cache)

    def looking_back(starts, window_starts):
        batch = dataset.make_batch(np.array([visit]), starts, window_starts)
        ends = np.full(len(batch.candidate_video_ids), window_starts[0] + 2, dtype=np.int64)
        return dataclasses.replace(batch, candidate_history_ends=ends)

    with cache:
        session.serve(np.array([earlier]))
        cache.offload_kv_cache()
        cache.evict_kv_cache()  # the user comes back with zeros where its window no longer reads
        served = serve_through_cache(model, cache, req.user_id[visit : visit + 1], req.end[visit : visit + 1],
                                     looking_back)
    assert served.tokens_reused == 0
    assert (served.batch.starts == served.batch.window_starts).all()
    with torch.inference_mode():
        assert torch.equal(served.logits, model(served.batch))


def test_a_visit_with_no_new_events_reads_the_oldest_key_its_window_keeps(world):
    """Served again at the same history end, a user's candidates see the cached window's last
    `attention_window` keys, the oldest of them included, and its prefix: after an offload and an
    onload they score as through a cache that kept every key."""
    dataset, model = world
    earlier, _ = returning_visit(dataset)
    req = dataset.requests
    logits = []
    for keep_unread_kv in (True, False):
        cache = cache_for(model, keep_unread_kv)
        with cache:
            InferenceSession(model, dataset, kv_cache=cache).serve(np.array([earlier]))
            cache.offload_kv_cache()
            cache.evict_kv_cache()
            again = serve_through_cache(model, cache, req.user_id[earlier : earlier + 1], req.end[earlier : earlier + 1],
                                        lambda starts, windows: dataset.make_batch(np.array([earlier]), starts, windows))
        assert again.tokens_reused > 0 and len(again.batch.video_ids) == 0
        logits.append(again.logits)
    assert torch.equal(*logits)
