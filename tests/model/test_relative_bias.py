"""HSTU's relative position and time bias: its buckets, its tables, and that cached keys keep theirs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from data.schema import TIME_MS_RANGE
from helpers import (
    Visit,
    assert_logits_close,
    make_cache,
    random_candidates,
    random_histories,
    reference_bucket,
    sensitive_model,
    serve,
    tiny_config,
)
from model.attention.relative_bias import (
    MAX_POSITION_BUCKETS,
    MAX_TIME_BUCKETS,
    NO_TIME,
    POSITION_SUBDIVISION,
    RECENCY_PRIOR_LOGITS,
    TAG_MATCH_PRIOR,
    TIME_SUBDIVISION,
    RelativeAttentionBias,
    bucket_start,
    log_bucket,
    max_buckets,
    recency_prior,
    time_bucket,
)
from model.attention.token_stamp import (
    MAX_STAMP_TAG,
    STAMP_TIME_BITS,
    STAMP_TIME_MASK,
    stamp_tag_match,
    stamp_times,
    token_stamps,
)
from model.recommender import HSTURecommender


@pytest.mark.parametrize("subdivision, num_buckets", [(POSITION_SUBDIVISION, MAX_POSITION_BUCKETS),
                                                     (POSITION_SUBDIVISION, 81), (TIME_SUBDIVISION, MAX_TIME_BUCKETS),
                                                     (0, max_buckets(0))])
def test_buckets_follow_their_definition_exactly(subdivision, num_buckets):
    rng = np.random.default_rng(subdivision)
    powers = [1 << e for e in range(36)]
    distances = sorted({*range(0, 600), *powers, *(p - 1 for p in powers), *(p + 1 for p in powers),
                        *rng.integers(0, 1 << 36, 3000).tolist()})
    got = log_bucket(torch.tensor(distances), subdivision, num_buckets).tolist()
    assert got == [reference_bucket(d, subdivision, num_buckets) for d in distances]
    assert got == sorted(got)  # farther never lands in a nearer bucket
    exact = [d for d in distances if d < 1 << subdivision]
    assert got[: len(exact)] == exact  # the nearest distances each have a bucket of their own
    assert log_bucket(torch.tensor([-5]), subdivision, num_buckets).item() == 0


def test_bucket_counts_beyond_the_capped_distance_are_refused():
    with pytest.raises(ValueError, match="num_time_buckets"):
        tiny_config(num_time_buckets=MAX_TIME_BUCKETS + 1)
    with pytest.raises(ValueError, match="num_position_buckets"):
        RelativeAttentionBias(2, MAX_POSITION_BUCKETS + 1, 0)


def test_time_buckets_count_whole_seconds_and_send_missing_times_to_their_own_row():
    key = torch.tensor([1_000_000, 1_000_000, 1_000_000, 1_000_000, NO_TIME, 5_000])
    query = torch.tensor([1_000_999, 1_001_000, 1_000_000 + 3_600_000, 999_000, 2_000_000, NO_TIME])
    got = time_bucket(query, key, 92).tolist()
    assert got[0] == 0 and got[1] == 1  # 0.999 s, then 1 s
    assert got[2] == reference_bucket(3600, TIME_SUBDIVISION, 92)
    assert got[3] == 0  # a key after its query (never attended) clamps, never wraps
    assert got[4] == got[5] == 92  # no time: the table's last row


def test_pair_table_adds_position_and_time_rows_per_head():
    bias = RelativeAttentionBias(num_heads=3, num_position_buckets=5, num_time_buckets=4)
    with torch.no_grad():
        bias.position.copy_(torch.randn(3, 5))
        bias.time.copy_(torch.randn(3, 5))
    index = bias.pair_index(torch.tensor([9]), torch.tensor([7]), torch.tensor([10_000]), torch.tensor([7_000]))
    row = bias.pair_table()[index.long()][0]  # distance 2, 3 seconds
    expected = bias.position[:, 2] + bias.time[:, reference_bucket(3, TIME_SUBDIVISION, 4)]
    torch.testing.assert_close(row, expected)
    torch.testing.assert_close(bias.self_bias(), bias.position[:, 0] + bias.time[:, 0])


def test_the_tag_match_adds_its_offset_to_the_pairs_of_one_known_tag():
    bias = RelativeAttentionBias(num_heads=3, num_position_buckets=5, num_time_buckets=4, tag_match=True)
    torch.testing.assert_close(bias.tag_match.detach(), torch.full((3,), TAG_MATCH_PRIOR))
    with torch.no_grad():
        bias.position.copy_(torch.randn(3, 5))
        bias.time.copy_(torch.randn(3, 5))
        bias.tag_match.copy_(torch.randn(3))
    stamp = lambda time, tag: torch.from_numpy(token_stamps(np.array([time]), np.array([tag])))
    table = bias.pair_table()
    assert table.shape == (2 * 5 * 5, 3)
    positions = torch.tensor([9]), torch.tensor([7])
    plain = bias.position[:, 2] + bias.time[:, reference_bucket(3, TIME_SUBDIVISION, 4)]  # distance 2, 3 seconds
    for query_tag, key_tag, matched in [(4, 4, True), (4, 5, False), (0, 0, False), (0, 4, False)]:
        index = bias.pair_index(*positions, stamp(10_000, query_tag), stamp(7_000, key_tag))
        torch.testing.assert_close(table[index.long()][0], plain + bias.tag_match * matched)
    torch.testing.assert_close(bias.self_bias(), bias.position[:, 0] + bias.time[:, 0])  # no tag term with itself


def test_token_stamps_pack_time_and_tag_and_refuse_what_does_not_fit():
    times, tags = np.array([1_650_000_000_123, NO_TIME, 0]), np.array([7, 7, MAX_STAMP_TAG])
    stamps = torch.from_numpy(token_stamps(times, tags))
    assert stamps[1] == NO_TIME
    assert torch.equal(stamp_times(stamps), torch.from_numpy(times))
    assert torch.equal(torch.from_numpy(token_stamps(times, None)), torch.from_numpy(times))  # no tags: the times
    match = stamp_tag_match(stamps[:, None], stamps[None, :])
    assert match.tolist() == [[True, False, False], [False, False, False], [False, False, True]]
    with pytest.raises(ValueError, match=r"timestamp 4398046511104 ms \(token 1\)"):
        token_stamps(np.array([5, STAMP_TIME_MASK + 1]), None)
    with pytest.raises(ValueError, match="tag rows must be in"):
        token_stamps(np.array([5]), np.array([MAX_STAMP_TAG + 1]))
    assert TIME_MS_RANGE[1] <= STAMP_TIME_MASK  # every time live events may carry fits below the tag bits


def _histories_and_visits(cfg, seed=3):
    rng = np.random.default_rng(seed)
    histories = random_histories(rng, 3, (40, 90), cfg)
    return histories, [Visit(u, 30 + 5 * u, random_candidates(rng, 4)) for u in histories]


@pytest.mark.parametrize("backend", ["blocked", "triton"])
def test_zero_tables_score_exactly_as_a_model_without_the_bias(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    cfg = tiny_config()
    with_bias = sensitive_model(cfg, 0)
    without = HSTURecommender(cfg.replace(num_position_buckets=0, num_time_buckets=0)).eval()
    state = {k: v for k, v in with_bias.state_dict().items() if "relative_bias" not in k}
    without.load_state_dict(state)
    for layer in with_bias.layers:
        torch.nn.init.zeros_(layer.relative_bias.position)
        torch.nn.init.zeros_(layer.relative_bias.time)
    histories, visits = _histories_and_visits(cfg)
    with_bias.attention_backend = without.attention_backend = backend
    assert without.layers[0].relative_bias is None
    assert torch.equal(serve(with_bias, None, histories, visits), serve(without, None, histories, visits))


def test_each_bias_moves_the_scores():
    cfg = tiny_config()
    model = sensitive_model(cfg, 0)
    histories, visits = _histories_and_visits(cfg)
    reference = serve(model, None, histories, visits)
    for table in ("position", "time"):
        changed = sensitive_model(cfg, 0)
        with torch.no_grad():
            getattr(changed.layers[0].relative_bias, table).add_(0.5)
        assert not torch.allclose(serve(changed, None, histories, visits), reference, atol=1e-3), table


def test_cached_keys_are_biased_by_the_times_the_cache_holds():
    """The time bias of a cached key reads the time stored beside its K/V: of two caches holding the same
    visits, the one whose stored times are moved a month back scores the next visits differently."""
    cfg = tiny_config()
    model = sensitive_model(cfg, 0)
    histories, first = _histories_and_visits(cfg)
    later = [Visit(v.user_id, v.end + 6, v.candidates) for v in first]
    expected = serve(model, None, histories, later)
    kept, moved = make_cache(cfg), make_cache(cfg)
    for cache in (kept, moved):
        serve(model, cache, histories, first)
    moved.times_cache().sub_(30 * 24 * 3_600_000)
    assert_logits_close(serve(model, kept, histories, later), expected)
    assert not torch.allclose(serve(model, moved, histories, later), expected, atol=1e-3)


def test_bucket_start_is_the_smallest_distance_of_each_bucket():
    starts = bucket_start(POSITION_SUBDIVISION, MAX_POSITION_BUCKETS)
    buckets = torch.arange(MAX_POSITION_BUCKETS)
    assert torch.equal(log_bucket(starts, POSITION_SUBDIVISION, MAX_POSITION_BUCKETS), buckets)
    assert torch.equal(log_bucket(starts[1:] - 1, POSITION_SUBDIVISION, MAX_POSITION_BUCKETS), buckets[:-1])


def test_recency_prior_favours_each_heads_horizon():
    prior = recency_prior(4, 81)
    starts = bucket_start(POSITION_SUBDIVISION, 81)
    assert torch.all(prior[:, 1:] < prior[:, :-1])  # older is always discounted
    torch.testing.assert_close(prior[:, 0], torch.full((4,), RECENCY_PRIOR_LOGITS))
    for h, horizon in enumerate([4, 16, 64, 256]):
        assert prior[h, starts == horizon].abs().max() < 1e-6  # it crosses zero at the horizon
    assert torch.all(prior[1:, 1:] > prior[:-1, 1:])  # each later head reaches further back
    layer = RelativeAttentionBias(4, 81, 10)
    torch.testing.assert_close(layer.position.data, prior)
    assert not layer.time.any()


@pytest.mark.parametrize("tag_match", [False, True])
@pytest.mark.parametrize("buckets", [(81, 92), (176, 0), (0, 92), (5, 3), (0, 0)])
def test_pair_index_is_the_definitions_buckets(buckets, tag_match):
    """pair_index's fast path (a table of distance buckets, int32 arithmetic) equals log_bucket and
    time_bucket everywhere: short and capped distances, negative (masked) ones, missing times; with the
    tag match, the same rows of the table's second half where the stamps carry one known tag."""
    if not (any(buckets) or tag_match):
        return
    rng = np.random.default_rng(0)
    bias = RelativeAttentionBias(2, *buckets, tag_match=tag_match)
    query_positions = torch.from_numpy(rng.integers(0, 20_000, (3, 64, 1)))
    key_positions = torch.from_numpy(rng.integers(0, 20_000, (3, 1, 80)))
    query_times = torch.from_numpy(rng.integers(0, 2**41, (3, 64, 1)))
    key_times = query_times.median() - torch.from_numpy(rng.integers(-10**6, 2**40, (3, 1, 80)))  # some < 0: none
    query_times[0, :4], key_times[1, 0, :4] = NO_TIME, NO_TIME
    want = torch.zeros((), dtype=torch.int64)
    if buckets[0]:
        want = log_bucket(query_positions - key_positions, POSITION_SUBDIVISION, buckets[0]) * bias.num_time_rows
    if buckets[1]:
        want = want + time_bucket(query_times, key_times, buckets[1])
    if tag_match:
        query_tags, key_tags = (torch.from_numpy(rng.integers(0, 3, t.shape)) for t in (query_times, key_times))
        same = (query_tags == key_tags) & (query_tags > 0) & (query_times >= 0) & (key_times >= 0)
        assert same.any() and (~same).any()
        want = want + same * bias.num_distance_rows
        query_times = torch.where(query_times < 0, NO_TIME, query_times | query_tags << STAMP_TIME_BITS)
        key_times = torch.where(key_times < 0, key_times, key_times | key_tags << STAMP_TIME_BITS)
    got = bias.pair_index(query_positions, key_positions, query_times, key_times)
    assert got.dtype == torch.int32
    assert torch.equal(got.long(), want.expand_as(got))
