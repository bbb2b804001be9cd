"""Batched HSTU attention (model/attention) against a dense per-user reference, paged and contiguous."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import dense_hstu_reference
from model.attention import BatchAttention, attend, host_inputs
from model.attention.plan import KeyAddressing, plan_attention

H, D, ALPHA, N = 2, 8, 0.3, 64.0


def _batch(rng, cached, new, cands, page_size, dtype=torch.float64):
    """Random q/k/v rows and, when page_size > 0, a shuffled page pool holding every user's window."""
    B = len(cached)
    n_hist, M = sum(new), sum(cands)
    t = lambda rows: torch.randn(rows, H, D, dtype=dtype)
    q, k, v = t(n_hist + M), t(n_hist + M), t(n_hist + M)
    windows = [(t(c), t(c)) for c in cached]  # the cached part of each user's window
    hist_off = np.concatenate([[0], np.cumsum(new)])
    if page_size == 0:
        assert not any(cached)
        return q, k, v, windows, KeyAddressing(0), k, v
    pages_needed = [-(-(c + n) // page_size) for c, n in zip(cached, new)]
    num_pages = sum(pages_needed) + 3
    order = rng.permutation(num_pages)[: sum(pages_needed)]  # non-contiguous, shuffled pages
    indptr = np.concatenate([[0], np.cumsum(pages_needed)]).astype(np.int64)
    pool_k = torch.full((num_pages * page_size, H, D), float("nan"), dtype=dtype)  # unused slots poison
    pool_v = pool_k.clone()
    for b in range(B):
        window_k = torch.cat([windows[b][0], k[hist_off[b]:hist_off[b + 1]]])
        window_v = torch.cat([windows[b][1], v[hist_off[b]:hist_off[b + 1]]])
        for j in range(len(window_k)):
            slot = order[indptr[b] + j // page_size] * page_size + j % page_size
            pool_k[slot], pool_v[slot] = window_k[j], window_v[j]
    return q, k, v, windows, KeyAddressing(page_size, indptr, order.astype(np.int64)), pool_k, pool_v


@pytest.mark.parametrize("page_size", [0, 1, 4, 16])
@pytest.mark.parametrize("query_block, key_block", [(4, 8), (128, 256), (3, 5)])
def test_batched_attention_matches_the_dense_reference(page_size, query_block, key_block):
    rng = np.random.default_rng(page_size * 7 + query_block)
    torch.manual_seed(query_block)
    cached = [0] * 5 if page_size == 0 else [0, 20, 50, 3, 9]
    new, cands = [1, 13, 0, 16, 40], [1, 3, 4, 0, 7]  # no new events; no candidates
    q, k, v, windows, addressing, keys, values = _batch(rng, cached, new, cands, page_size)
    plan = plan_attention(np.array(new), np.array(cands), np.array(cached), addressing,
                          query_block=query_block, key_block=key_block)
    attention = BatchAttention.from_device(plan, {name: torch.from_numpy(a) for name, a in host_inputs(plan).items()})
    out = attend(q, k, v, keys, values, attention, candidates_only=False, alpha=ALPHA, normalizer=N)
    cand_only = attend(q, k, v, keys, values, attention, candidates_only=True, alpha=ALPHA, normalizer=N)

    n_hist, hist_off, cand_off = sum(new), np.cumsum([0, *new]), np.cumsum([0, *cands])
    for b in range(len(new)):
        h, c = slice(hist_off[b], hist_off[b + 1]), slice(n_hist + cand_off[b], n_hist + cand_off[b + 1])
        ref_hist, ref_cand = dense_hstu_reference(
            q[h], q[c], k[c], v[c], torch.cat([windows[b][0], k[h]]), torch.cat([windows[b][1], v[h]]),
            cached[b], ALPHA, N,
        )
        torch.testing.assert_close(out[h], ref_hist)
        torch.testing.assert_close(out[c], ref_cand)
        torch.testing.assert_close(cand_only[c], ref_cand)
    assert not out.isnan().any()  # padding never reads an unused (NaN) page slot into a sum


def test_masked_blocks_are_never_visited():
    """Causal history: a query block's pairs reach only to its last row's keys."""
    plan = plan_attention(np.array([64]), np.array([0]), np.array([0]), KeyAddressing(0), query_block=16, key_block=16)
    assert plan.all_rows.num_pairs == 1 + 2 + 3 + 4  # the lower triangle of 4 x 4 blocks
    assert plan.candidate_rows.num_pairs == 0
