"""The Triton paged HSTU attention kernel against the dense reference, on CPU through Triton's
interpreter (TRITON_INTERPRET=1), at small shapes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import (
    Visit,
    assert_logits_close,
    make_cache,
    paged_attention_case,
    random_candidates,
    random_histories,
    sensitive_model,
    serve,
    tiny_config,
)
from model.attention import (
    AttentionBatch,
    BatchAttention,
    BiasInputs,
    KeyWindow,
    TritonAttention,
    attend,
    host_inputs,
)
from model.attention.relative_bias import NO_TIME
from model.batch_shape import BatchShape

triton_attention = pytest.importorskip("model.attention.triton_attention")
if not triton_attention.available():
    pytest.skip("triton is not installed", allow_module_level=True)

H, D, ALPHA, N = 2, 16, 0.3, 64.0


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU: Triton's interpreter (tests/conftest.py)


def _run(case, candidates_only, shape=None, splits=1, max_seq_len=None, with_bias=True):
    """The kernel on `case`; with `shape`, bucketed (page table sized for windows up to `max_seq_len`)."""
    backend = TritonAttention(case.q.shape[1], max_seq_len or 4096, splits=splits)
    batch = AttentionBatch.of(case.new, case.cands, case.cached, case.addressing, shape, bucketed=shape is not None,
                              key_window=case.key_window)
    plan = backend.plan(batch)
    arrays = {name: torch.from_numpy(a).to(DEVICE) for name, a in host_inputs(plan).items()}
    attention = BatchAttention.from_device(plan, arrays)
    q, k, v = case.q.to(DEVICE), case.k.to(DEVICE), case.v.to(DEVICE)
    bias_inputs = case.bias_inputs(DEVICE)
    if shape is not None:  # candidates start at the bucket's history capacity
        n_hist, M = sum(case.new), sum(case.cands)

        def pad(t, fill=0):
            gap = lambda rows: t.new_full((rows, *t.shape[1:]), fill)
            return torch.cat([t[:n_hist], gap(shape.history_rows - n_hist), t[n_hist : n_hist + M],
                              gap(shape.candidate_rows - M + (len(t) - n_hist - M))])

        q, k, v = pad(q), pad(k), pad(v)
        query_stamps = pad(bias_inputs.query_stamps, NO_TIME)
        bias_inputs = BiasInputs(query_stamps, bias_inputs.key_stamps if case.addressing.paged else query_stamps)
        keys, values = (case.keys.to(DEVICE), case.values.to(DEVICE)) if case.addressing.paged else (k, v)
    else:
        keys, values = case.keys.to(DEVICE), case.values.to(DEVICE)
    bias = dict(bias=case.bias.to(DEVICE), bias_inputs=bias_inputs) if with_bias else {}
    out = attend(q, k, v, keys, values, attention, candidates_only=candidates_only, alpha=ALPHA, normalizer=N, **bias)
    if shape is not None:
        n_hist = sum(case.new)
        out = torch.cat([out[:n_hist], out[shape.history_rows : shape.history_rows + sum(case.cands)]])
    return out.cpu()


def _check(case, out, candidates_only, with_bias=True, atol=1e-5, rtol=1e-5):
    for b in range(len(case.new)):
        h, c = case.rows(b)
        ref_hist, ref_cand = case.reference(b, with_bias)
        if not candidates_only:
            torch.testing.assert_close(out[h].double(), ref_hist, atol=atol, rtol=rtol)
        torch.testing.assert_close(out[c].double(), ref_cand, atol=atol, rtol=rtol)


@pytest.mark.parametrize("page_size", [0, 1, 4, 16])
@pytest.mark.parametrize("candidates_only", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_the_dense_reference(page_size, candidates_only, with_bias):
    # ragged lengths, a user with no new events, one with no candidates, one with nothing at all
    cached = [0] * 5 if page_size == 0 else [0, 70, 3, 0, 9]
    case = paged_attention_case(np.random.default_rng(page_size), cached, new=[1, 0, 66, 0, 5], cands=[3, 4, 0, 0, 2],
                                page_size=page_size, heads=H, head_dim=D, dtype=torch.float32)
    _check(case, _run(case, candidates_only, with_bias=with_bias), candidates_only, with_bias)


@pytest.mark.parametrize("splits", [2, 3])
def test_split_key_ranges_add_up(splits):
    case = paged_attention_case(np.random.default_rng(9), [150, 40], new=[3, 70], cands=[5, 1], page_size=16,
                                heads=H, head_dim=D, dtype=torch.float32)
    _check(case, _run(case, False, splits=splits), False)


@pytest.mark.parametrize("key_window", [KeyWindow(1), KeyWindow(10), KeyWindow(70, sink=3), KeyWindow(40, sink=65),
                                        KeyWindow(500, sink=2)])
@pytest.mark.parametrize("page_size, splits", [(0, 1), (16, 1), (16, 3)])
def test_a_key_window_sees_its_last_keys_and_the_sink(key_window, page_size, splits):
    """Sliding-window attention: tiles start at their first row's window (skipping whole key blocks of a
    long window), visit the sink's blocks, and split what is left; every row against the reference."""
    cached = [0, 0] if page_size == 0 else [150, 40]
    case = paged_attention_case(np.random.default_rng(len(cached) + key_window.size), cached, new=[3, 140],
                                cands=[5, 2], page_size=page_size, heads=H, head_dim=D, dtype=torch.float32)
    case.key_window = key_window
    for candidates_only in (False, True):
        _check(case, _run(case, candidates_only, splits=splits), candidates_only)


def test_bucketed_shape_with_padding_users_and_tiles():
    case = paged_attention_case(np.random.default_rng(4), [20, 0, 7], new=[5, 9, 0], cands=[2, 3, 4], page_size=4,
                                heads=H, head_dim=D, dtype=torch.float32)
    shape = BatchShape.bucket(3, sum(case.new), sum(case.cands))
    _check(case, _run(case, False, shape=shape, max_seq_len=64), False)


def test_bfloat16_inputs_accumulate_in_fp32():
    case = paged_attention_case(np.random.default_rng(2), [33, 0], new=[4, 20], cands=[6, 2], page_size=16,
                                heads=H, head_dim=D, dtype=torch.bfloat16)
    _check(case, _run(case, False), False, atol=2e-2, rtol=2e-2)


def test_kernel_buckets_equal_torch_buckets():
    """The kernel's bucket arithmetic (float32 bits in registers) agrees with relative_bias.log_bucket and
    time_bucket on every distance it can meet, so both backends bias every pair alike."""
    import triton
    import triton.language as tl

    from model.attention.relative_bias import POSITION_SUBDIVISION, log_bucket, time_bucket
    from model.attention.token_stamp import STAMP_TIME_MASK

    @triton.jit
    def buckets(DIST, QT, KT, POS, TIME, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        d = tl.load(DIST + i, mask=mask, other=0)
        tl.store(POS + i, triton_attention._log_bucket(d, triton_attention.POSITION_SHIFT,
                                                       triton_attention.POSITION_EXACT,
                                                       triton_attention.POSITION_OFFSET, 81), mask=mask)
        qt, kt = tl.load(QT + i, mask=mask, other=0), tl.load(KT + i, mask=mask, other=0)
        seconds = tl.maximum(qt - kt, 0) // triton_attention.MS_PER_SECOND
        b = triton_attention._log_bucket(seconds, triton_attention.TIME_SHIFT, triton_attention.TIME_EXACT,
                                         triton_attention.TIME_OFFSET, 92)
        tl.store(TIME + i, tl.where((qt < 0) | (kt < 0), 92, b), mask=mask)

    rng = np.random.default_rng(0)
    powers = np.array([1 << e for e in range(40)], dtype=np.int64)
    distance = np.concatenate([np.arange(-3, 300), powers - 1, powers, powers + 1, rng.integers(0, 1 << 40, 2000)])
    key_times = 1_650_000_000_000 + rng.integers(-10, 10**10, len(distance))
    query_times = key_times + distance * rng.choice([1, 999, 1000, 1001], len(distance))
    query_times = np.minimum(query_times, STAMP_TIME_MASK)  # the latest time a stamp holds (more would be tag bits)
    query_times[::97], key_times[::89] = NO_TIME, NO_TIME
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(DEVICE)
    pos, time = t(np.zeros(len(distance))), t(np.zeros(len(distance)))
    buckets[(-(-len(distance) // 256),)](t(distance), t(query_times), t(key_times), pos, time, len(distance), BLOCK=256)
    assert torch.equal(pos.cpu(), log_bucket(t(distance).cpu(), POSITION_SUBDIVISION, 81))
    assert torch.equal(time.cpu(), time_bucket(t(query_times).cpu(), t(key_times).cpu(), 92))


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


def test_split_counts_are_few_powers_of_two_within_the_key_blocks():
    """Each distinct NUM_SPLITS is a kernel compile: a sweep over batch shapes and GPUs yields only
    powers of two up to MAX_SPLITS, never more splits than key blocks, and more splits for fewer tiles."""
    seen = set()
    for num_sms in (1, 78, 114, 132):
        for tiles in (1, 2, 3, 5, 17, 64, 250, 1000):
            for heads in (1, 4, 8):
                for max_keys in (1, 63, 64, 65, 200, 1000, 4096, 100_000):
                    splits = triton_attention.split_count(tiles, heads, max_keys, num_sms)
                    key_blocks = -(-max_keys // triton_attention.BLOCK_N)
                    assert splits & (splits - 1) == 0 and 1 <= splits <= min(triton_attention.MAX_SPLITS, key_blocks)
                    seen.add(splits)
    assert seen == {1 << i for i in range(triton_attention.MAX_SPLITS.bit_length())}
    assert triton_attention.split_count(1, 1, 100_000, 132) == triton_attention.MAX_SPLITS
    assert triton_attention.split_count(1000, 8, 100_000, 132) == 1


@pytest.mark.parametrize(("head_dim", "page_size", "splits"), [(64, 32, 1), (128, 32, 4), (64, 64, 2), (128, 64, 1)])
def test_kernel_at_production_head_dims_and_page_sizes(head_dim, page_size, splits):
    """The presets' head dims (64: demo, 128: kuairand-1k) and serving page sizes, a window of ~1,000
    cached keys, several splits, with the bias, against the float64 dense reference."""
    rng = np.random.default_rng(head_dim + page_size)
    case = paged_attention_case(rng, [1_000, 37], new=[3, 40], cands=[8, 5], page_size=page_size, heads=4,
                                head_dim=head_dim, dtype=torch.float32)
    _check(case, _run(case, False, splits=splits), False, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("head_dim", "page_size", "splits", "dtype"), [
    (128, 32, 16, torch.float32), (64, 64, 4, torch.float32), (128, 32, 2, torch.bfloat16),
])
def test_kernel_over_a_window_at_max_seq_len(head_dim, page_size, splits, dtype):
    """A window 4 keys short of the presets' max_seq_len (4,084 cached + 8 new keys) beside a short one, split
    across programs, with the bias, against the float64 reference (bf16: the kernel's bf16 inputs upcast there)."""
    rng = np.random.default_rng(head_dim * page_size + splits)
    case = paged_attention_case(rng, [4_084, 30], new=[8, 2], cands=[4, 3], page_size=page_size, heads=1,
                                head_dim=head_dim, dtype=dtype)
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    _check(case, _run(case, False, splits=splits), False, atol=tolerance, rtol=tolerance)


def test_attention_cases_are_fixed_by_their_seed():
    """The same seed gives the same case (a failure reproduces); another seed another one."""
    make = lambda seed: paged_attention_case(np.random.default_rng(seed), [5, 2], new=[3, 1], cands=[2, 2],
                                             page_size=4, heads=H, head_dim=D)
    a, b, c = make(3), make(3), make(4)
    for name in ("q", "k", "v", "keys", "key_stamps", "query_stamps"):
        assert torch.equal(getattr(a, name).nan_to_num(), getattr(b, name).nan_to_num()), name
    assert torch.equal(a.bias.position, b.bias.position) and not torch.equal(a.q, c.q)
