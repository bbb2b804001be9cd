"""The Triton paged HSTU attention kernel against the dense reference, on CPU through Triton's
interpreter (TRITON_INTERPRET=1), at small shapes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import (
    Visit,
    assert_logits_close,
    dense_hstu_reference,
    make_cache,
    paged_attention_case,
    random_candidates,
    random_histories,
    sensitive_model,
    serve,
    tiny_config,
)
from model.attention import BatchAttention, attend, host_inputs
from model.attention.plan import plan_attention
from model.batch_shape import BatchShape

triton_attention = pytest.importorskip("model.attention.triton_attention")
if not triton_attention.available():
    pytest.skip("triton is not installed", allow_module_level=True)

H, D, ALPHA, N = 2, 16, 0.3, 64.0


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU: Triton's interpreter (tests/conftest.py)


def _run(case, candidates_only, shape=None, splits=1, page_capacity=None):
    plan = plan_attention(np.array(case.new), np.array(case.cands), np.array(case.cached), case.addressing,
                          shape=shape, backend="triton", splits=splits, page_capacity=page_capacity)
    arrays = {name: torch.from_numpy(a).to(DEVICE) for name, a in host_inputs(plan).items()}
    attention = BatchAttention.from_device(plan, arrays)
    q, k, v = case.q.to(DEVICE), case.k.to(DEVICE), case.v.to(DEVICE)
    if shape is not None:  # candidates start at the bucket's history capacity
        pad = lambda t: torch.cat([t[: sum(case.new)], t.new_zeros(shape.history_rows - sum(case.new), H, D),
                                   t[sum(case.new):], t.new_zeros(shape.candidate_rows - sum(case.cands), H, D)])
        q, k, v = pad(q), pad(k), pad(v)
        keys, values = (case.keys.to(DEVICE), case.values.to(DEVICE)) if case.addressing.paged else (k, v)
    else:
        keys, values = case.keys.to(DEVICE), case.values.to(DEVICE)
    out = attend(q, k, v, keys, values, attention, candidates_only=candidates_only, alpha=ALPHA, normalizer=N)
    if shape is not None:
        n_hist = sum(case.new)
        out = torch.cat([out[:n_hist], out[shape.history_rows : shape.history_rows + sum(case.cands)]])
    return out.cpu()


def _check(case, out, candidates_only, atol=1e-5, rtol=1e-5):
    n_hist, hist_off, cand_off = sum(case.new), np.cumsum([0, *case.new]), np.cumsum([0, *case.cands])
    for b in range(len(case.new)):
        h, c = slice(hist_off[b], hist_off[b + 1]), slice(n_hist + cand_off[b], n_hist + cand_off[b + 1])
        ref_hist, ref_cand = dense_hstu_reference(
            case.q[h].double(), case.q[c].double(), case.k[c].double(), case.v[c].double(),
            torch.cat([case.windows[b][0], case.k[h]]).double(), torch.cat([case.windows[b][1], case.v[h]]).double(),
            case.cached[b], ALPHA, N,
        )
        if not candidates_only:
            torch.testing.assert_close(out[h].double(), ref_hist, atol=atol, rtol=rtol)
        torch.testing.assert_close(out[c].double(), ref_cand, atol=atol, rtol=rtol)


@pytest.mark.parametrize("page_size", [0, 1, 4, 16])
@pytest.mark.parametrize("candidates_only", [False, True])
def test_kernel_matches_the_dense_reference(page_size, candidates_only):
    # ragged lengths, a user with no new events, one with no candidates, one with nothing at all
    cached = [0] * 5 if page_size == 0 else [0, 70, 3, 0, 9]
    case = paged_attention_case(np.random.default_rng(page_size), cached, new=[1, 0, 66, 0, 5], cands=[3, 4, 0, 0, 2],
                                page_size=page_size, heads=H, head_dim=D, dtype=torch.float32)
    _check(case, _run(case, candidates_only), candidates_only)


@pytest.mark.parametrize("splits", [2, 3])
def test_split_key_ranges_add_up(splits):
    case = paged_attention_case(np.random.default_rng(9), [150, 40], new=[3, 70], cands=[5, 1], page_size=16,
                                heads=H, head_dim=D, dtype=torch.float32)
    _check(case, _run(case, False, splits=splits), False)


def test_bucketed_shape_with_padding_users_and_tiles():
    case = paged_attention_case(np.random.default_rng(4), [20, 0, 7], new=[5, 9, 0], cands=[2, 3, 4], page_size=4,
                                heads=H, head_dim=D, dtype=torch.float32)
    shape = BatchShape.bucket(3, sum(case.new), sum(case.cands))
    _check(case, _run(case, False, shape=shape, page_capacity=64), False)


def test_bfloat16_inputs_accumulate_in_fp32():
    case = paged_attention_case(np.random.default_rng(2), [33, 0], new=[4, 20], cands=[6, 2], page_size=16,
                                heads=H, head_dim=D, dtype=torch.bfloat16)
    _check(case, _run(case, False), False, atol=2e-2, rtol=2e-2)


def test_the_launch_reads_nothing_back_from_the_device():
    from model.op_counter import OpCounter

    case = paged_attention_case(np.random.default_rng(5), [10], new=[3], cands=[2], page_size=4,
                                heads=H, head_dim=D, dtype=torch.float32)
    with OpCounter() as ops:
        _run(case, False, splits=2)
    assert not ops.syncs, ops.syncs


def _visits(rng, histories, end):
    return [Visit(u, min(end + u, len(h.video_ids)), random_candidates(rng, 3)) for u, h in histories.items()]


@pytest.mark.parametrize("bucketed", [False, True])
def test_the_model_scores_the_same_through_the_kernel(bucketed):
    """Full recompute and cached visits through the Triton backend equal the blocked torch path."""
    cfg = tiny_config()
    model = sensitive_model(cfg, 1).to(DEVICE)
    rng = np.random.default_rng(1)
    histories = random_histories(rng, 3, (30, 90), cfg)
    cache = make_cache(cfg, num_pages=256, device=DEVICE)

    def forward(batch, kv):
        return model.run(model.prepare_inputs(batch, kv, bucketed=bucketed), kv)

    for end in (20, 45, 70):
        visits = _visits(rng, histories, end)
        model.attention_backend = "blocked"
        reference = serve(model, None, histories, visits)
        model.attention_backend = "triton"
        assert_logits_close(serve(model, None, histories, visits), reference)
        assert_logits_close(serve(model, cache, histories, visits, forward=forward), reference)
