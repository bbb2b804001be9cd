"""A batch padded to a bucket's fixed shapes (what a CUDA graph replays) scores like the exact batch."""
from __future__ import annotations

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
    tiny_config,
)
from helpers import serve as serve_visits
from model.batch_shape import BatchShape
from model.kv_store import PagedKV


@pytest.fixture()
def setup():
    cfg = tiny_config()
    rng = np.random.default_rng(3)
    return cfg, sensitive_model(cfg, 3), rng, random_histories(rng, 5, (20, 60), cfg)


def test_bucket_shapes_round_up_and_hold_their_batch():
    shape = BatchShape.bucket(5, 70, 3)
    assert shape == BatchShape(8, 128, 64) and shape.holds(BatchShape.exact(5, 70, 3))
    assert not BatchShape.exact(5, 70, 3).holds(shape)


def test_full_recompute_in_a_bucket_equals_exact(setup):
    _, model, rng, histories = setup
    visits = [Visit(u, 15 + 3 * u, random_candidates(rng, 1 + u)) for u in histories]
    batch = make_batch(histories, visits)
    with torch.inference_mode():
        exact = model(batch)
        padded = model.run(model.prepare_inputs(batch, shape=BatchShape.bucket(5, 200, 20)))
    assert padded.shape == exact.shape
    assert_logits_close(padded, exact)


def test_paged_visit_in_a_bucket_equals_exact_and_padding_writes_only_the_sink(setup):
    cfg, model, rng, histories = setup
    cache = make_cache(cfg, num_pages=256)
    serve_visits(model, cache, histories, [Visit(u, 10, random_candidates(rng, 2)) for u in histories])
    visits = [Visit(u, 10 + 2 + u, random_candidates(rng, 3), window_start=0, start=10) for u in histories]
    batch = make_batch(histories, visits)
    prefix = cfg.num_prefix_tokens
    users = [v.user_id for v in visits]
    pages_before = [t.clone() for layer in range(cfg.num_layers) for t in (cache.k_cache(layer), cache.v_cache(layer))]

    def forward(shape):
        meta = cache.prepare_kv_cache(users, [prefix + 10] * len(users), [2 + u for u in users],
                                      expected_cached_lengths=[prefix + 10] * len(users))
        kv = PagedKV(cache, meta)
        with torch.inference_mode():
            logits = model.run(model.prepare_inputs(batch, kv, shape), kv)
        cache.rollback(meta)
        return logits, set(meta.page_indices.tolist())

    exact, _ = forward(None)
    padded, users_pages = forward(BatchShape.bucket(len(users), 100, 30))
    assert_logits_close(padded, exact)
    sink_page = cache.sink_slot // cache.config.page_size
    pages_after = [t for layer in range(cfg.num_layers) for t in (cache.k_cache(layer), cache.v_cache(layer))]
    for before, after in zip(pages_before, pages_after):
        changed = set((after != before).flatten(1).any(1).nonzero().flatten().tolist())
        assert sink_page in changed  # the padding rows' K/V went there...
        assert changed <= users_pages | {sink_page}  # ...and nowhere but the batch's own pages
