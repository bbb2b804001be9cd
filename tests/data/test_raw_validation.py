"""Raw input the type checks alone let through or report badly: times outside the accepted range,
bytes that are not UTF-8. Each gives one error line naming file, line (and column) and nothing else."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import preprocessor_inference
from data import schema
from data.manifest import PreprocessParams
from data.preprocess import preprocess
from helpers import MINUTE, REPO_ROOT, T0, feature_row, log_row, snapshot, subprocess_env, write_raw_dir

FIRST_MS, LAST_MS = schema.TIME_MS_RANGE


def raw_dir(root: Path, late: list[dict[str, int]] | None = None) -> Path:
    """Users 1 and 2, two visits each in the early log; `late` (default: one more event each)."""
    early = [log_row(user, visit, T0 + visit * 60 * MINUTE) for user in (1, 2) for visit in range(2)]
    if late is None:
        late = [log_row(user, 9, T0 + 200 * MINUTE) for user in (1, 2)]
    return write_raw_dir(root, early, late, [feature_row(1), feature_row(2)])


def run_cli(data_dir: Path, out: Path) -> subprocess.CompletedProcess:
    """The CLI in its own process: whatever it prints, tracebacks included, is in the result."""
    command = [sys.executable, str(REPO_ROOT / "preprocessor_inference.py"), "--dataset_name", "kuairand-1k",
               "--data_dir", str(data_dir), "--output_dir", str(out), "--no_progress"]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env=subprocess_env(), timeout=300)


# ---------------------------------------------------------------- time_ms range
@pytest.mark.parametrize("value", [-(2**63), -5, 0, FIRST_MS - 1, LAST_MS + 1, 2**63 - 1])
def test_a_time_outside_the_accepted_range_is_refused(value: int, tmp_path: Path, capsys):
    late = [log_row(1, 9, T0 + 200 * MINUTE), log_row(2, 9, T0 + 200 * MINUTE)]
    late[1]["time_ms"] = value  # line 3 of the late log
    data = raw_dir(tmp_path / "raw", late)
    before = snapshot(tmp_path)
    argv = ["--dataset_name", "kuairand-1k", "--data_dir", str(data), "--output_dir", str(tmp_path / "out"),
            "--no_progress"]  # fmt: skip
    assert preprocessor_inference.main(argv) == 1
    err = capsys.readouterr().err
    for fragment in (schema.LOG_STANDARD_LATE, "column 'time_ms'", "line 3", f": {value} is outside", "2000-01-01"):
        assert fragment in err, (fragment, err)
    assert snapshot(tmp_path) == before


def test_times_at_both_ends_of_the_range_are_accepted(tmp_path: Path):
    late = [log_row(1, 9, FIRST_MS), log_row(2, 9, LAST_MS)]
    data = raw_dir(tmp_path / "raw", late)
    preprocess(data, tmp_path / "out", PreprocessParams(), progress=False)
    timestamps = pq.read_table(tmp_path / "out" / schema.SEQUENCES_FILE).column("timestamps").to_pylist()
    assert timestamps[0][0] == FIRST_MS and timestamps[1][-1] == LAST_MS


# ---------------------------------------------------------------- bytes that are not UTF-8
def replace_bytes(path: Path, line: int, old: bytes, new: bytes) -> None:
    """Replace `old` by `new` on 1-based `line` of `path`, byte for byte."""
    lines = path.read_bytes().split(b"\n")
    assert old in lines[line - 1]
    lines[line - 1] = lines[line - 1].replace(old, new, 1)
    path.write_bytes(b"\n".join(lines))


def assert_one_error_line(done: subprocess.CompletedProcess, *fragments: str) -> None:
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr  # no traceback, no stray output
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_invalid_utf8_in_a_user_feature_text_cell(tmp_path: Path):
    data = raw_dir(tmp_path / "raw")
    replace_bytes(data / schema.USER_FEATURES, 3, b"full_active", b"full_\xff\xfeactive")
    done = run_cli(data, tmp_path / "out")
    assert_one_error_line(done, schema.USER_FEATURES, "column 'user_active_degree'", "line 3", "invalid UTF-8")
    assert not (tmp_path / "out").exists()


def test_invalid_utf8_in_an_integer_cell(tmp_path: Path):
    data = raw_dir(tmp_path / "raw")
    replace_bytes(data / schema.LOG_STANDARD_EARLY, 5, b"2,1,", b"2,1\x80,")  # user 2's second video_id
    done = run_cli(data, tmp_path / "out")
    assert_one_error_line(done, schema.LOG_STANDARD_EARLY, "column 'video_id'", "line 5", "invalid UTF-8")


@pytest.mark.parametrize("garbage", [b"\xff\xfe\x00garbage\x80\xc3(\n", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"])
def test_garbage_appended_to_a_log(garbage: bytes, tmp_path: Path):
    data = raw_dir(tmp_path / "raw")
    log = data / schema.LOG_STANDARD_LATE
    first_garbage_line = len(log.read_bytes().splitlines()) + 1
    log.write_bytes(log.read_bytes() + garbage)
    done = run_cli(data, tmp_path / "out")
    assert_one_error_line(done, schema.LOG_STANDARD_LATE, f"line {first_garbage_line}:", "expected 19 columns")
