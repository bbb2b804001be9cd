"""The output directory: unsafe targets refused, replacement atomic across a kill at any step,
leftovers of a killed run seen through by readers and repaired by the next run."""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import preprocessor_inference
from data.dataset import InferenceDataset
from data.manifest import PreprocessParams
from data.output import OutputDirError
from data.preprocess import preprocess
from helpers import MINUTE, REPO_ROOT, T0, feature_row, log_row, snapshot, subprocess_env, write_raw_dir

KILLER = Path(__file__).with_name("kill_preprocess.py")


def log_rows(bad_time: bool = False) -> list[dict[str, int]]:
    """Two users with three visits of three events each, so every run yields requests."""
    rows = [
        log_row(user, 10 * visit + k, T0 + visit * 60 * MINUTE + k * 1_000 + user)
        for user in (1, 2) for visit in range(3) for k in range(3)
    ]  # fmt: skip
    if bad_time:
        rows[4]["time_ms"] = -1
    return rows


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    rows = log_rows()
    return write_raw_dir(tmp_path / "raw", rows[:9], rows[9:], [feature_row(1), feature_row(2)])


@pytest.fixture
def bad_raw(tmp_path: Path) -> Path:
    rows = log_rows(bad_time=True)
    return write_raw_dir(tmp_path / "bad", rows[:9], rows[9:], [feature_row(1), feature_row(2)])


@pytest.fixture
def out(raw: Path, tmp_path: Path) -> Path:
    """A previous output (num_candidates 1), alone in its parent directory."""
    path = tmp_path / "outputs" / "kuairand"
    preprocess(raw, path, PreprocessParams(num_candidates=1), progress=False)
    return path


def cli(data_dir: Path, out: Path) -> int:
    argv = ["--dataset_name", "kuairand-1k", "--data_dir", str(data_dir), "--output_dir", str(out), "--no_progress"]
    return preprocessor_inference.main(argv)


def run(raw: Path, out: Path, num_candidates: int) -> None:
    preprocess(raw, out, PreprocessParams(num_candidates=num_candidates), progress=False)


def num_candidates_read_back(out: Path) -> int:
    """Which run's output a reader finds at `out` (each run below uses its own num_candidates)."""
    return InferenceDataset(out).manifest.params.num_candidates


def alone(out: Path) -> bool:
    return [p.name for p in out.parent.iterdir()] == [out.name]


# ---------------------------------------------------------------- unsafe targets
def test_refuses_an_output_folder_that_also_holds_the_input(raw: Path, tmp_path: Path, capsys):
    folder = raw.parent  # KuaiRand-1K/, the CSVs under data/, and a previous output beside them
    run(raw, tmp_path / "previous", 1)
    for path in (tmp_path / "previous").iterdir():
        shutil.copy(path, folder / path.name)
    before = snapshot(tmp_path)
    capsys.readouterr()
    assert cli(folder, folder) == 1
    err = capsys.readouterr().err
    assert "contains the input directory" in err and str(raw) in err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("where, relation", [
    (lambda raw: raw, "is"),
    (lambda raw: raw / "processed", "is inside"),
    (lambda raw: raw.parent, "contains"),
    (lambda raw: raw.parent.parent, "contains"),
])  # fmt: skip
def test_refuses_an_output_overlapping_the_input(where, relation: str, raw: Path, tmp_path: Path):
    before = snapshot(tmp_path)
    with pytest.raises(OutputDirError, match=f"the output directory {relation} the input directory"):
        run(raw.parent, where(raw), 1)  # the KuaiRand-1K folder as --data_dir: its data/ is the input
    assert snapshot(tmp_path) == before


def test_refuses_a_previous_output_that_also_holds_other_files(out: Path, raw: Path):
    (out / "notes.txt").write_text("keep me")
    (out / "data").mkdir()
    before = snapshot(out.parent)
    with pytest.raises(OutputDirError, match=r"did not write \(data, notes.txt\)"):
        run(raw, out, 2)
    assert snapshot(out.parent) == before


def test_refuses_a_symlinked_output(out: Path, raw: Path, tmp_path: Path):
    link = tmp_path / "link"
    link.symlink_to(out)
    before = snapshot(out.parent)
    with pytest.raises(OutputDirError, match="symbolic link"):
        run(raw, link, 2)
    assert snapshot(out.parent) == before and link.is_symlink()


def test_replacing_removes_nothing_but_the_previous_output(out: Path, raw: Path):
    (out.parent / "notes.txt").write_text("a sibling")
    (out.parent / "other").mkdir()
    siblings = {k: v for k, v in snapshot(out.parent).items() if not k.startswith(out.name)}
    run(raw, out, 2)
    assert {k: v for k, v in snapshot(out.parent).items() if not k.startswith(out.name)} == siblings
    assert num_candidates_read_back(out) == 2


def test_refuses_while_another_run_is_writing(out: Path, raw: Path):
    live = out.with_name(f".{out.name}.tmp-{os.getpid()}-0123abcd")
    live.mkdir()
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what a running preprocessor holds on its directory
        before = snapshot(out.parent)
        with pytest.raises(OutputDirError, match="another preprocessing run is writing it"):
            run(raw, out, 2)
        assert snapshot(out.parent) == before
    finally:
        os.close(fd)
    run(raw, out, 2)  # that run is gone: its directory is a leftover, cleaned up
    assert alone(out) and num_candidates_read_back(out) == 2


def test_refuses_to_touch_a_leftover_holding_other_files(out: Path, raw: Path):
    leftover = out.with_name(f".{out.name}.old-1-0123abcd")
    leftover.mkdir()
    (leftover / "mine.txt").write_text("not the preprocessor's")
    before = snapshot(out.parent)
    with pytest.raises(OutputDirError, match=r"did not write \(mine.txt\)"):
        run(raw, out, 2)
    assert snapshot(out.parent) == before


def test_a_failed_swap_is_rolled_back(out: Path, raw: Path, monkeypatch):
    before = snapshot(out.parent)
    rename = os.rename
    calls = []

    def second_rename_fails(src, dst):
        calls.append(src)
        if len(calls) == 2:  # the new output into place, after the previous one was moved aside
            raise OSError(28, "No space left on device")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", second_rename_fails)
    with pytest.raises(OSError, match="No space left"):
        run(raw, out, 2)
    monkeypatch.undo()
    assert len(calls) == 3 and snapshot(out.parent) == before


# ---------------------------------------------------------------- killed runs
def kill_at(step: str, raw: Path, out: Path) -> None:
    """Run the preprocessor (num_candidates 2) in a child that SIGKILLs itself at `step`."""
    killed = subprocess.run(
        [sys.executable, str(KILLER), str(raw), str(out), "2", step],
        env=subprocess_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not alone(out), "the kill left nothing to repair"


# step -> the output a reader finds after the kill: 1 = the previous one, 2 = the killed run's
KILL_STEPS = {
    "after:write_table:1": 1,  # while writing the new files
    "before:rename:1": 1,  # new files complete, the swap not begun
    "after:rename:1": 2,  # between the two renames: the output directory itself is missing
    "after:rename:2": 2,  # swapped, the previous output not yet removed
    "after:unlink:1": 2,  # while removing the previous output
}


@pytest.mark.slow
@pytest.mark.parametrize("step", list(KILL_STEPS))
def test_a_kill_at_any_step_leaves_a_complete_output_that_a_rerun_puts_in_place(
    step: str, out: Path, raw: Path, bad_raw: Path
):
    kill_at(step, raw, out)
    assert num_candidates_read_back(out) == KILL_STEPS[step]
    before = snapshot(out.parent)
    assert cli(bad_raw, out) == 1  # a refused rerun repairs nothing either: it changes nothing
    assert snapshot(out.parent) == before
    run(raw, out, 3)
    assert alone(out) and num_candidates_read_back(out) == 3


@pytest.mark.slow
@pytest.mark.parametrize("step", ["after:write_table:1", "before:rename:1"])
def test_a_killed_first_run_leaves_no_output_and_a_rerun_cleans_up(step: str, raw: Path, tmp_path: Path):
    out = tmp_path / "outputs" / "kuairand"
    kill_at(step, raw, out)
    with pytest.raises(FileNotFoundError, match="not found"):
        InferenceDataset(out)
    run(raw, out, 3)
    assert alone(out) and num_candidates_read_back(out) == 3
