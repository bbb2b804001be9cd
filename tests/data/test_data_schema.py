"""The KuaiRand-1K schema, and the synthetic generator's conformance to it."""
from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

from data import schema
from data.synthetic import SyntheticConfig, generate, signal_config
from helpers import BEIJING

# Written out from the published KuaiRand-1K file description, not derived from data.schema.
LOG_HEADER = (
    "user_id,video_id,date,hourmin,time_ms,is_click,is_like,is_follow,is_comment,is_forward,"
    "is_hate,long_view,play_time_ms,duration_ms,profile_stay_time,comment_stay_time,"
    "is_profile_enter,is_rand,tab"
)
USER_FEATURES_HEADER = (
    "user_id,user_active_degree,is_lowactive_period,is_live_streamer,is_video_author,"
    "follow_user_num,follow_user_num_range,fans_user_num,fans_user_num_range,friend_user_num,"
    "friend_user_num_range,register_days,register_days_range,"
    + ",".join(f"onehot_feat{i}" for i in range(18))
)
SCALE = 0.006


@pytest.fixture(scope="module", params=["mixed", "sequential"])
def synthetic(request, tmp_path_factory):
    """The default data, and data whose events depend on their order: both keep every statistic."""
    out = tmp_path_factory.mktemp(request.param)
    return generate(out, scale=SCALE, seed=5, config=signal_config(request.param), progress=False)


def read_log(path: Path) -> dict[str, np.ndarray]:
    table = pacsv.read_csv(path)  # type inference, as a user's first look would
    return {name: table.column(name).to_numpy() for name in table.column_names}, table.schema


# ---------------------------------------------------------------- schema constants
def test_schema_headers_match_the_published_ones():
    assert ",".join(schema.LOG_COLUMNS) == LOG_HEADER
    assert ",".join(schema.USER_FEATURE_COLUMNS) == USER_FEATURES_HEADER
    assert len(schema.USER_FEATURE_COLUMNS) == 31
    assert schema.RAW_FILES == (
        "log_standard_4_08_to_4_21_1k.csv", "log_standard_4_22_to_5_08_1k.csv",
        "log_random_4_22_to_5_08_1k.csv", "user_features_1k.csv",
        "video_features_basic_1k.csv", "video_features_statistic_1k.csv",
    )  # fmt: skip


def test_action_bits():
    assert schema.TASKS == ("click", "like", "follow", "comment", "forward", "hate", "long_view", "profile_enter")
    flags = {c: np.zeros(8, dtype=np.int64) for c in schema.ACTION_COLUMNS}
    for row, column in enumerate(schema.ACTION_COLUMNS):
        flags[column][row] = 1
    assert schema.action_weights(flags).tolist() == [1, 2, 4, 8, 16, 32, 64, 128]
    labels = schema.action_labels(np.array([0, 1 + 64, 255, 32]))
    assert labels.dtype == np.float32
    assert labels.tolist() == [[0] * 8, [1, 0, 0, 0, 0, 0, 1, 0], [1] * 8, [0, 0, 0, 0, 0, 1, 0, 0]]


def test_context_features_cover_the_categorical_columns():
    names = schema.CONTEXT_FEATURE_NAMES
    assert len(names) == 26 and len(set(names)) == 26
    assert set(names) <= set(schema.USER_FEATURE_COLUMNS)
    raw_counts = {"user_id", "follow_user_num", "fans_user_num", "friend_user_num", "register_days"}
    assert set(schema.USER_FEATURE_COLUMNS) - set(names) == raw_counts


@pytest.mark.parametrize(
    "when, date, hourmin",
    [
        (dt.datetime(2022, 4, 8, 0, 0, tzinfo=BEIJING), 20220408, 0),
        (dt.datetime(2022, 4, 21, 23, 59, 59, 999000, tzinfo=BEIJING), 20220421, 2300),
        (dt.datetime(2022, 4, 21, 16, 30, tzinfo=dt.timezone.utc), 20220422, 0),  # 00:30 in Beijing
        (dt.datetime(2022, 5, 8, 13, 5, tzinfo=BEIJING), 20220508, 1300),
    ],
)
def test_beijing_date_hourmin(when, date, hourmin):
    got_date, got_hourmin = schema.beijing_date_hourmin(np.array([int(when.timestamp() * 1000)]))
    assert (int(got_date[0]), int(got_hourmin[0])) == (date, hourmin)


# ---------------------------------------------------------------- generated files
def test_generator_writes_six_files_with_exact_headers(synthetic):
    files = sorted(p.name for p in synthetic.out_dir.iterdir())
    assert files == sorted(schema.RAW_FILES)
    headers = {
        **{name: LOG_HEADER for name in (*schema.STANDARD_LOGS, schema.LOG_RANDOM)},
        schema.USER_FEATURES: USER_FEATURES_HEADER,
        schema.VIDEO_FEATURES_BASIC: ",".join(schema.VIDEO_BASIC_COLUMNS),
        schema.VIDEO_FEATURES_STATISTIC: ",".join(schema.VIDEO_STATISTIC_COLUMNS),
    }
    for name, header in headers.items():
        with open(synthetic.out_dir / name) as f:
            assert f.readline().rstrip("\n") == header, name
    for name in (*schema.STANDARD_LOGS, schema.LOG_RANDOM):
        _, table_schema = read_log(synthetic.out_dir / name)
        assert all(field.type == pa.int64() for field in table_schema), name
    rows = {name: pacsv.read_csv(synthetic.out_dir / name).num_rows for name in schema.RAW_FILES}
    assert rows == synthetic.rows


def test_generator_dates_and_hourmin_follow_time_ms(synthetic):
    ranges = {
        schema.LOG_STANDARD_EARLY: (20220408, 20220421, 0),
        schema.LOG_STANDARD_LATE: (20220422, 20220508, 0),
        schema.LOG_RANDOM: (20220422, 20220508, 1),
    }
    for name, (first, last, is_rand) in ranges.items():
        log, _ = read_log(synthetic.out_dir / name)
        assert log["date"].min() >= first and log["date"].max() <= last, name
        assert set(log["is_rand"].tolist()) == {is_rand}
        sample = np.linspace(0, len(log["time_ms"]) - 1, 500).astype(int)
        for i in sample:  # checked with the stdlib, independently of schema.beijing_date_hourmin
            local = dt.datetime.fromtimestamp(log["time_ms"][i] / 1000, BEIJING)
            assert log["date"][i] == int(local.strftime("%Y%m%d")) and log["hourmin"][i] == local.hour * 100


def test_generator_statistics(synthetic):
    logs = [read_log(synthetic.out_dir / name)[0] for name in schema.STANDARD_LOGS]
    log = {k: np.concatenate([part[k] for part in logs]) for k in logs[0]}
    n = len(log["user_id"])
    assert 0.8 * SCALE * 11_713_045 < n < 1.2 * SCALE * 11_713_045
    assert synthetic.num_users == round(1000 * SCALE**0.5)
    assert len(np.unique(logs[0]["user_id"])) <= len(np.unique(logs[1]["user_id"])) == synthetic.num_users
    published = {"is_click": 0.378, "long_view": 0.262, "is_like": 0.0156, "is_profile_enter": 0.0179}
    for column, rate in published.items():
        assert abs(log[column].mean() - rate) < 0.15 * rate + 0.002, column
    long_view = log["long_view"] == 1
    assert (long_view & (log["is_click"] == 1)).sum() / long_view.sum() > 0.98
    positive = log["duration_ms"] > 0
    assert 0.06 < 1 - positive.mean() < 0.10
    rule = log["play_time_ms"] >= np.minimum(log["duration_ms"], 18_000)
    assert 0.98 < (rule == long_view)[positive].mean() < 1.0  # holds up to a few planted breaks
    tabs, counts = np.unique(log["tab"], return_counts=True)
    assert tabs[np.argmax(counts)] == 1 and set(tabs.tolist()) <= set(range(15))
    # Exact duplicate rows and multi-item screens (several rows per user and time_ms).
    rows = np.stack([log[c] for c in schema.LOG_COLUMNS], axis=1)
    assert 0.003 < 1 - len(np.unique(rows, axis=0)) / n < 0.02
    _, per_screen = np.unique(np.stack([log["user_id"], log["time_ms"]], axis=1), axis=0, return_counts=True)
    assert per_screen.max() >= 3 and (per_screen > 1).mean() > 0.1
    random_log, _ = read_log(synthetic.out_dir / schema.LOG_RANDOM)
    assert random_log["is_click"].mean() < log["is_click"].mean()


def test_generator_heavy_tails(synthetic):
    logs = [read_log(synthetic.out_dir / name)[0] for name in schema.STANDARD_LOGS]
    users = np.concatenate([part["user_id"] for part in logs])
    videos = np.concatenate([part["video_id"] for part in logs])
    per_user = np.bincount(users)
    assert per_user.mean() > 1.2 * np.median(per_user) and per_user.max() > 3 * np.median(per_user)
    per_video = np.sort(np.bincount(videos))[::-1]
    assert per_video[: len(per_video) // 100].sum() > 0.05 * len(videos)  # top 1% of ids: > 5% of views


@pytest.mark.parametrize("synthetic", ["mixed"], indirect=True)
def test_generator_plants_a_learnable_signal(synthetic):
    """The user's taste for the video's cluster ranks clicks well above chance (on sequential data
    the taste is weaker: tests/data/test_synthetic_sequence.py)."""
    logs = [read_log(synthetic.out_dir / name)[0] for name in schema.STANDARD_LOGS]
    users = np.concatenate([part["user_id"] for part in logs])
    videos = np.concatenate([part["video_id"] for part in logs])
    click = np.concatenate([part["is_click"] for part in logs])
    score = synthetic.user_taste[users, synthetic.video_cluster[videos]]
    ranks = np.argsort(np.argsort(score, kind="stable")) + 1.0
    positives = click == 1
    n_pos, n_neg = positives.sum(), (~positives).sum()
    auc = (ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)  # Mann-Whitney U
    assert auc > 0.6


def test_user_features_file(synthetic):
    table = pacsv.read_csv(synthetic.out_dir / schema.USER_FEATURES)
    col = {name: table.column(name).to_pylist() for name in table.column_names}
    assert col["user_id"] == list(range(synthetic.num_users))
    assert -124 in col["is_live_streamer"]
    for name in schema.ONEHOT_WITH_MISSING:
        assert None in col[name], name
    assert set(col["follow_user_num_range"]) <= set(schema.FOLLOW_RANGES)
    assert set(col["fans_user_num_range"]) <= set(schema.FANS_RANGES)
    assert set(col["friend_user_num_range"]) <= set(schema.FRIEND_RANGES)
    assert set(col["register_days_range"]) <= set(schema.REGISTER_DAYS_RANGES)
    assert set(col["user_active_degree"]) <= {*schema.ACTIVE_DEGREES, schema.ACTIVE_DEGREE_UNKNOWN}
    for count, label in zip(col["follow_user_num"], col["follow_user_num_range"]):
        assert (count == 0) == (label == "0") and (count > 500) == (label == "500+")
    for days, label in zip(col["register_days"], col["register_days_range"]):
        low, _, high = label.partition("-")
        assert days >= int(low.rstrip("+")) and (not high or days <= int(high))


def test_generator_is_deterministic(tmp_path: Path):
    small = dict(scale=0.0005, progress=False)
    a = generate(tmp_path / "a", seed=1, **small)
    b = generate(tmp_path / "b", seed=1, **small)
    c = generate(tmp_path / "c", seed=2, **small)
    for name in schema.RAW_FILES:
        assert (a.out_dir / name).read_bytes() == (b.out_dir / name).read_bytes(), name
    assert (a.out_dir / schema.LOG_STANDARD_LATE).read_bytes() != (c.out_dir / schema.LOG_STANDARD_LATE).read_bytes()


def test_generator_scale_rule(tmp_path: Path):
    config = SyntheticConfig()
    s = generate(tmp_path / "s", scale=0.0004, seed=0, config=config, progress=False)
    assert s.num_users == round(config.num_users * 0.0004**0.5)
    assert s.num_videos == round(config.num_videos * 0.0004)
    with pytest.raises(ValueError, match="scale"):
        generate(tmp_path / "bad", scale=0.0)
