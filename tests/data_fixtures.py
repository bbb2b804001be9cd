"""Helpers for the data tests: hand-made raw KuaiRand-1K files and small generated ones.

Test modules import what they need (`from data_fixtures import ...`); pytest puts tests/
on sys.path (rootdir-relative imports), and the lead owns conftest.py.
"""
from __future__ import annotations

import datetime as dt
from pathlib import Path

from data import schema

BEIJING = dt.timezone(dt.timedelta(hours=8))
T0 = int(dt.datetime(2022, 4, 10, 9, 0, tzinfo=BEIJING).timestamp() * 1000)  # a morning in the early log
MINUTE = 60_000


def log_row(user_id: int, video_id: int, time_ms: int, **values: int) -> dict[str, int]:
    """One log row; date/hourmin follow time_ms (computed with the stdlib, not the code under
    test), unspecified columns get plain defaults."""
    local = dt.datetime.fromtimestamp(time_ms / 1000, BEIJING)
    row = {column: 0 for column in schema.LOG_COLUMNS}
    row.update(
        user_id=user_id, video_id=video_id, time_ms=time_ms,
        date=int(local.strftime("%Y%m%d")), hourmin=local.hour * 100,
        play_time_ms=1_000, duration_ms=10_000,
    )  # fmt: skip
    row.update(values)
    return row


def write_csv(path: Path, header: list[str] | tuple[str, ...], rows: list[list[object]]) -> Path:
    lines = [",".join(header)] + [",".join(str(v) for v in row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_log(path: Path, rows: list[dict[str, int]], columns: tuple[str, ...] = schema.LOG_COLUMNS) -> Path:
    return write_csv(path, columns, [[row[c] for c in columns] for row in rows])


def feature_row(user_id: int, **values: object) -> dict[str, object]:
    """A user_features row with valid defaults for all 31 columns."""
    row: dict[str, object] = {c: 0 for c in schema.USER_FEATURE_COLUMNS}
    row.update(
        user_id=user_id, user_active_degree="full_active", follow_user_num_range='"(0,10]"',
        fans_user_num_range="0", friend_user_num_range='"[1,5)"', register_days_range="15-30",
    )  # fmt: skip
    row.update(values)
    return row


def write_user_features(path: Path, rows: list[dict[str, object]]) -> Path:
    return write_csv(path, schema.USER_FEATURE_COLUMNS, [[row[c] for c in schema.USER_FEATURE_COLUMNS] for row in rows])


def write_raw_dir(
    root: Path, early: list[dict[str, int]], late: list[dict[str, int]], features: list[dict[str, object]]
) -> Path:
    """A KuaiRand-1K/data directory with the two standard logs and user features."""
    data = root / "KuaiRand-1K" / "data"
    data.mkdir(parents=True)
    write_log(data / schema.LOG_STANDARD_EARLY, early)
    write_log(data / schema.LOG_STANDARD_LATE, late)
    write_user_features(data / schema.USER_FEATURES, features)
    return data


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` (relative path -> bytes): to prove a directory unchanged."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
