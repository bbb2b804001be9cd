"""The synthetic generator's side files: user features and the video feature tables (the pipeline
reads their `tag` column; the rest is representative)."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from data import schema
from data.synthetic_world import SyntheticConfig, World


def write_csv(path: Path, table: pa.Table) -> None:
    """pyarrow quotes header names; the real files have a plain header line, so write it ourselves."""
    with open(path, "wb") as f:
        f.write((",".join(table.column_names) + "\n").encode())
        pacsv.write_csv(table, f, pacsv.WriteOptions(include_header=False, quoting_style="needed"))


def write_user_features(path: Path, rng: np.random.Generator, world: World, log_users: np.ndarray) -> int:
    """One row per user with the real columns and value labels. Activity drives
    user_active_degree; counts and their *_range labels agree; is_live_streamer has
    -124 (unknown) and the onehot columns with missing values have a few empty cells."""
    n = world.num_users
    activity_rank = np.argsort(np.argsort(-np.bincount(log_users, minlength=n))) / n  # 0 = most active
    degree = np.select(
        [activity_rank < 0.4, activity_rank < 0.65, activity_rank < 0.85, activity_rank < 0.95],
        list(schema.ACTIVE_DEGREES), schema.ACTIVE_DEGREE_UNKNOWN,
    )
    follow = np.where(rng.random(n) < 0.05, 0, rng.lognormal(np.log(60), 1.2, n).astype(np.int64))
    fans = np.where(rng.random(n) < 0.1, 0, np.minimum(rng.lognormal(np.log(8), 2.0, n), 999_999).astype(np.int64))
    friends = np.where(rng.random(n) < 0.1, 0, rng.lognormal(np.log(8), 1.2, n).astype(np.int64))
    register_days = rng.integers(15, 2_500, n)
    onehot_cardinality = (2, 7, 50, 1000, 8, 8, 10, 40, 10, 8, 5, 5, 3, 4, 5, 3, 2, 2)
    onehot = {f"onehot_feat{i}": rng.integers(0, c, n) for i, c in enumerate(onehot_cardinality)}
    for name in schema.ONEHOT_WITH_MISSING:  # float columns with a few empty cells
        onehot[name] = onehot[name].astype(np.float64)
        onehot[name][rng.choice(n, size=max(1, round(0.003 * n)), replace=False)] = np.nan
    live = rng.choice([0, 1, schema.IS_LIVE_STREAMER_UNKNOWN], size=n, p=[0.85, 0.05, 0.10])
    columns = {
        "user_id": np.arange(n),
        "user_active_degree": degree,
        "is_lowactive_period": (rng.random(n) < 0.05).astype(np.int64),
        "is_live_streamer": live,
        "is_video_author": (rng.random(n) < 0.3).astype(np.int64),
        "follow_user_num": follow,
        "follow_user_num_range": _range_labels(follow, [0, 10, 50, 100, 150, 250, 500], schema.FOLLOW_RANGES),
        "fans_user_num": fans,
        "fans_user_num_range": _range_labels(fans, [0, 9, 99, 999, 4_999, 9_999, 99_999], schema.FANS_RANGES),
        "friend_user_num": friends,
        "friend_user_num_range": _range_labels(friends, [0, 4, 29, 59, 119, 249], schema.FRIEND_RANGES),
        "register_days": register_days,
        "register_days_range": _range_labels(register_days, [30, 60, 90, 180, 365, 730], schema.REGISTER_DAYS_RANGES),
        **onehot,
    }

    def cell(value) -> str:
        if isinstance(value, float):
            return "" if np.isnan(value) else f"{value:.1f}"  # pandas-style float column
        return str(value)

    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(schema.USER_FEATURE_COLUMNS)
        rows = zip(*(np.asarray(columns[c]).tolist() for c in schema.USER_FEATURE_COLUMNS))
        writer.writerows([cell(v) for v in row] for row in rows)
    return n


def _range_labels(values: np.ndarray, upper: list[int], labels: tuple[str, ...]) -> np.ndarray:
    """Counts -> bucket labels; bucket i holds values <= upper[i], the last is open-ended."""
    return np.asarray(labels, dtype=object)[np.searchsorted(upper, values, side="left")]


def write_video_features(out: Path, rng: np.random.Generator, world: World, config: SyntheticConfig) -> dict[str, int]:
    """Per-video tables (schema.VIDEO_*_COLUMNS): `tag` follows the clusters (`video_tags`), the rest
    is representative."""
    n = world.num_videos
    vid = np.arange(n, dtype=np.int64)
    popularity = rng.lognormal(0.0, 1.5, n)

    def text(choices: list[str], p: list[float]) -> pa.Array:
        return pa.array(np.asarray(choices, dtype=object)[rng.choice(len(choices), n, p=p)], pa.string())

    upload_day = (np.datetime64("2022-05-08") - rng.integers(0, 900, n)).astype("datetime64[D]")
    basic = pa.table({
        "video_id": vid,
        "author_id": video_authors(rng, world, config),
        "video_type": text(["NORMAL", "AD"], [0.97, 0.03]),
        "upload_dt": pa.array(np.datetime_as_string(upload_day), pa.string()),
        "upload_type": text(["ShortImport", "LongImport", "Web", "PictureSet"], [0.7, 0.15, 0.1, 0.05]),
        "visible_status": text(["public", "private"], [0.98, 0.02]),
        "video_duration": world.video_duration_ms.astype(np.float64),
        "server_width": rng.choice([720, 1080, 540], n),
        "server_height": rng.choice([1280, 1920, 960], n),
        "music_id": rng.integers(0, max(1, n // 10), n),
        "music_type": rng.choice([4, 9, 11], n),
        "tag": pa.array(video_tags(rng, world, config), pa.string()),
    })  # fmt: skip
    show = rng.poisson(popularity * 200).astype(np.int64)
    play = rng.binomial(show, 0.4)
    statistic = pa.table({
        "video_id": vid,
        "counts": rng.integers(1, 32, n),
        "show_cnt": show,
        "show_user_num": rng.binomial(show, 0.9),
        "play_cnt": play,
        "play_user_num": rng.binomial(play, 0.9),
        "play_duration": play * (world.video_duration_ms // 2),
        "complete_play_cnt": rng.binomial(play, 0.3),
        "valid_play_cnt": rng.binomial(play, 0.6),
        "long_time_play_cnt": rng.binomial(play, 0.25),
        "like_cnt": rng.binomial(play, 0.04),
        "comment_cnt": rng.binomial(play, 0.008),
        "follow_cnt": rng.binomial(play, 0.003),
        "share_cnt": rng.binomial(play, 0.005),
        "collect_cnt": rng.binomial(play, 0.002),
    })  # fmt: skip
    assert basic.column_names == list(schema.VIDEO_BASIC_COLUMNS)
    assert statistic.column_names == list(schema.VIDEO_STATISTIC_COLUMNS)
    write_csv(out / schema.VIDEO_FEATURES_BASIC, basic)
    write_csv(out / schema.VIDEO_FEATURES_STATISTIC, statistic)
    return {schema.VIDEO_FEATURES_BASIC: n, schema.VIDEO_FEATURES_STATISTIC: n}



def video_tags(rng: np.random.Generator, world: World, config: SyntheticConfig) -> np.ndarray:
    """[V] tag cells: category ids, comma-separated, the primary first. Clusters are grouped
    `config.clusters_per_tag` at a time into categories (ids 1..C in a random order); `config.tag_fidelity`
    of the videos carry their cluster's category as the primary tag, the others a uniformly random one;
    `config.second_tag_share` list a second, random category after it."""
    k = len(world.cluster_share)
    num_categories = -(-k // config.clusters_per_tag)
    category = (rng.permutation(num_categories) + 1)[rng.permutation(k) % num_categories]
    primary = np.where(rng.random(world.num_videos) < config.tag_fidelity,
                       category[world.video_cluster], rng.integers(1, num_categories + 1, world.num_videos))
    second = rng.integers(1, num_categories + 1, world.num_videos)
    cells = primary.astype(str).astype(object)
    listed = rng.random(world.num_videos) < config.second_tag_share
    cells[listed] = cells[listed] + "," + second[listed].astype(str).astype(object)
    return cells


def video_authors(rng: np.random.Generator, world: World, config: SyntheticConfig) -> np.ndarray:
    """[V] author ids: each cluster has its own authors (about `config.videos_per_author` videos each),
    and `config.author_fidelity` of the videos are uploaded by one of their cluster's authors, the rest by
    any author: creators specialise, not perfectly."""
    k, n = len(world.cluster_share), world.num_videos
    per_cluster = max(1, round(n / (k * config.videos_per_author)))
    own = world.video_cluster * per_cluster + rng.integers(0, per_cluster, n)
    return np.where(rng.random(n) < config.author_fidelity, own, rng.integers(0, k * per_cluster, n))
