"""Batched HSTU attention (model/attention) against a dense per-user reference, paged and contiguous."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import paged_attention_case
from model.attention import (
    AttentionBatch,
    BatchAttention,
    BlockedAttention,
    KeyAddressing,
    KeyWindow,
    attend,
    host_inputs,
)
from model.attention.blocked_schedule import QUERY_BLOCKS, query_block_for

H, D, ALPHA, N = 2, 8, 0.3, 64.0


@pytest.mark.parametrize("page_size", [0, 1, 4, 16])
@pytest.mark.parametrize("query_block, key_block", [(4, 8), (128, 256), (3, 5), (None, None)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_batched_attention_matches_the_dense_reference(page_size, query_block, key_block, with_bias):
    rng = np.random.default_rng(page_size * 7 + (query_block or 1))
    cached = [0] * 5 if page_size == 0 else [0, 20, 50, 3, 9]
    new, cands = [1, 13, 0, 16, 40], [1, 3, 4, 0, 7]  # no new events; no candidates
    case = paged_attention_case(rng, cached, new, cands, page_size, heads=H, head_dim=D)
    _check(case, BlockedAttention(query_block, key_block), with_bias)


@pytest.mark.parametrize("key_window", [KeyWindow(1), KeyWindow(6), KeyWindow(9, sink=2), KeyWindow(5, sink=11),
                                        KeyWindow(30, sink=1)])
@pytest.mark.parametrize("page_size", [0, 4])
@pytest.mark.parametrize("query_block, key_block", [(4, 8), (3, 5), (None, None)])
def test_a_key_window_sees_its_last_keys_and_the_sink(key_window, page_size, query_block, key_block):
    rng = np.random.default_rng(key_window.size + page_size)
    cached = [0] * 3 if page_size == 0 else [0, 40, 17]
    case = paged_attention_case(rng, cached, [30, 13, 2], [2, 3, 4], page_size, heads=H, head_dim=D)
    case.key_window = key_window
    _check(case, BlockedAttention(query_block, key_block), with_bias=True)


def test_a_key_window_skips_the_key_blocks_before_it():
    """A cached visit of a long window visits only the blocks of its last keys and of the sink."""
    window = AttentionBatch.of([10], [64], [2000], KeyAddressing(0), key_window=KeyWindow(100, sink=2))
    plan = BlockedAttention(query_block=16, key_block=64).plan(window)
    visited = np.unique(plan.candidate_rows.key_positions[plan.candidate_rows.key_positions < 1 << 40] // 64)
    assert visited.tolist() == [0, *range((2010 - 100) // 64, -(-2010 // 64))]


def _check(case, backend, with_bias):
    q, k, v, keys, values = case.q, case.k, case.v, case.keys, case.values
    batch = AttentionBatch.of(case.new, case.cands, case.cached, case.addressing, key_window=case.key_window)
    plan = backend.plan(batch)
    attention = BatchAttention.from_device(plan, {name: torch.from_numpy(a) for name, a in host_inputs(plan).items()})
    bias = dict(bias=case.bias, bias_inputs=case.bias_inputs()) if with_bias else {}
    out = attend(q, k, v, keys, values, attention, candidates_only=False, alpha=ALPHA, normalizer=N, **bias)
    cand_only = attend(q, k, v, keys, values, attention, candidates_only=True, alpha=ALPHA, normalizer=N, **bias)
    for b in range(len(case.new)):
        h, c = case.rows(b)
        ref_hist, ref_cand = case.reference(b, with_bias)
        torch.testing.assert_close(out[h], ref_hist)
        torch.testing.assert_close(out[c], ref_cand)
        torch.testing.assert_close(cand_only[c], ref_cand)
    assert not out.isnan().any()  # padding never reads an unused (NaN) page slot into a sum


def test_masked_blocks_are_never_visited():
    """Causal history: a query block's pairs reach only to its last row's keys."""
    plan = BlockedAttention(query_block=16, key_block=16).plan(AttentionBatch.of([64], [0], [0], KeyAddressing(0)))
    assert plan.all_rows.num_pairs == 1 + 2 + 3 + 4  # the lower triangle of 4 x 4 blocks
    assert plan.candidate_rows.num_pairs == 0


def test_query_blocks_follow_the_batch_so_cached_visits_pad_little():
    # A cached visit (10 new events, 64 candidates over ~1,000 cached keys) and its candidates-only
    # schedule get blocks that fit them; full recompute of a long window gets large blocks.
    cached_visit, full_window = query_block_for(np.array([74] * 8), np.full(8, 1000)), query_block_for(
        np.array([2112]), np.array([2048]))
    candidates_only = query_block_for(np.array([64] * 8), np.full(8, 1000))
    assert cached_visit < full_window == max(QUERY_BLOCKS)
    assert candidates_only == 64  # exactly one block per user, nothing padded
    plan = BlockedAttention().plan(AttentionBatch.of([10, 10], [64, 64], [900, 1100], KeyAddressing(0)))
    assert plan.candidate_rows.block_rows.shape[1] == 64
    assert plan.all_rows.block_rows.shape[1] == cached_visit
