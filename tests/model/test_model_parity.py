"""The parity contract: cached (incremental) logits == full-recompute logits, many ways."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import (
    Visit,
    assert_logits_close,
    make_cache,
    random_candidates,
    random_histories,
    random_tag_table,
    sensitive_model,
    serve,
    tagged_model,
    tiny_config,
)


def random_splits(rng: np.random.Generator, length: int, max_chunk: int) -> list[int]:
    """Visit ends for a history of `length` events, chunks of 1..max_chunk events."""
    ends, end = [], 0
    while end < length:
        end = min(length, end + int(rng.integers(1, max_chunk + 1)))
        ends.append(end)
    return ends


def replay_and_compare(model, cache, histories, rng, max_chunk, candidates=(1, 6), between_rounds=None):
    """Serve every user's visits in random interleaved rounds; compare each round with full recompute."""
    splits = {u: random_splits(rng, len(h.video_ids), max_chunk) for u, h in histories.items()}
    progress = {u: 0 for u in histories}
    rounds = 0
    while any(progress[u] < len(splits[u]) for u in histories):
        pending = [u for u in histories if progress[u] < len(splits[u])]
        chosen = rng.choice(pending, size=int(rng.integers(1, len(pending) + 1)), replace=False)
        visits = [Visit(int(u), splits[u][progress[u]], random_candidates(rng, int(rng.integers(*candidates))))
                  for u in chosen]
        assert_logits_close(serve(model, cache, histories, visits), serve(model, None, histories, visits))
        for u in chosen:
            progress[u] += 1
        if between_rounds is not None:
            between_rounds(cache, rng, list(histories))
        rounds += 1
    return rounds


def shuffle_tiers(cache, rng, users):
    """Between visits: offload some users, evict some from the device, sometimes everything."""
    action = rng.integers(0, 4)
    some = [int(u) for u in rng.choice(users, size=max(1, len(users) // 2), replace=False)]
    if action == 0:
        cache.offload_kv_cache(some)
    elif action == 1:
        cache.offload_kv_cache(some)
        cache.evict_kv_cache(some)
    elif action == 2:
        cache.offload_kv_cache()
        cache.evict_kv_cache()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("use_prefix", [True, False])
def test_random_visit_splits_match_full_recompute(seed, use_prefix, device):
    cfg = tiny_config(use_contextual_prefix=use_prefix)
    model = sensitive_model(cfg, seed).to(device)
    rng = np.random.default_rng(seed)
    histories = random_histories(rng, 6, (1, 40), cfg)
    cache = make_cache(cfg, num_pages=200, device=device)
    rounds = replay_and_compare(model, cache, histories, rng, max_chunk=3 * cfg.page_size)
    assert rounds >= 2
    assert cache.stats().tokens_reused > 0


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_parity_under_eviction_offload_and_reload(page_size, device):
    cfg = tiny_config()
    model = sensitive_model(cfg, 1).to(device)
    rng = np.random.default_rng(page_size)
    histories = random_histories(rng, 8, (10, 60), cfg)
    # A device pool far below the working set: serving forces evictions and reloads.
    cache = make_cache(cfg, num_pages=(3 * 64 + 24) // page_size + 8, page_size=page_size, device=device)
    replay_and_compare(model, cache, histories, rng, max_chunk=20, between_rounds=shuffle_tiers)
    stats = cache.stats()
    assert stats.device_evictions > 0 and stats.onloaded_bytes > 0


def test_parity_across_window_restarts(device):
    cfg = tiny_config(max_seq_len=40, window_stride=8)  # 3 prefix tokens + 37 events per window
    model = sensitive_model(cfg, 2).to(device)
    rng = np.random.default_rng(2)
    histories = random_histories(rng, 4, (90, 130), cfg)
    cache = make_cache(cfg, num_pages=200, device=device)
    replay_and_compare(model, cache, histories, rng, max_chunk=12)
    assert any(int(model.layout.window_start(np.array([len(h.video_ids)]))[0]) > 0 for h in histories.values())


def _backends():
    from model.attention import triton_attention

    return ["blocked", pytest.param("triton", marks=pytest.mark.skipif(not triton_attention.available(),
                                                                          reason="triton is not installed"))]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("window", [1, 5, 17])
def test_parity_with_a_sliding_attention_window(window, backend, device):
    """A windowed model's cached K/V stay exact: any split of a history into visits, under offload,
    eviction and reload, on both attention backends."""
    cfg = tiny_config(attention_window=window)
    model = sensitive_model(cfg, window).to(device)
    model.attention_backend = backend
    rng = np.random.default_rng(window)
    histories = random_histories(rng, 5, (10, 60), cfg)
    cache = make_cache(cfg, num_pages=(2 * 64 + 24) // cfg.page_size + 8, device=device)
    replay_and_compare(model, cache, histories, rng, max_chunk=20, between_rounds=shuffle_tiers)
    assert cache.stats().tokens_reused > 0


def test_a_window_as_long_as_the_history_changes_nothing_and_a_shorter_one_does(device):
    cfg = tiny_config()
    rng = np.random.default_rng(3)
    histories = random_histories(rng, 4, (30, 50), cfg)
    visits = [Visit(u, len(h.video_ids), random_candidates(rng, 4)) for u, h in histories.items()]

    def scores(window):
        model = sensitive_model(cfg.replace(attention_window=window), 3).to(device)
        return serve(model, None, histories, visits)

    whole = scores(0)
    assert_logits_close(scores(50), whole)
    assert not torch.allclose(scores(8), whole, atol=1e-3)


def test_bf16_within_documented_tolerance_of_fp32():
    cfg = tiny_config()
    model = sensitive_model(cfg, 3)
    rng = np.random.default_rng(3)
    histories = random_histories(rng, 4, (30, 50), cfg)
    model_bf16 = sensitive_model(cfg, 3).to(torch.bfloat16)
    cache = make_cache(cfg, num_pages=200, dtype=torch.bfloat16)
    for end in (10, 25, 30):
        visits = [Visit(u, end, random_candidates(rng, 4)) for u in histories]
        cached_bf16 = serve(model_bf16, cache, histories, visits)
        full_fp32 = serve(model, None, histories, visits)
        # bf16 keeps 8 mantissa bits: documented tolerance is 5% of the logit scale.
        assert_logits_close(cached_bf16, full_fp32, rel=5e-2)


def test_corrupted_cache_is_caught_by_parity():
    """The comparison has teeth: one changed cached key moves the logits past tolerance."""
    cfg = tiny_config()
    model = sensitive_model(cfg, 4)
    rng = np.random.default_rng(4)
    histories = random_histories(rng, 1, 30, cfg)
    cache = make_cache(cfg)
    cands = random_candidates(rng, 4)
    serve(model, cache, histories, [Visit(0, 20, cands)])
    meta = cache.prepare_kv_cache([0], [cfg.num_prefix_tokens + 20], [0])  # where the cached tokens live
    cache.rollback(meta)
    cache.k_cache(0).view(-1, cfg.num_heads, cfg.head_dim)[meta.kv_slots[5]] += 1.0
    visits = [Visit(0, 30, cands)]
    with pytest.raises(AssertionError, match="max \\|cached - full\\|"):
        assert_logits_close(serve(model, cache, histories, visits), serve(model, None, histories, visits))


def test_parity_when_attention_runs_in_many_blocks(monkeypatch):
    import model.attention.blocked_schedule as schedule

    monkeypatch.setattr(schedule, "QUERY_BLOCKS", (8,))  # full recompute now spans many blocks, visits few
    monkeypatch.setattr(schedule, "KEY_BLOCK", 4)
    cfg = tiny_config()
    model = sensitive_model(cfg, 5)
    rng = np.random.default_rng(5)
    histories = random_histories(rng, 4, (30, 70), cfg)
    replay_and_compare(model, make_cache(cfg, num_pages=200), histories, rng, max_chunk=20)


def test_parity_without_absolute_positions(device):
    """`position_table_size = 1` (every token reads one position row; order only through the relative bias)."""
    cfg = tiny_config(position_table_size=1)
    model = sensitive_model(cfg, 5).to(device)
    rng = np.random.default_rng(5)
    histories = random_histories(rng, 6, (1, 40), cfg)
    cache = make_cache(cfg, num_pages=200, device=device)
    assert replay_and_compare(model, cache, histories, rng, max_chunk=3 * cfg.page_size) >= 2
    assert cache.stats().tokens_reused > 0


@pytest.mark.parametrize("backend", _backends())
def test_parity_with_the_tag_match_bias(backend, device):
    """A cached key's tag travels packed in its slot's stamp: the tag-match term between new queries and
    cached keys is exact for any split into visits, under offload, eviction and reload, on both backends."""
    rng = np.random.default_rng(7)
    model = tagged_model(7, random_tag_table(rng, num_tags=3), tag_match_bias=True).to(device)
    model.attention_backend = backend
    histories = random_histories(rng, 6, (5, 50), model.config)
    cache = make_cache(model.config, num_pages=64, device=device)
    assert replay_and_compare(model, cache, histories, rng, max_chunk=12, between_rounds=shuffle_tiers) >= 2
    assert cache.stats().tokens_reused > 0


def test_the_tag_match_term_moves_scores_and_a_zero_one_changes_nothing(device):
    """Peer sanity: with its table at zero, a tag-matching model scores exactly as the same weights
    without the term; with the table set, the scores move."""
    rng = np.random.default_rng(4)
    table = random_tag_table(rng, num_tags=3)
    plain, matching = tagged_model(4, table), tagged_model(4, table, tag_match_bias=True)
    matching.load_state_dict(plain.state_dict(), strict=False)
    histories = random_histories(rng, 4, (10, 40), plain.config)
    visits = [Visit(u, len(h.video_ids), random_candidates(rng, 5)) for u, h in histories.items()]
    plain, matching = plain.to(device), matching.to(device)
    with torch.no_grad():
        for layer in matching.layers:
            layer.relative_bias.tag_match.zero_()
    assert torch.equal(serve(matching, None, histories, visits), serve(plain, None, histories, visits))
    with torch.no_grad():
        for layer in matching.layers:
            layer.relative_bias.tag_match.fill_(2.0)
    assert not torch.allclose(serve(matching, None, histories, visits), serve(plain, None, histories, visits),
                              atol=1e-3)


def test_cached_scores_equal_full_recompute_with_tags(device):
    rng = np.random.default_rng(2)
    model = tagged_model(2, random_tag_table(rng)).to(device)
    histories = random_histories(rng, 6, (5, 50), model.config)
    cache = make_cache(model.config, num_pages=64, device=device)
    assert replay_and_compare(model, cache, histories, rng, max_chunk=12, between_rounds=shuffle_tiers) >= 2
    assert cache.stats().tokens_reused > 0
