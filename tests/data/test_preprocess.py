"""Preprocessing: dedup, stable sort, visits/requests, outputs, atomicity, input errors."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import preprocessor_inference
from data import schema
from data.event_rules import duplicate_mask, stable_order
from data.manifest import PreprocessParams
from data.preprocess import preprocess
from data.synthetic import generate
from helpers import MINUTE, T0, feature_row, log_row, snapshot, write_log, write_raw_dir, write_user_features
from helpers import REPO_ROOT as REPO

T = T0
M = MINUTE


# ---------------------------------------------------------------- the hand-made dataset
def hand_rows() -> tuple[list[dict], list[dict]]:
    """Duplicates (adjacent and not), unsorted rows, equal timestamps, a single-event user,
    a same-video row that is *not* a duplicate, one duration <= 0 and one long_view mismatch."""
    early = [
        log_row(7, 100, T, is_click=1),  # r1
        log_row(7, 101, T),  # r2
        log_row(3, 300, T + 5 * M, duration_ms=0),  # r3: single-event user, nonpositive duration
        log_row(7, 102, T + 1 * M),  # r4
        log_row(7, 100, T, is_click=1),  # r5: copy of r1 (not adjacent) -> dropped
        log_row(7, 103, T + 100 * M, is_click=1, long_view=1, play_time_ms=12_000),  # r6
        log_row(5, 500, T + 10 * M),  # r7
    ]
    late = [
        log_row(7, 105, T + 200 * M, is_click=1, is_like=1),  # r8
        log_row(7, 104, T + 101 * M, is_hate=1),  # r9: listed after a later event
        log_row(5, 501, T + 41 * M, is_profile_enter=1),  # r10
        log_row(5, 502, T + 41 * M, is_follow=1, is_comment=1, is_forward=1),  # r11
        log_row(7, 106, T + 230 * M, long_view=1),  # r12: long_view without reaching 10 s
        log_row(7, 101, T, play_time_ms=2_000),  # r13: same user/time/video as r2, differs
        log_row(5, 501, T + 41 * M, is_profile_enter=1),  # r14: copy of r10 -> dropped
        log_row(7, 101, T),  # r15: copy of r2 behind r13 -> dropped
    ]
    return early, late


def hand_features() -> list[dict]:
    return [
        feature_row(3, user_active_degree="high_active", is_live_streamer=-124, onehot_feat4=""),
        feature_row(5, user_active_degree="UNKNOWN", is_live_streamer=1, onehot_feat4="3.0"),
        feature_row(9, user_active_degree="brand_new_label", is_live_streamer=0, onehot_feat4="7.0"),
    ]  # user 7 has no row; user 9 has no events


@pytest.fixture
def hand_dir(tmp_path: Path) -> Path:
    early, late = hand_rows()
    return write_raw_dir(tmp_path / "raw", early, late, hand_features())


def read_requests(out: Path) -> list[tuple[int, ...]]:
    table = pq.read_table(out / schema.REQUESTS_FILE)
    assert table.column_names == list(schema.REQUEST_COLUMNS)
    return [tuple(row[c] for c in schema.REQUEST_COLUMNS) for row in table.to_pylist()]


def test_hand_made_sequences_and_requests(hand_dir: Path, tmp_path: Path):
    out = tmp_path / "out"
    manifest = preprocess(hand_dir, out, PreprocessParams(), progress=False)

    seq = pq.read_table(out / schema.SEQUENCES_FILE).to_pylist()
    assert [r["user_id"] for r in seq] == [3, 5, 7]
    assert seq[0]["video_ids"] == [300] and seq[0]["timestamps"] == [T + 5 * M] and seq[0]["action_weights"] == [0]
    assert seq[1]["video_ids"] == [500, 501, 502]
    assert seq[1]["timestamps"] == [T + 10 * M, T + 41 * M, T + 41 * M]
    assert seq[1]["action_weights"] == [0, 128, 4 + 8 + 16]
    assert seq[2]["video_ids"] == [100, 101, 101, 102, 103, 104, 105, 106]
    assert seq[2]["timestamps"] == [T, T, T, T + M, T + 100 * M, T + 101 * M, T + 200 * M, T + 230 * M]
    assert seq[2]["action_weights"] == [1, 0, 0, 0, 1 + 64, 32, 1 + 2, 64]

    # (request_id, user_id, time_ms, start, end, num_candidates)
    assert read_requests(out) == [
        (0, 5, T + 41 * M, 0, 1, 2),
        (1, 7, T + 100 * M, 0, 4, 2),
        (2, 7, T + 200 * M, 4, 6, 2),
    ]
    c = manifest.counts
    assert c.rows_read == {schema.LOG_STANDARD_EARLY: 7, schema.LOG_STANDARD_LATE: 8}
    assert c.duplicate_rows_dropped == {schema.LOG_STANDARD_EARLY: 1, schema.LOG_STANDARD_LATE: 2}
    assert c.users_without_events_in_file == {schema.LOG_STANDARD_EARLY: 0, schema.LOG_STANDARD_LATE: 1}
    assert (c.users, c.events, c.visits, c.requests, c.users_without_requests) == (3, 12, 6, 3, 1)
    assert (c.rows_nonpositive_duration, c.rows_long_view_mismatch) == (1, 1)
    assert (c.users_without_features, c.feature_users_without_events) == (1, 1)
    assert manifest.num_video_ids == 503
    assert manifest.tasks == schema.TASKS


def test_hand_made_user_features(hand_dir: Path, tmp_path: Path):
    out = tmp_path / "out"
    manifest = preprocess(hand_dir, out, PreprocessParams(), progress=False)
    seq = pq.read_table(out / schema.SEQUENCES_FILE).to_pydict()  # users 3, 5, 7
    vocab = {f.name: f.values for f in manifest.user_features}
    assert manifest.user_feature_names == schema.CONTEXT_FEATURE_NAMES
    labels = ("full_active", "high_active", "middle_active", "low_active", "brand_new_label")
    assert vocab["user_active_degree"] == labels
    assert seq["user_active_degree"] == [2, 0, 0]  # UNKNOWN and "no row" are both id 0
    assert vocab["is_live_streamer"] == (0, 1) and seq["is_live_streamer"] == [0, 2, 0]  # -124 -> 0
    assert vocab["onehot_feat4"] == (3, 7) and seq["onehot_feat4"] == [0, 1, 0]  # empty cell -> 0
    assert seq["follow_user_num_range"] == [2, 2, 0]  # "(0,10]" is the second declared label
    assert manifest.user_feature_cardinalities[:3] == (6, 2, 3)
    written = json.loads((out / schema.MANIFEST_FILE).read_text())
    assert written["user_feature_cardinalities"][:3] == [6, 2, 3]


@pytest.mark.parametrize(
    "gap_minutes, num_candidates, expected",
    [
        (30, 1, [(0, 5, T + 41 * M, 0, 1, 1), (1, 7, T + 100 * M, 0, 4, 1), (2, 7, T + 200 * M, 4, 6, 1)]),
        (120, 64, []),  # every user is one long visit: no request
        (0, 64, [  # any time step starts a visit; equal timestamps never split
            (0, 7, T + M, 0, 3, 1),
            (1, 5, T + 41 * M, 0, 1, 2),
            (2, 7, T + 100 * M, 3, 4, 1),
            (3, 7, T + 101 * M, 4, 5, 1),
            (4, 7, T + 200 * M, 5, 6, 1),
            (5, 7, T + 230 * M, 6, 7, 1),
        ]),
    ],
)  # fmt: skip
def test_parameters_shape_requests(hand_dir: Path, tmp_path: Path, gap_minutes, num_candidates, expected):
    params = PreprocessParams(session_gap_minutes=gap_minutes, num_candidates=num_candidates)
    manifest = preprocess(hand_dir, tmp_path / "out", params, progress=False)
    assert read_requests(tmp_path / "out") == expected
    assert manifest.params == params


# ---------------------------------------------------------------- generated data: invariants
@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("generated")
    generate(root / "raw", scale=0.006, seed=3, progress=False)
    preprocess(root / "raw", root / "out", PreprocessParams(), progress=False)
    return root / "raw", root / "out"


def test_chunks_are_contiguous_for_every_user(generated):
    _, out = generated
    req = pq.read_table(out / schema.REQUESTS_FILE).to_pandas()
    lengths = dict(zip(*(pq.read_table(out / schema.SEQUENCES_FILE).to_pydict()[k] for k in ("user_id", "video_ids"))))
    assert len(req) > 0
    for user, group in req.groupby("user_id", sort=False):  # groups keep the time order
        start, end, cand = group["start"].to_numpy(), group["end"].to_numpy(), group["num_candidates"].to_numpy()
        assert start[0] == 0
        assert np.array_equal(start[1:], end[:-1])  # each chunk starts where the previous ended
        assert np.all(start < end)  # none empty
        assert np.all((cand >= 1) & (cand <= 64) & (end + cand <= len(lengths[user])))
        assert np.all(np.diff(group["time_ms"].to_numpy()) > 0)


def test_requests_sorted_by_time_then_user(generated):
    _, out = generated
    req = pq.read_table(out / schema.REQUESTS_FILE)
    assert all(req.schema.field(c).type == "int64" for c in schema.REQUEST_COLUMNS)
    time, user = req.column("time_ms").to_numpy(), req.column("user_id").to_numpy()
    assert np.array_equal(req.column("request_id").to_numpy(), np.arange(len(time)))
    keys = list(zip(time.tolist(), user.tolist()))
    assert keys == sorted(keys) and len(set(keys)) == len(keys)


def test_sequences_sorted_and_demo_has_many_visits(generated):
    _, out = generated
    seq = pq.read_table(out / schema.SEQUENCES_FILE)
    for name in schema.SEQUENCE_LIST_COLUMNS:
        assert str(seq.schema.field(name).type) == "list<element: int64>"
    for times in seq.column("timestamps").to_pylist():
        assert times == sorted(times)
    manifest = json.loads((out / schema.MANIFEST_FILE).read_text())
    counts = manifest["counts"]
    assert counts["visits"] / counts["users"] >= 15  # the demo needs many visits per user
    assert max(len(v) for v in seq.column("video_ids").to_pylist()) >= 1_000  # and long histories
    assert counts["events"] == sum(counts["rows_read"].values()) - sum(counts["duplicate_rows_dropped"].values())


# ---------------------------------------------------------------- dedup and sort helpers
def test_duplicate_mask_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        cols = [rng.integers(0, k, n) for k in (3, 4, 3, 2, 2)]  # user, time, video, rest...
        rows = list(zip(*(c.tolist() for c in cols)))
        order = stable_order(cols[0], cols[1])
        user, time, video = (c[order] for c in cols[:3])
        dup = duplicate_mask(user, time, video, order, cols[3:])
        seen, expected = set(), []
        for i in order.tolist():  # sorted order keeps file order within equal keys
            expected.append(rows[i] in seen)
            seen.add(rows[i])
        assert dup.tolist() == expected


def test_stable_order_handles_ids_too_wide_to_pack():
    user = np.array([2**62, 5, 2**62, 5, 0], dtype=np.int64)
    time = np.array([-(2**62), 3, -(2**62), 1, 2**62], dtype=np.int64)
    expected = sorted(range(5), key=lambda i: (user[i], time[i]))  # Python's sort is stable
    assert stable_order(user, time).tolist() == expected


# ---------------------------------------------------------------- property test vs a reference
def reference(early: list[dict], late: list[dict], gap_ms: int, num_candidates: int):
    """Straightforward per-row implementation of the documented semantics."""
    seen, rows = set(), []
    for row in early + late:
        key = tuple(row[c] for c in schema.LOG_COLUMNS)
        if key not in seen:
            seen.add(key)
            rows.append(row)
    sequences, requests = {}, []
    for user in sorted({r["user_id"] for r in rows}):
        events = sorted((r for r in rows if r["user_id"] == user), key=lambda r: r["time_ms"])
        weights = [sum(r[c] << bit for bit, c in enumerate(schema.ACTION_COLUMNS)) for r in events]
        sequences[user] = ([r["video_id"] for r in events], weights, [r["time_ms"] for r in events])
        times = [r["time_ms"] for r in events]
        visit_starts = [i for i in range(len(events)) if i == 0 or times[i] - times[i - 1] > gap_ms]
        bounds = visit_starts + [len(events)]
        previous_end = 0
        for k in range(1, len(visit_starts)):
            first = visit_starts[k]
            candidates = min(num_candidates, bounds[k + 1] - first)
            requests.append((times[first], user, previous_end, first, candidates))
            previous_end = first
    requests.sort()
    return sequences, [(i, u, t, s, e, c) for i, (t, u, s, e, c) in enumerate(requests)]


row_strategy = st.builds(
    lambda user, step, video, play, click, lv: log_row(
        user, video, T + step * M // 2, play_time_ms=play, is_click=click, long_view=lv
    ),
    st.integers(0, 3), st.integers(0, 200), st.integers(0, 3), st.sampled_from([1_000, 2_000]),
    st.integers(0, 1), st.integers(0, 1),
)  # fmt: skip


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    early=st.lists(row_strategy, min_size=1, max_size=25),
    late=st.lists(row_strategy, max_size=25),
    gap_minutes=st.sampled_from([0, 15, 30, 60]),
    num_candidates=st.sampled_from([1, 2, 64]),
)
def test_matches_reference_on_random_tables(early, late, gap_minutes, num_candidates):
    early = early + early[: len(early) // 3]  # make exact duplicates likely
    with tempfile.TemporaryDirectory() as tmp:
        raw = write_raw_dir(Path(tmp), early, late, [feature_row(0)])
        params = PreprocessParams(session_gap_minutes=gap_minutes, num_candidates=num_candidates)
        preprocess(raw, Path(tmp) / "out", params, progress=False)
        seq = pq.read_table(Path(tmp) / "out" / schema.SEQUENCES_FILE).to_pylist()
        got_sequences = {r["user_id"]: (r["video_ids"], r["action_weights"], r["timestamps"]) for r in seq}
        got_requests = read_requests(Path(tmp) / "out")
    want_sequences, want_requests = reference(early, late, gap_minutes * M, num_candidates)
    assert got_sequences == want_sequences
    assert got_requests == want_requests


# ---------------------------------------------------------------- bad input: errors + atomicity
def edit_line(path: Path, line: int, column: str, value: str) -> None:
    """Set one cell of a plain (unquoted) CSV: `line` is 1-based, the header is line 1."""
    lines = path.read_text().splitlines()
    header = lines[0].split(",")
    cells = lines[line - 1].split(",")
    cells[header.index(column)] = value
    lines[line - 1] = ",".join(cells)
    path.write_text("\n".join(lines) + "\n")


def break_missing_dir(data: Path) -> Path:
    return data.parent / "does-not-exist"


def _bad_cell(name: str, line: int, column: str, value: str):
    def corrupt(data: Path) -> Path:
        edit_line(data / name, line, column, value)
        return data

    return corrupt


def _drop_column(data: Path) -> Path:
    path = data / schema.LOG_STANDARD_LATE
    lines = [line.rsplit(",", 1)[0] for line in path.read_text().splitlines()]  # 'tab' is last
    path.write_text("\n".join(lines) + "\n")
    return data


def _ragged(data: Path) -> Path:
    path = data / schema.LOG_STANDARD_EARLY
    lines = path.read_text().splitlines()
    lines[6] = lines[6].rsplit(",", 1)[0]  # line 7 loses a cell
    path.write_text("\n".join(lines) + "\n")
    return data


def _remove(name: str):
    def corrupt(data: Path) -> Path:
        (data / name).unlink()
        return data

    return corrupt


def _bad_features(**values):
    def corrupt(data: Path) -> Path:
        rows = hand_features()
        rows[1].update(values)  # the second data row: line 3
        write_user_features(data / schema.USER_FEATURES, rows)
        return data

    return corrupt


EARLY, LATE, FEATURES = schema.LOG_STANDARD_EARLY, schema.LOG_STANDARD_LATE, schema.USER_FEATURES
BAD_INPUTS = {  # case: (corruption, fragments the error message must contain)
    "missing dir": (break_missing_dir, ["does-not-exist", "does not exist"]),
    "missing file": (_remove(LATE), [LATE, "missing"]),
    "missing features file": (_remove(FEATURES), [FEATURES, "missing"]),
    "missing column": (_drop_column, [LATE, "'tab'", "missing column"]),
    "non-numeric": (_bad_cell(EARLY, 4, "video_id", "abc"), [EARLY, "'video_id'", "line 4", "'abc'"]),
    "float in int column": (_bad_cell(LATE, 2, "time_ms", "1.5"), [LATE, "'time_ms'", "line 2", "'1.5'"]),
    "empty cell": (_bad_cell(EARLY, 3, "play_time_ms", ""), [EARLY, "'play_time_ms'", "line 3", "empty"]),
    "negative user": (_bad_cell(LATE, 5, "user_id", "-1"), [LATE, "'user_id'", "line 5", "negative"]),
    "negative video": (_bad_cell(EARLY, 8, "video_id", "-7"), [EARLY, "'video_id'", "line 8", "negative"]),
    "flag not 0/1": (_bad_cell(EARLY, 6, "is_like", "2"), [EARLY, "'is_like'", "line 6"]),
    "ragged row": (_ragged, [EARLY, "line 7", "expected 19 columns"]),
    "fractional feature": (_bad_features(onehot_feat4="1.5"), [FEATURES, "'onehot_feat4'", "line 3"]),
    "text in feature": (_bad_features(onehot_feat2="x"), [FEATURES, "'onehot_feat2'", "line 3", "'x'"]),
    "duplicate user": (_bad_features(user_id=3), [FEATURES, "'user_id'", "line 3", "duplicate"]),
}


def cli(data_dir: Path, out: Path) -> int:
    argv = ["--dataset_name", "kuairand-1k", "--data_dir", str(data_dir), "--output_dir", str(out), "--no_progress"]
    return preprocessor_inference.main(argv)


@pytest.fixture
def previous_output(hand_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "outputs" / "kuairand"
    assert cli(hand_dir, out) == 0
    return out


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_fails_cleanly(case, hand_dir: Path, previous_output: Path, capsys):
    corrupt, expected = BAD_INPUTS[case]
    data_dir = corrupt(hand_dir)
    before = snapshot(previous_output.parent)
    capsys.readouterr()
    rc = cli(data_dir, previous_output)
    err = capsys.readouterr().err
    assert rc == 1
    for fragment in expected:
        assert fragment in err, (fragment, err)
    assert snapshot(previous_output.parent) == before  # OUT byte-identical, nothing left beside it


def test_bad_input_into_fresh_output_leaves_nothing(hand_dir: Path, tmp_path: Path):
    _bad_cell(schema.LOG_STANDARD_EARLY, 4, "video_id", "abc")(hand_dir)
    out = tmp_path / "fresh" / "out"
    with pytest.raises(ValueError, match="line 4"):
        preprocess(hand_dir, out, PreprocessParams(), progress=False)
    assert not out.exists() and not (out.parent.exists() and any(out.parent.iterdir()))


def test_wrong_dataset_name_is_refused(hand_dir: Path, previous_output: Path):
    before = snapshot(previous_output.parent)
    command = [sys.executable, str(REPO / "preprocessor_inference.py"), "--dataset_name", "movielens-1m",
               "--data_dir", str(hand_dir), "--output_dir", str(previous_output)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    assert done.returncode != 0
    assert "movielens-1m" in done.stderr and "kuairand-1k" in done.stderr
    assert snapshot(previous_output.parent) == before


def test_refuses_to_replace_a_foreign_directory(hand_dir: Path, tmp_path: Path):
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="refusing to replace"):
        preprocess(hand_dir, foreign, PreprocessParams(), progress=False)
    assert snapshot(foreign) == {"notes.txt": b"keep me"}


def test_success_replaces_previous_output_atomically(hand_dir: Path, previous_output: Path):
    preprocess(hand_dir, previous_output, PreprocessParams(num_candidates=1), progress=False)
    assert sorted(p.name for p in previous_output.parent.iterdir()) == [previous_output.name]
    assert sorted(p.name for p in previous_output.iterdir()) == sorted(schema.OUTPUT_FILES)
    assert [r[-1] for r in read_requests(previous_output)] == [1, 1, 1]


def test_accepts_kuairand_folder_or_data_dir(hand_dir: Path, tmp_path: Path):
    a = preprocess(hand_dir, tmp_path / "a", PreprocessParams(), progress=False)  # .../KuaiRand-1K/data
    b = preprocess(hand_dir.parent, tmp_path / "b", PreprocessParams(), progress=False)  # .../KuaiRand-1K
    assert a == b
    assert snapshot(tmp_path / "a") == snapshot(tmp_path / "b")  # deterministic output


def test_log_with_extra_columns_in_another_order_is_read(hand_dir: Path, tmp_path: Path):
    early, _ = hand_rows()
    columns = ("extra", *reversed(schema.LOG_COLUMNS))
    write_log(hand_dir / schema.LOG_STANDARD_EARLY, [{**r, "extra": 9} for r in early], columns)
    preprocess(hand_dir, tmp_path / "out", PreprocessParams(), progress=False)
    assert read_requests(tmp_path / "out")[0] == (0, 5, T + 41 * M, 0, 1, 2)
