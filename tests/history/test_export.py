"""history/export.py: a store written out as a preprocessed output equals the preprocessor's output of
the same logs, and export -> bootstrap_from_output -> export is a fixed point (the preprocess-free reload)."""
from __future__ import annotations

import sqlite3
from contextlib import closing
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from data import schema
from data.dataset import InferenceDataset
from data.manifest import PreprocessParams
from data.output import OutputDirError
from data.preprocess import preprocess
from helpers import build_processed, snapshot
from history.bootstrap import bootstrap_from_logs, bootstrap_from_output
from history.events import EventBatch
from history.export import EXPORT_SOURCE, ExportError, export_store, main
from history.sqlite_store import SQLiteHistoryStore

NUM_CANDIDATES = 16


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(root, store path): root/raw generated, root/processed preprocessed, and a SQLite store filled
    from the raw logs with the output's manifest and user features, as a node bootstraps."""
    root = tmp_path_factory.mktemp("export")
    processed = build_processed(root, scale=0.002, seed=5, num_candidates=NUM_CANDIDATES)
    dataset = InferenceDataset(processed)
    with SQLiteHistoryStore(root / "store.sqlite") as store:
        bootstrap_from_logs(store, root / "raw", dataset.manifest, progress=False)
        store.set_user_features(dataset.user_ids, dataset.event_arrays().user_features)
    return root, root / "store.sqlite"


def assert_same_output(exported: InferenceDataset, expected: InferenceDataset) -> None:
    for name, a, b in zip(expected.event_arrays()._fields, exported.event_arrays(), expected.event_arrays()):
        np.testing.assert_array_equal(a, b, err_msg=name)
    for name in schema.REQUEST_COLUMNS:
        np.testing.assert_array_equal(getattr(exported.requests, name), getattr(expected.requests, name), err_msg=name)
    assert exported.manifest.user_features == expected.manifest.user_features
    assert exported.manifest.params == expected.manifest.params
    assert exported.manifest.num_video_ids == expected.manifest.num_video_ids
    for name in ("users", "events", "visits", "requests", "users_without_requests", "users_without_features"):
        assert getattr(exported.manifest.counts, name) == getattr(expected.manifest.counts, name), name


def test_export_equals_the_preprocessors_output(served, tmp_path: Path):
    root, path = served
    with SQLiteHistoryStore(path) as store:
        manifest = export_store(store, tmp_path / "out", progress=False)
    exported, expected = InferenceDataset(tmp_path / "out"), InferenceDataset(root / "processed")
    assert_same_output(exported, expected)
    assert manifest == exported.manifest
    assert manifest.counts.rows_read == {EXPORT_SOURCE: expected.num_events}
    assert manifest.counts.duplicate_rows_dropped == {EXPORT_SOURCE: 0}
    assert manifest.input_files == {}


def test_export_bootstrap_export_is_a_fixed_point(served, tmp_path: Path):
    _, path = served
    with SQLiteHistoryStore(path) as store:
        export_store(store, tmp_path / "first", progress=False)
    with SQLiteHistoryStore(tmp_path / "reloaded.sqlite") as store:
        bootstrap_from_output(store, tmp_path / "first", progress=False)
        export_store(store, tmp_path / "second", progress=False)
    first, second = snapshot(tmp_path / "first"), snapshot(tmp_path / "second")
    assert sorted(first) == sorted(schema.OUTPUT_FILES)
    assert first == second  # byte for byte: the manifest names no store


def test_live_events_after_the_bootstrap_are_exported(served, tmp_path: Path):
    """What was served is what a trainer gets: a live event enters the export, a new video grows
    num_video_ids, and the user's new visit becomes a request."""
    _, path = served
    copy = tmp_path / "store.sqlite"
    with closing(sqlite3.connect(path)) as source, closing(sqlite3.connect(copy)) as target:
        source.backup(target)  # the shared fixture's store stays as it was
    with SQLiteHistoryStore(copy) as store:
        before = store.get_manifest()
        user = int(store.stored_user_ids()[0])
        last = int(store.read(np.array([user]), np.array([2**62])).timestamps_ms[-1])
        new_video = before.num_video_ids + 10
        store.append(EventBatch.from_records([{"user_id": user, "video_id": new_video, "time_ms": last + 86_400_000,
                                               "is_click": 1}]))
        manifest = export_store(store, tmp_path / "out", progress=False)
    exported = InferenceDataset(tmp_path / "out")
    assert manifest.counts.events == before.counts.events + 1
    assert manifest.counts.requests == before.counts.requests + 1
    assert manifest.num_video_ids == new_video + 1
    events = exported.user_events(user, 0, exported.history_length(user))
    assert events.video_ids[-1] == new_video and events.action_weights[-1] == 1 << schema.TASKS.index("click")
    last_request = np.flatnonzero(exported.requests.user_id == user)[-1]
    assert exported.requests.end[last_request] == exported.history_length(user) - 1


def test_params_override_the_store_manifests(served, tmp_path: Path):
    root, path = served
    params = PreprocessParams(session_gap_minutes=10.0, num_candidates=4)
    preprocess(root / "raw", tmp_path / "processed", params, progress=False)
    with SQLiteHistoryStore(path) as store:
        export_store(store, tmp_path / "out", params, progress=False)
    assert_same_output(InferenceDataset(tmp_path / "out"), InferenceDataset(tmp_path / "processed"))


def test_a_store_never_bootstrapped_is_refused(tmp_path: Path):
    with SQLiteHistoryStore(tmp_path / "store.sqlite") as store:
        store.append(EventBatch.from_records([{"user_id": 1, "video_id": 2, "time_ms": 1_650_000_000_000}]))
        with pytest.raises(ExportError, match=r"never bootstrapped.*vocabularies are unknown"):
            export_store(store, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_store_without_events_is_refused(served, tmp_path: Path):
    _, path = served
    with SQLiteHistoryStore(path) as store:
        manifest = store.get_manifest()
    with SQLiteHistoryStore(tmp_path / "store.sqlite") as store:
        store.put_manifest(manifest)
        with pytest.raises(ExportError, match="no events"):
            export_store(store, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_unsafe_outputs_are_refused(served, tmp_path: Path):
    root, path = served
    with SQLiteHistoryStore(path) as store:
        with pytest.raises(OutputDirError, match="contains the input"):
            export_store(store, root, progress=False)  # would hold the store's own file
        foreign = tmp_path / "foreign"
        foreign.mkdir()
        (foreign / "notes.txt").write_text("mine")
        with pytest.raises(OutputDirError, match="not a preprocessed output"):
            export_store(store, foreign, progress=False)
        with pytest.raises(ValueError, match="num_candidates"):
            export_store(store, tmp_path / "out", replace(store.get_manifest().params, num_candidates=0), progress=False)
    assert (foreign / "notes.txt").read_text() == "mine" and not (tmp_path / "out").exists()


def test_cli(served, tmp_path: Path, capsys):
    _, path = served
    out = tmp_path / "out"
    args = ["--store", f"sqlite://{path}", "--out", str(out), "--session_gap_min", "30", "--num_candidates", "3"]
    assert main([*args, "--no_progress"]) == 0
    assert "wrote" in capsys.readouterr().out
    dataset = InferenceDataset(out)
    assert dataset.manifest.params.num_candidates == 3
    assert dataset.manifest.params.session_gap_minutes == PreprocessParams().session_gap_minutes  # the store's
    assert dataset.requests.num_candidates.max() == 3
    SQLiteHistoryStore(tmp_path / "empty.sqlite").close()
    assert main(["--store", str(tmp_path / "empty.sqlite"), "--out", str(tmp_path / "none"), "--no_progress"]) == 1
    assert "never bootstrapped" in capsys.readouterr().err
    assert main(["--store", str(tmp_path / "typo.sqlite"), "--out", str(tmp_path / "none"), "--no_progress"]) == 1
    assert "no history store there" in capsys.readouterr().err and not (tmp_path / "typo.sqlite").exists()
    assert not (tmp_path / "none").exists()
