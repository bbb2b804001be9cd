"""InferenceDataset: loading checks, replay order, batching, VisitBatch contents."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from data import InferenceDataset, VisitBatch, schema
from data.manifest import Manifest, PreprocessParams
from data.preprocess import preprocess
from data.synthetic import generate
from helpers import MINUTE as M
from helpers import T0 as T
from helpers import feature_row, log_row, write_raw_dir


@pytest.fixture(scope="module")
def hand_out(tmp_path_factory) -> Path:
    """user 7: 8 events in 3 visits (requests [0,4) and [4,6)); user 5: 3 events, 2 visits."""
    root = tmp_path_factory.mktemp("hand")
    early = [
        log_row(7, 100, T, is_click=1),
        log_row(7, 101, T + M // 2),
        log_row(7, 102, T + M),
        log_row(7, 103, T + 2 * M),
        log_row(7, 104, T + 100 * M, is_click=1, long_view=1, play_time_ms=12_000),
        log_row(7, 105, T + 101 * M, is_hate=1),
        log_row(5, 500, T + 10 * M),
    ]
    late = [
        log_row(7, 106, T + 200 * M, is_click=1, is_like=1, is_profile_enter=1),
        log_row(7, 107, T + 201 * M),
        log_row(5, 501, T + 41 * M, is_follow=1),
        log_row(5, 502, T + 42 * M, is_comment=1, is_forward=1),
    ]
    features = [feature_row(5, onehot_feat0=1), feature_row(7, onehot_feat0=0, user_active_degree="low_active")]
    preprocess(write_raw_dir(root, early, late, features), root / "out", PreprocessParams(), progress=False)
    return root / "out"


@pytest.fixture(scope="module")
def generated_out(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("generated")
    generate(root / "raw", scale=0.004, seed=11, progress=False)
    preprocess(root / "raw", root / "out", PreprocessParams(num_candidates=16), progress=False)
    return root / "out"


def test_loads_typed_tables(hand_out: Path):
    ds = InferenceDataset(hand_out)
    assert isinstance(ds.manifest, Manifest) and ds.manifest.params.num_candidates == 64
    assert len(ds) == 3 and ds.num_tasks == 8 and ds.num_user_features == len(schema.CONTEXT_FEATURES)
    assert ds.user_feature_cardinalities == ds.manifest.user_feature_cardinalities
    r = ds.requests
    assert r.user_id.tolist() == [5, 7, 7]
    assert r.time_ms.tolist() == [T + 41 * M, T + 100 * M, T + 200 * M]
    assert r.start.tolist() == [0, 0, 4] and r.end.tolist() == [1, 4, 6] and r.num_candidates.tolist() == [2, 2, 2]
    assert all(a.dtype == np.int64 for a in (r.request_id, r.user_id, r.time_ms, r.start, r.end, r.num_candidates))
    assert ds.history_length(7) == 8 and ds.history_length(5) == 3
    with pytest.raises(KeyError, match="user 6"):
        ds.history_length(6)


def test_make_batch_full_chunk(hand_out: Path):
    ds = InferenceDataset(hand_out)
    b = ds.make_batch(np.array([0, 1]), starts=np.array([0, 0]), window_starts=np.array([0, 0]))
    assert isinstance(b, VisitBatch) and b.batch_size == 2
    assert b.request_ids.tolist() == [0, 1] and b.user_ids.tolist() == [5, 7]
    assert b.request_times_ms.tolist() == [T + 41 * M, T + 100 * M]
    assert b.history_lengths.tolist() == [1, 4] and b.ends.tolist() == [1, 4]
    assert b.video_ids.tolist() == [500, 100, 101, 102, 103]
    assert b.timestamps_ms.tolist() == [T + 10 * M, T, T + M // 2, T + M, T + 2 * M]
    assert b.action_weights.tolist() == [0, 1, 0, 0, 0]
    assert b.prev_timestamps_ms.tolist() == [T + 10 * M, T]  # start == 0: the time of event 0
    assert b.candidate_lengths.tolist() == [2, 2]
    assert b.candidate_video_ids.tolist() == [501, 502, 104, 105]
    assert b.labels.dtype == np.float32 and b.labels.shape == (4, 8)
    #                 click like follow comment forward hate long_view profile_enter
    assert b.labels.tolist() == [
        [0, 0, 1, 0, 0, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0, 0],
        [1, 0, 0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 1, 0, 0],
    ]
    vocab = {f.name: f.values for f in ds.manifest.user_features}
    column = schema.CONTEXT_FEATURE_NAMES.index("user_active_degree")
    assert vocab["user_active_degree"] == schema.ACTIVE_DEGREES
    assert b.user_features[:, column].tolist() == [1, 4]  # full_active, low_active
    assert b.user_features.shape == (2, len(schema.CONTEXT_FEATURES)) and b.user_features.dtype == np.int64
    assert b.window_starts.tolist() == [0, 0] and b.starts.tolist() == [0, 0]


def test_history_at_a_time_and_ad_hoc_request_batches(hand_out: Path):
    from data.dataset import UnknownUserError

    ds = InferenceDataset(hand_out)
    # User 7's events are at T, T + M/2, T + M, T + 2M, then the visits from T + 100M on.
    ends = ds.history_ends(np.array([7, 7, 7, 5]), np.array([T + 100 * M, T + M, T - 1, T + 41 * M]))
    assert ends.tolist() == [4, 2, 0, 1]  # strictly before the time: the event at T + M is not history yet
    b = ds.make_request_batch(
        np.array([7, 5]), ends=np.array([4, 1]), starts=np.array([2, 0]), window_starts=np.array([0, 0]),
        request_times_ms=np.array([T + 100 * M, T + 41 * M]), candidate_lengths=np.array([1, 2]),
        candidate_video_ids=np.array([999, 104, 7]),
    )
    assert b.request_ids.tolist() == [-1, -1] and b.labels is None
    assert b.video_ids.tolist() == [102, 103, 500] and b.candidate_video_ids.tolist() == [999, 104, 7]
    assert b.prev_timestamps_ms.tolist() == [T + M // 2, T + 10 * M]
    with pytest.raises(UnknownUserError, match="user 6"):
        ds.history_ends(np.array([7, 6]), np.array([T, T]))
    with pytest.raises(ValueError, match="user 7: history end 9"):
        ds.make_request_batch(np.array([7]), np.array([9]), np.array([0]), np.array([0]), np.array([T]),
                              np.array([1]), np.array([1]))


def test_make_batch_serves_the_uncached_suffix(hand_out: Path):
    ds = InferenceDataset(hand_out)
    # Request 2 (user 7, chunk [4, 6)): the cache holds [0, 5), the window starts at 2.
    b = ds.make_batch(np.array([2]), starts=np.array([5]), window_starts=np.array([2]))
    assert b.starts.tolist() == [5] and b.window_starts.tolist() == [2] and b.history_lengths.tolist() == [1]
    assert b.video_ids.tolist() == [105] and b.action_weights.tolist() == [32]
    assert b.prev_timestamps_ms.tolist() == [T + 100 * M]  # event 4
    assert b.candidate_video_ids.tolist() == [106, 107]
    assert b.labels[0].tolist() == [1, 1, 0, 0, 0, 0, 0, 1]
    # Everything cached: nothing carried, candidates still served.
    b = ds.make_batch(np.array([2]), starts=np.array([6]), window_starts=np.array([0]))
    assert b.history_lengths.tolist() == [0] and b.video_ids.size == 0
    assert b.prev_timestamps_ms.tolist() == [T + 101 * M] and b.candidate_video_ids.tolist() == [106, 107]


@pytest.mark.parametrize(
    "starts, windows",
    [([5], [0]), ([-1], [-1]), ([3], [4]), ([2], [-1])],  # start > end, negative, window > start
)
def test_make_batch_refuses_bad_ranges(hand_out: Path, starts, windows):
    ds = InferenceDataset(hand_out)
    with pytest.raises(ValueError, match=r"request 1 \(user 7\).*window_start=.*start=.*end=4"):
        ds.make_batch(np.array([1]), np.array(starts), np.array(windows))


def test_make_batch_refuses_a_user_twice(hand_out: Path):
    ds = InferenceDataset(hand_out)
    with pytest.raises(ValueError, match="at most once"):
        ds.make_batch(np.array([1, 2]), np.array([0, 4]), np.array([0, 4]))


def test_batches_keep_order_and_unique_users(generated_out: Path):
    ds = InferenceDataset(generated_out)
    indices = ds.request_indices()
    for size in (1, 7, 64):
        batches = list(ds.batches(indices, size))
        assert np.array_equal(np.concatenate(batches), indices)  # nothing reordered or lost
        for i, batch in enumerate(batches):
            users = ds.requests.user_id[batch]
            assert len(set(users.tolist())) == len(batch) <= size
            if i + 1 < len(batches) and len(batch) < size:  # cut early only for a repeated user
                assert ds.requests.user_id[batches[i + 1][0]] in users


def test_request_indices_filters_by_time(generated_out: Path):
    ds = InferenceDataset(generated_out)
    times = ds.requests.time_ms
    lo, hi = int(times[len(times) // 4]), int(times[len(times) // 2])
    expected = [i for i, t in enumerate(times.tolist()) if lo <= t < hi]
    assert ds.request_indices(lo, hi).tolist() == expected
    assert ds.request_indices(lo, hi, max_requests=5).tolist() == expected[:5]
    assert ds.request_indices(until_time_ms=lo).tolist() == [i for i, t in enumerate(times.tolist()) if t < lo]
    assert ds.request_indices(from_time_ms=hi + 10**12).size == 0
    assert len(ds.request_indices()) == len(ds)


def test_make_batch_matches_the_parquet_lists(generated_out: Path):
    """Every field against a direct per-request reading of sequences.parquet."""
    ds = InferenceDataset(generated_out)
    seq = pq.read_table(generated_out / schema.SEQUENCES_FILE).to_pydict()
    row_of = {u: i for i, u in enumerate(seq["user_id"])}
    rng = np.random.default_rng(0)
    for batch in list(ds.batches(ds.request_indices(), 32))[::5]:
        end = ds.requests.end[batch]
        starts = rng.integers(0, end + 1)
        windows = rng.integers(0, starts + 1)
        b = ds.make_batch(batch, starts, windows)
        video, weight, stamp, cand, labels = [], [], [], [], []
        for i, r in enumerate(batch.tolist()):
            row = row_of[int(ds.requests.user_id[r])]
            s, e, c = int(starts[i]), int(ds.requests.end[r]), int(ds.requests.num_candidates[r])
            video += seq["video_ids"][row][s:e]
            weight += seq["action_weights"][row][s:e]
            stamp += seq["timestamps"][row][s:e]
            cand += seq["video_ids"][row][e : e + c]
            labels += [[(w >> t) & 1 for t in range(8)] for w in seq["action_weights"][row][e : e + c]]
            assert b.prev_timestamps_ms[i] == seq["timestamps"][row][max(s - 1, 0)]
            assert b.user_features[i].tolist() == [seq[n][row] for n in ds.manifest.user_feature_names]
        assert b.video_ids.tolist() == video and b.action_weights.tolist() == weight
        assert b.timestamps_ms.tolist() == stamp and b.candidate_video_ids.tolist() == cand
        assert b.labels.tolist() == labels
        assert b.history_lengths.tolist() == (end - starts).tolist()


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_refuses_wrong_schema_version(hand_out: Path, tmp_path: Path):
    out = _copy(hand_out, tmp_path / "old")
    body = json.loads((out / schema.MANIFEST_FILE).read_text())
    body["schema_version"] = schema.SCHEMA_VERSION + 1
    (out / schema.MANIFEST_FILE).write_text(json.dumps(body))
    with pytest.raises(ValueError, match=rf"manifest.json: schema_version {schema.SCHEMA_VERSION + 1}"):
        InferenceDataset(out)


@pytest.mark.parametrize("name", [schema.SEQUENCES_FILE, schema.REQUESTS_FILE, schema.MANIFEST_FILE])
def test_refuses_missing_files(hand_out: Path, tmp_path: Path, name: str):
    out = _copy(hand_out, tmp_path / "partial")
    (out / name).unlink()
    with pytest.raises(FileNotFoundError, match=name):
        InferenceDataset(out)


def test_refuses_files_from_another_run(hand_out: Path, generated_out: Path, tmp_path: Path):
    out = _copy(hand_out, tmp_path / "mixed")
    (out / schema.REQUESTS_FILE).write_bytes((generated_out / schema.REQUESTS_FILE).read_bytes())
    with pytest.raises(ValueError, match="disagree"):
        InferenceDataset(out)


def test_refuses_a_directory_that_does_not_exist(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="not found"):
        InferenceDataset(tmp_path / "nope")
