"""Model behaviour beyond parity: candidate independence, failure atomicity, refusals, checkpoints."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from helpers import (
    Visit,
    assert_logits_close,
    make_batch,
    make_cache,
    random_candidates,
    random_histories,
    sensitive_model,
    serve,
    tiny_config,
)
from model.checkpoint import CheckpointError, load_checkpoint, model_fingerprint, save_checkpoint
from model.kv_store import PagedKV
from model.recommender import HSTURecommender


@pytest.fixture()
def setup():
    cfg = tiny_config()
    model = sensitive_model(cfg, 0)
    rng = np.random.default_rng(0)
    return cfg, model, rng, random_histories(rng, 3, 40, cfg)


def cache_snapshot(cache, users, num_layers):
    """Everything observable about the users' cached data, plus the counters."""
    start, length = cache.get_user_kvdata_info(users)
    kv = {(u, layer): tuple(t.clone() for t in cache.read_kv(u, layer))
          for u, n in zip(users, length.tolist()) if n for layer in range(num_layers)}
    return start.tolist(), length.tolist(), kv, cache.stats()


def assert_same_data(a, b):
    assert a[0] == b[0] and a[1] == b[1]
    assert a[2].keys() == b[2].keys()
    for key in a[2]:
        assert all(torch.equal(x, y) for x, y in zip(a[2][key], b[2][key]))


def test_permuting_candidates_permutes_logits(setup):
    _cfg, model, rng, histories = setup
    cands = random_candidates(rng, 7)
    perm = rng.permutation(7)
    base = serve(model, None, histories, [Visit(0, 30, cands)])
    permuted = serve(model, None, histories, [Visit(0, 30, cands[perm])])
    torch.testing.assert_close(permuted, base[perm], rtol=0, atol=1e-6)


def test_adding_a_candidate_changes_no_other_logit(setup):
    _cfg, model, rng, histories = setup
    cands = random_candidates(rng, 5)
    base = serve(model, None, histories, [Visit(1, 25, cands)])
    more = serve(model, None, histories, [Visit(1, 25, np.append(cands, 12345))])
    torch.testing.assert_close(more[:5], base, rtol=0, atol=1e-6)


def test_candidates_never_enter_the_cache(setup):
    """Serving the same history with different candidates leaves identical cached K/V."""
    cfg, model, rng, histories = setup
    caches = [make_cache(cfg), make_cache(cfg)]
    for cache, n in zip(caches, (1, 9)):
        serve(model, cache, histories, [Visit(2, 30, random_candidates(rng, n))])
    for layer in range(cfg.num_layers):
        for a, b in zip(caches[0].read_kv(2, layer), caches[1].read_kv(2, layer)):
            assert torch.equal(a, b)


def test_batch_composition_does_not_change_logits(setup):
    _cfg, model, rng, histories = setup
    visits = [Visit(u, 20 + 5 * u, random_candidates(rng, 3)) for u in histories]
    together = serve(model, None, histories, visits)
    alone = torch.cat([serve(model, None, histories, [v]) for v in visits])
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-6)


def test_failed_forward_leaves_cache_unchanged_and_next_visit_is_correct(setup, monkeypatch):
    cfg, model, rng, histories = setup
    cache = make_cache(cfg, num_pages=64)
    users = list(histories)
    serve(model, cache, histories, [Visit(u, 10, random_candidates(rng, 2)) for u in users])
    cache.offload_kv_cache([0])
    before = cache_snapshot(cache, users, cfg.num_layers)

    def explode(*args, **kwargs):  # the earlier layers have appended their K/V by now
        raise RuntimeError("injected failure")

    monkeypatch.setattr(model.layers[-1], "forward", explode)
    visits = [Visit(u, 25, random_candidates(rng, 3)) for u in users]
    with pytest.raises(RuntimeError, match="injected failure"):
        serve(model, cache, histories, visits)
    monkeypatch.undo()
    after = cache_snapshot(cache, users, cfg.num_layers)
    assert_same_data(before, after)
    assert after[3].rollbacks == before[3].rollbacks + 1
    assert after[3].pages_in_use == before[3].pages_in_use
    assert_logits_close(serve(model, cache, histories, visits), serve(model, None, histories, visits))


def test_a_kv_store_that_does_not_hold_what_the_batch_continues_is_refused(setup):
    cfg, model, rng, histories = setup
    cache = make_cache(cfg)
    serve(model, cache, histories, [Visit(0, 10, random_candidates(rng, 2))])
    continuing = make_batch(histories, [Visit(0, 20, random_candidates(rng, 2), window_start=0, start=10)])
    cache.invalidate_kv_cache([0])  # the cache no longer holds the 10 events the batch continues
    prefix = cfg.num_prefix_tokens
    meta = cache.prepare_kv_cache([0], [prefix + 10], [10])  # an unguarded prepare: nothing cached
    before = cache_snapshot(cache, [0], cfg.num_layers)
    with pytest.raises(ValueError, match="User 0: batch carries events that do not continue"), torch.inference_mode():
        model(continuing, PagedKV(cache, meta))
    assert_same_data(before, cache_snapshot(cache, [0], cfg.num_layers))
    cache.rollback(meta)
    assert cache.stats().pages_in_use == 0


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda b: dataclasses.replace(b, video_ids=b.video_ids[:-1]), "lengths sum"),
        (lambda b: dataclasses.replace(b, video_ids=-b.video_ids - 1), "negative id"),
        (lambda b: dataclasses.replace(b, action_weights=b.action_weights + 256), "8-bit"),
        (lambda b: dataclasses.replace(b, user_features=b.user_features + 100), "user feature"),
        (lambda b: dataclasses.replace(b, starts=b.starts + 1), "partial window"),
    ],
)
def test_malformed_batches_are_refused_before_touching_the_cache(setup, corrupt, message):
    _cfg, model, rng, histories = setup
    batch = corrupt(make_batch(histories, [Visit(u, 20, random_candidates(rng, 2)) for u in histories]))
    with pytest.raises(ValueError, match=message):
        model(batch)


def test_window_longer_than_the_model_is_refused(setup):
    cfg, model, rng, _ = setup
    histories = random_histories(rng, 1, cfg.max_seq_len + 10, cfg)
    batch = make_batch(histories, [Visit(0, cfg.max_seq_len + 10, random_candidates(rng, 1))])
    with pytest.raises(ValueError, match=r"User 0: .*longer than max_seq_len"):
        model(batch)


def test_checkpoint_round_trip_gives_identical_logits(setup, tmp_path):
    cfg, model, rng, histories = setup
    visits = [Visit(u, 30, random_candidates(rng, 4)) for u in histories]
    save_checkpoint(model, tmp_path, metadata={"note": "test"})
    loaded = load_checkpoint(tmp_path, expected_config=cfg)
    assert loaded.metadata == {"note": "test"}
    assert torch.equal(serve(model, None, histories, visits), serve(loaded.model, None, histories, visits))
    assert model_fingerprint(loaded.model) == model_fingerprint(model)


def test_checkpoint_with_other_config_is_refused(setup, tmp_path):
    cfg, model, _, _ = setup
    save_checkpoint(model, tmp_path)
    with pytest.raises(CheckpointError, match="num_layers: checkpoint has 2, expected 3"):
        load_checkpoint(tmp_path, expected_config=cfg.replace(num_layers=3))


def test_a_checkpoint_served_through_another_attention_window(setup, tmp_path):
    """Same weights, another window: other logits on long histories, another fingerprint (so no K/V of
    one is read by the other), and a window no config accepts refused naming the checkpoint."""
    cfg, model, rng, histories = setup
    visits = [Visit(u, 30, random_candidates(rng, 4)) for u in histories]
    save_checkpoint(model, tmp_path)
    windowed = load_checkpoint(tmp_path, attention_window=4).model
    assert windowed.config == cfg.replace(attention_window=4)
    assert model_fingerprint(windowed) != model_fingerprint(model)
    assert not torch.allclose(serve(windowed, None, histories, visits), serve(model, None, histories, visits))
    with pytest.raises(CheckpointError, match=r"invalid config: .*attention_window must be >= 0"):
        load_checkpoint(tmp_path, attention_window=-1)


def test_missing_or_corrupt_checkpoint_is_refused(setup, tmp_path):
    with pytest.raises(CheckpointError, match="No checkpoint"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "model.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="Cannot read"):
        load_checkpoint(tmp_path)


def test_fingerprint_changes_with_weights(setup):
    cfg, model, _, _ = setup
    other = HSTURecommender(cfg)
    assert model_fingerprint(model) != model_fingerprint(other)


def test_parity_on_every_device(setup, device):
    cfg, model, rng, histories = setup
    model = model.to(device)
    cache = make_cache(cfg, device=device)
    for end in (10, 30, 40):
        visits = [Visit(u, end, random_candidates(rng, 3)) for u in histories]
        assert_logits_close(serve(model, cache, histories, visits).cpu(), serve(model, None, histories, visits).cpu())
