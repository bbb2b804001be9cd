"""Synthetic KuaiRand-1K: the six files with the real names, headers and dtypes.

    python -m data.synthetic --out DIR --scale S --seed N

The real dataset cannot be downloaded here, so the generator reproduces what the
pipeline depends on: dates split across the two standard logs, Beijing date/hourmin
consistent with time_ms, activity in sessions (bursts of "screens" of items sharing one
timestamp, separated by hours), heavy-tailed users and items, the published positive
rates, the long_view rule, the tab mix, ~8% duration_ms <= 0, exact duplicate rows and
a little time disorder. It plants a learnable signal: videos belong to clusters, each
user has a taste over clusters (a Dirichlet draw), exposure leans towards the taste and
the action probabilities rise with the user's taste for the video's cluster and with a
per-user propensity (some users click far more than others, as in the real logs).

Scale rule: users = 1000 * sqrt(scale) and events per user = 11,713 * sqrt(scale), so
the row count is 11.7M * scale while every user keeps many visits (scale 0.006 gives
~70k rows from ~77 users with ~900 events each). Videos = 4.37M * scale.
Everything is vectorised numpy; the same (scale, seed, config) gives identical files.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
from tqdm import tqdm

from data import schema

_T0 = schema.beijing_midnight_ms(schema.EARLY_DATES[0])  # 2022-04-08 00:00 +08:00
_T_LATE = schema.beijing_midnight_ms(schema.LATE_DATES[0])
_T_END = schema.beijing_midnight_ms(schema.LATE_DATES[1]) + schema.DAY_MS  # exclusive
_NUM_DAYS = (_T_END - _T0) // schema.DAY_MS  # 31
_LATE_DAY = (_T_LATE - _T0) // schema.DAY_MS  # 14
# Relative session-start intensity per Beijing hour (quiet at night, peak in the evening).
_DIURNAL = np.array([3, 2, 1.4, 1, .7, .6, .8, 1.5, 2.5, 3, 3, 3.5, 4.5, 4, 3.5, 3.5, 3.5, 4, 4.5, 5, 5.5, 6, 6, 5])


@dataclass(frozen=True)
class SyntheticConfig:
    """Statistics of the generated data; sizes are those of scale 1.0 (the real dataset).
    Rates marked unverified in KUAIRAND_1K.md are plain defaults here."""

    num_users: int = 1000
    standard_rows: int = 11_713_045  # both standard logs, duplicates included
    random_rows: int = 43_028
    num_videos: int = 4_371_900
    # activity
    events_per_user_sigma: float = 0.87  # lognormal: mean/median ~1.46 as in the real logs
    late_joiner_fraction: float = 0.017  # users absent from the early log (983 of 1000 present)
    session_mean_events: float = 32.0
    screen_mean_items: float = 2.5  # items shown together share one time_ms
    screen_gap_mean_s: float = 15.0
    duplicate_fraction: float = 0.008  # exact copies written right after the original row
    swap_fraction: float = 0.002  # adjacent same-user rows written in swapped order
    nonpositive_duration_fraction: float = 0.08
    long_view_rule_break_fraction: float = 0.005  # of rows with duration_ms > 0
    # items and the planted signal
    num_clusters: int = 64
    taste_concentration: float = 0.3  # Dirichlet alpha over clusters; small = peaked tastes
    taste_exposure: float = 0.7  # share of exposures drawn from the user's taste
    popularity_exponent: float = 2.0  # within-cluster rank = size * u**exponent (heavy head)
    signal_strength: float = 0.8  # logit slope in log(num_clusters * taste)
    user_propensity_std: float = 1.0  # per-user action logit offset: some users click far more than others
    # standard-log positive rates, in schema.TASKS order
    rates: tuple[float, ...] = (0.378, 0.0156, 0.0010, 0.0030, 0.0020, 0.0005, 0.262, 0.0179)
    long_view_click_share: float = 0.993  # of long views that also have a click
    random_click_rate: float = 0.174
    random_long_view_rate: float = 0.084
    tab_shares: tuple[tuple[int, float], ...] = ((1, .659), (0, .206), (4, .076), (2, .034), (6, .016))
    # the remaining share of tabs is spread evenly over the other tab values 0..14


@dataclass(frozen=True)
class SyntheticSummary:
    out_dir: Path
    scale: float
    seed: int
    rows: dict[str, int]  # file name -> data rows
    num_users: int
    num_videos: int
    user_taste: np.ndarray = field(repr=False)  # [num_users, num_clusters], rows sum to 1
    video_cluster: np.ndarray = field(repr=False)  # [num_videos] cluster of each video_id

    def to_json(self) -> str:
        keys = ("scale", "seed", "rows", "num_users", "num_videos")
        return json.dumps({"out_dir": str(self.out_dir), **{k: getattr(self, k) for k in keys}}, indent=2)


def generate(
    out_dir: Path | str, scale: float = 1.0, seed: int = 0, config: SyntheticConfig = SyntheticConfig(),
    progress: bool = True,
) -> SyntheticSummary:
    """Write the six KuaiRand-1K files into `out_dir` (it plays the role of `KuaiRand-1K/data`)."""
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    bar = tqdm(total=6, disable=not progress, file=sys.stderr, unit="step", desc="synthetic")
    world = _World.draw(rng, scale, config)
    bar.update()
    standard = _standard_events(rng, world, config)
    bar.update()
    random_log = _random_events(rng, world, scale, config)
    bar.update()
    early = standard["date"] <= schema.EARLY_DATES[1]  # split by date, as in the real files
    rows = {
        schema.LOG_STANDARD_EARLY: _write_log(out / schema.LOG_STANDARD_EARLY, standard, early),
        schema.LOG_STANDARD_LATE: _write_log(out / schema.LOG_STANDARD_LATE, standard, ~early),
        schema.LOG_RANDOM: _write_log(out / schema.LOG_RANDOM, random_log),
    }
    bar.update()
    rows[schema.USER_FEATURES] = _write_user_features(out / schema.USER_FEATURES, rng, world, standard["user_id"])
    bar.update()
    rows.update(_write_video_features(out, rng, world))
    bar.update()
    bar.close()
    return SyntheticSummary(
        out, scale, seed, rows, world.num_users, world.num_videos, world.taste, world.video_cluster
    )


# ---------------------------------------------------------------- the world: users, videos, tastes
@dataclass(frozen=True)
class _World:
    num_users: int
    num_videos: int
    events_per_user: np.ndarray  # [U] target events (before duplicates)
    first_day: np.ndarray  # [U] 0, or the first late day for late joiners
    taste: np.ndarray  # [U, K]
    cluster_share: np.ndarray  # [K] global exposure share of each cluster
    cluster_offset: np.ndarray  # [K + 1] videos of cluster c have rank index [off[c], off[c+1])
    video_of_index: np.ndarray  # [V] cluster-major index -> video_id (a random permutation)
    video_cluster: np.ndarray  # [V] video_id -> cluster
    video_duration_ms: np.ndarray  # [V] intrinsic duration by video_id
    propensity: np.ndarray  # [U] user's action offset, in affinity units

    @classmethod
    def draw(cls, rng: np.random.Generator, scale: float, cfg: SyntheticConfig) -> _World:
        num_users = max(2, round(cfg.num_users * scale**0.5))
        num_videos = max(cfg.num_clusters, round(cfg.num_videos * scale))
        weight = rng.lognormal(0.0, cfg.events_per_user_sigma, num_users)
        events = cfg.standard_rows * scale / (1 + cfg.duplicate_fraction) * weight / weight.sum()
        events = np.maximum(np.round(events), 4).astype(np.int64)
        late = rng.random(num_users) < cfg.late_joiner_fraction
        taste = rng.dirichlet(np.full(cfg.num_clusters, cfg.taste_concentration), num_users)
        cluster_share = rng.dirichlet(np.full(cfg.num_clusters, 2.0))
        sizes = np.full(cfg.num_clusters, num_videos // cfg.num_clusters)
        sizes[: num_videos % cfg.num_clusters] += 1
        offset = np.concatenate(([0], np.cumsum(sizes)))
        video_of_index = rng.permutation(num_videos)
        video_cluster = np.empty(num_videos, dtype=np.int64)
        video_cluster[video_of_index] = np.repeat(np.arange(cfg.num_clusters), sizes)
        duration = np.clip(rng.lognormal(np.log(25_000), 0.8, num_videos), 3_000, 600_000).astype(np.int64)
        propensity = rng.normal(0.0, cfg.user_propensity_std / cfg.signal_strength, num_users)
        return cls(
            num_users, num_videos, events, np.where(late, _LATE_DAY, 0), taste, cluster_share, offset,
            video_of_index, video_cluster, duration, propensity,
        )

    def affinity(self, user: np.ndarray, video: np.ndarray) -> np.ndarray:
        """[N] the user's propensity plus log(K * taste of the user for the video's cluster),
        the latter clipped: 0 = an average user, indifferent to the cluster."""
        k = self.taste.shape[1]
        taste = np.clip(np.log(k * self.taste[user, self.video_cluster[video]] + 1e-12), -4.0, 3.0)
        return taste + self.propensity[user]

    def sample_videos(
        self, rng: np.random.Generator, user: np.ndarray, taste_exposure: float, exponent: float
    ) -> np.ndarray:
        """[N] users -> [N] video ids: cluster from the user's taste (or the global mix), then a
        heavy-headed rank inside the cluster."""
        n, (num_users, k) = len(user), self.taste.shape
        from_taste = rng.random(n) < taste_exposure
        # Inverse-CDF over each user's taste row at once: row u's CDF is shifted by u, so one
        # searchsorted over the flattened matrix serves every user.
        cdf = np.cumsum(self.taste, axis=1)
        cdf /= cdf[:, -1:]
        shifted = (cdf + np.arange(num_users)[:, None]).ravel()
        cluster = np.searchsorted(shifted, user + rng.random(n) * (1 - 1e-12), side="right") - user * k
        global_cdf = np.cumsum(self.cluster_share)
        global_pick = np.searchsorted(global_cdf / global_cdf[-1], rng.random(n) * (1 - 1e-12), side="right")
        cluster = np.where(from_taste, np.minimum(cluster, k - 1), global_pick)
        size = np.diff(self.cluster_offset)[cluster]
        rank = np.minimum((size * rng.random(n) ** exponent).astype(np.int64), size - 1)
        return self.video_of_index[self.cluster_offset[cluster] + rank]


# ---------------------------------------------------------------- standard logs
def _standard_events(rng: np.random.Generator, world: _World, cfg: SyntheticConfig) -> dict[str, np.ndarray]:
    # Sessions: starts on a random active day at a diurnal hour; sorted per user by start.
    per_user = np.maximum(2, np.round(world.events_per_user / cfg.session_mean_events)).astype(np.int64)
    s_user = np.repeat(np.arange(world.num_users), per_user)
    first_day = world.first_day[s_user]
    day = first_day + (rng.random(len(s_user)) * (_NUM_DAYS - first_day)).astype(np.int64)
    # Every user is active in the late log (as all 1,000 real users are): its last session
    # falls on a late day.
    last = np.cumsum(per_user) - 1
    day[last] = np.maximum(day[last], _LATE_DAY + rng.integers(0, _NUM_DAYS - _LATE_DAY, len(last)))
    hour = rng.choice(24, size=len(s_user), p=_DIURNAL / _DIURNAL.sum())
    s_start = _T0 + day * schema.DAY_MS + hour * 3_600_000 + rng.integers(0, 3_600_000, len(s_user))
    order = np.lexsort((s_start, s_user))
    s_user, s_start = s_user[order], s_start[order]
    # Session lengths: each user's target split by exponential weights (>= 1 event each).
    weight = rng.exponential(1.0, len(s_user))
    weight /= np.bincount(s_user, weights=weight)[s_user]
    mean = world.events_per_user[s_user] * weight
    length = 1 + rng.poisson(np.maximum(mean - 1, 0))
    e_session = np.repeat(np.arange(len(s_user)), length)
    # Screens: runs of items with one timestamp, a few seconds apart inside a session.
    n = len(e_session)
    new_screen = np.ones(n, dtype=bool)
    new_screen[1:] = (e_session[1:] != e_session[:-1]) | (rng.random(n - 1) < 1 / cfg.screen_mean_items)
    screen_session = e_session[new_screen]
    gap = 1_000 + rng.exponential(cfg.screen_gap_mean_s * 1_000, len(screen_session)).astype(np.int64)
    elapsed = np.cumsum(gap)
    first_screen = np.flatnonzero(np.diff(screen_session, prepend=-1) != 0)
    elapsed -= np.repeat(elapsed[first_screen], np.diff(first_screen, append=len(screen_session)))
    screen_time = s_start[screen_session] + elapsed
    screen_tab = _tabs(rng, len(screen_session), cfg)
    screen_index = np.cumsum(new_screen) - 1

    user = s_user[e_session]
    time_ms = screen_time[screen_index]
    inside = time_ms < _T_END
    user, time_ms, tab = user[inside], time_ms[inside], screen_tab[screen_index][inside]
    video = world.sample_videos(rng, user, cfg.taste_exposure, cfg.popularity_exponent)
    z = world.affinity(user, video)
    actions = _actions(rng, z, cfg.rates, cfg)
    log = _assemble(rng, world, user, video, time_ms, actions, tab, is_rand=0, cfg=cfg)
    return _disorder(rng, log, cfg)


def _random_events(
    rng: np.random.Generator, world: _World, scale: float, cfg: SyntheticConfig
) -> dict[str, np.ndarray]:
    """The random log: uniformly exposed videos, late dates only, one item per screen."""
    n = max(1, round(cfg.random_rows * scale))
    user = rng.integers(0, world.num_users, n)
    time_ms = rng.integers(_T_LATE, _T_END, n)
    order = np.lexsort((time_ms, user))
    user, time_ms = user[order], time_ms[order]
    video = rng.integers(0, world.num_videos, n)
    rates = np.array(cfg.rates) * (cfg.random_click_rate / cfg.rates[0])  # rarer actions scale with clicks
    rates[schema.TASKS.index("click")] = cfg.random_click_rate
    rates[schema.TASKS.index("long_view")] = cfg.random_long_view_rate
    actions = _actions(rng, world.affinity(user, video), tuple(rates), cfg)
    return _assemble(rng, world, user, video, time_ms, actions, _tabs(rng, n, cfg), is_rand=1, cfg=cfg)


def _actions(
    rng: np.random.Generator, z: np.ndarray, rates: tuple[float, ...], cfg: SyntheticConfig
) -> dict[str, np.ndarray]:
    """[N] affinities -> the 8 action flags. Click, and given a click long_view, like, follow,
    comment, forward and profile_enter, rise with affinity; hate falls with it. Intercepts
    are calibrated so each overall rate matches `rates`."""
    rate = dict(zip(schema.TASKS, rates))
    slope = cfg.signal_strength
    click = rng.random(len(z)) < _sigmoid(_intercept(z, slope, rate["click"]) + slope * z)
    clicked = z[click]
    out = {"click": click}
    lv_click = rate["long_view"] * cfg.long_view_click_share / rate["click"]
    lv_other = rate["long_view"] * (1 - cfg.long_view_click_share) / (1 - rate["click"])
    p_lv = np.full(len(z), lv_other)
    p_lv[click] = _sigmoid(_intercept(clicked, slope, lv_click) + slope * clicked)
    out["long_view"] = rng.random(len(z)) < p_lv
    for task in ("like", "follow", "comment", "forward", "profile_enter"):
        p = np.zeros(len(z))
        p[click] = _sigmoid(_intercept(clicked, slope / 2, rate[task] / rate["click"]) + slope / 2 * clicked)
        out[task] = rng.random(len(z)) < p
    out["hate"] = rng.random(len(z)) < _sigmoid(_intercept(z, -slope / 2, rate["hate"]) - slope / 2 * z)
    return {column: out[task].astype(np.int64) for task, column in zip(schema.TASKS, schema.ACTION_COLUMNS)}


def _assemble(
    rng: np.random.Generator, world: _World, user: np.ndarray, video: np.ndarray, time_ms: np.ndarray,
    actions: dict[str, np.ndarray], tab: np.ndarray, is_rand: int, cfg: SyntheticConfig,
) -> dict[str, np.ndarray]:
    """Per-event columns -> a full log table (LOG_COLUMNS order), durations consistent with
    the long_view rule except for a planted small share of rule breaks."""
    n = len(user)
    duration = world.video_duration_ms[video].copy()
    duration[rng.random(n) < cfg.nonpositive_duration_fraction] = 0
    threshold = np.minimum(duration, schema.LONG_VIEW_CAP_MS)
    long_view = actions["long_view"] == 1
    broken = (duration > 0) & (rng.random(n) < cfg.long_view_rule_break_fraction)
    reach = long_view ^ broken  # whether play_time reaches the threshold
    u = rng.random(n)
    play = np.where(
        reach,
        threshold + u * np.maximum(duration - threshold, 2_000),  # >= threshold
        u * threshold,  # < threshold
    )
    # The rule does not apply to duration_ms <= 0: long views just play longer.
    play = np.where(duration > 0, play, np.where(long_view, 20_000 + u * 40_000, u * 3_000))
    date, hourmin = schema.beijing_date_hourmin(time_ms)
    log = {
        "user_id": user.astype(np.int64),
        "video_id": video.astype(np.int64),
        "date": date,
        "hourmin": hourmin,
        "time_ms": time_ms.astype(np.int64),
        **actions,
        "play_time_ms": np.floor(play).astype(np.int64),
        "duration_ms": duration,
        "profile_stay_time": actions["is_profile_enter"] * rng.lognormal(np.log(8_000), 0.7, n).astype(np.int64),
        "comment_stay_time": actions["is_comment"] * rng.lognormal(np.log(20_000), 0.7, n).astype(np.int64),
        "is_rand": np.full(n, is_rand, dtype=np.int64),
        "tab": tab.astype(np.int64),
    }
    return {name: log[name] for name in schema.LOG_COLUMNS}


def _disorder(rng: np.random.Generator, log: dict[str, np.ndarray], cfg: SyntheticConfig) -> dict[str, np.ndarray]:
    """Like the real files: exact duplicate rows, and a few adjacent rows out of time order."""
    n = len(log["user_id"])
    index = np.repeat(np.arange(n), 1 + (rng.random(n) < cfg.duplicate_fraction))
    user = log["user_id"][index]
    pick = np.flatnonzero(rng.random(len(index) - 1) < cfg.swap_fraction)
    pick = pick[(pick % 2 == 0) & (user[pick] == user[pick + 1])]  # disjoint pairs, same user
    index[pick], index[pick + 1] = index[pick + 1], index[pick].copy()
    return {name: column[index] for name, column in log.items()}


def _tabs(rng: np.random.Generator, n: int, cfg: SyntheticConfig) -> np.ndarray:
    named = dict(cfg.tab_shares)
    others = [t for t in range(15) if t not in named]
    rest = max(0.0, 1.0 - sum(named.values()))
    values = [*named, *others]
    p = np.array([*named.values(), *([rest / len(others)] * len(others))])
    return rng.choice(values, size=n, p=p / p.sum())


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _intercept(z: np.ndarray, slope: float, target: float) -> float:
    """b with mean(sigmoid(b + slope * z)) == target (bisection on a fixed subsample)."""
    if len(z) == 0:
        return 0.0
    sample = z[:: max(1, len(z) // 200_000)]
    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if _sigmoid(mid + slope * sample).mean() < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# ---------------------------------------------------------------- writing
def _write_log(path: Path, log: dict[str, np.ndarray], rows: np.ndarray | None = None) -> int:
    pick = slice(None) if rows is None else rows
    table = pa.table({name: pa.array(log[name][pick], pa.int64()) for name in schema.LOG_COLUMNS})
    _write_csv(path, table)
    return table.num_rows


def _write_csv(path: Path, table: pa.Table) -> None:
    """pyarrow quotes header names; the real files have a plain header line, so write it ourselves."""
    with open(path, "wb") as f:
        f.write((",".join(table.column_names) + "\n").encode())
        pacsv.write_csv(table, f, pacsv.WriteOptions(include_header=False, quoting_style="needed"))


def _write_user_features(path: Path, rng: np.random.Generator, world: _World, log_users: np.ndarray) -> int:
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


def _write_video_features(out: Path, rng: np.random.Generator, world: _World) -> dict[str, int]:
    """Representative per-video tables (not read by the pipeline; see schema.VIDEO_*_COLUMNS)."""
    n = world.num_videos
    vid = np.arange(n, dtype=np.int64)
    popularity = rng.lognormal(0.0, 1.5, n)

    def text(choices: list[str], p: list[float]) -> pa.Array:
        return pa.array(np.asarray(choices, dtype=object)[rng.choice(len(choices), n, p=p)], pa.string())

    upload_day = (np.datetime64("2022-05-08") - rng.integers(0, 900, n)).astype("datetime64[D]")
    basic = pa.table({
        "video_id": vid,
        "author_id": rng.integers(0, max(1, n // 5), n),
        "video_type": text(["NORMAL", "AD"], [0.97, 0.03]),
        "upload_dt": pa.array(np.datetime_as_string(upload_day), pa.string()),
        "upload_type": text(["ShortImport", "LongImport", "Web", "PictureSet"], [0.7, 0.15, 0.1, 0.05]),
        "visible_status": text(["public", "private"], [0.98, 0.02]),
        "video_duration": world.video_duration_ms.astype(np.float64),
        "server_width": rng.choice([720, 1080, 540], n),
        "server_height": rng.choice([1280, 1920, 960], n),
        "music_id": rng.integers(0, max(1, n // 10), n),
        "music_type": rng.choice([4, 9, 11], n),
        "tag": pa.array(rng.integers(1, 100, n).astype(str).astype(object), pa.string()),
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
    _write_csv(out / schema.VIDEO_FEATURES_BASIC, basic)
    _write_csv(out / schema.VIDEO_FEATURES_STATISTIC, statistic)
    return {schema.VIDEO_FEATURES_BASIC: n, schema.VIDEO_FEATURES_STATISTIC: n}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a synthetic KuaiRand-1K data directory.")
    parser.add_argument("--out", required=True, type=Path, help="directory for the six CSV files")
    parser.add_argument("--scale", type=float, default=1.0, help="1.0 = real size (11.7M log rows)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no_progress", action="store_true")
    args = parser.parse_args(argv)
    summary = generate(args.out, scale=args.scale, seed=args.seed, progress=not args.no_progress)
    print(summary.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
