"""Synthetic KuaiRand-1K: the six files with the real names, headers and dtypes.

    python -m data.synthetic --out DIR --scale S --seed N

The real dataset cannot be downloaded here, so the generator reproduces what the
pipeline depends on: dates split across the two standard logs, Beijing date/hourmin
consistent with time_ms, activity in sessions (bursts of "screens" of items sharing one
timestamp, separated by hours), heavy-tailed users and items, the published positive
rates, the long_view rule, the tab mix, ~8% duration_ms <= 0, exact duplicate rows and
a little time disorder. It plants a learnable signal (data/synthetic_world.py): videos
belong to clusters, each user has a taste over clusters (a Dirichlet draw), exposure leans
towards the taste, and the action probabilities rise with the user's taste for the video's
cluster, with the video's quality and with a per-user propensity; `--signal` picks which of
the last two are present ("item": taste + quality, "user": taste + propensity, "mixed": all).
`--signal sequential` makes the standard logs' exposures and clicks depend on the order and
recency of each user's earlier events (data/synthetic_sequence.py); the random log's clicks
follow the affinity alone there, as its events are outside the users' feeds.

Scale rule: users = 1000 * sqrt(scale) and events per user = 11,713 * sqrt(scale), so
the row count is 11.7M * scale while every user keeps many visits (scale 0.006 gives
~70k rows from ~77 users with ~900 events each). Videos = 4.37M * scale.
Everything is vectorised numpy; the same (scale, seed, config) gives identical files.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from data import schema
from data.synthetic_features import write_csv, write_user_features, write_video_features
from data.synthetic_regimes import REGIMES, regime_config
from data.synthetic_sequence import SequenceWorld, draw_sequential_events
from data.synthetic_world import (
    DEFAULT_SIGNAL,
    LATE_DAY,
    NUM_DAYS,
    SIGNALS,
    T0,
    T_END,
    T_LATE,
    SyntheticConfig,
    World,
    draw_actions,
    draw_actions_given_clicks,
    signal_config,
)

# Relative session-start intensity per Beijing hour (quiet at night, peak in the evening).
_DIURNAL = np.array([3, 2, 1.4, 1, .7, .6, .8, 1.5, 2.5, 3, 3, 3.5, 4.5, 4, 3.5, 3.5, 3.5, 4, 4.5, 5, 5.5, 6, 6, 5])

__all__ = ["SIGNALS", "SyntheticConfig", "SyntheticSummary", "generate", "signal_config"]


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
    video_quality: np.ndarray = field(repr=False)  # [num_videos] quality offset (affinity units) by video_id
    user_propensity: np.ndarray = field(repr=False)  # [num_users] propensity offset (affinity units)
    world: World = field(repr=False)  # everything drawn, for oracle scores (World.affinity)
    sequence: SequenceWorld | None = field(default=None, repr=False)  # the sequential rules' draw, if on

    def to_json(self) -> str:
        keys = ("scale", "seed", "rows", "num_users", "num_videos")
        signal = {"user_propensity_std": float(self.user_propensity.std()) if self.user_propensity.size else 0.0,
                  "item_quality_std": float(self.video_quality.std()) if self.video_quality.size else 0.0}
        return json.dumps({"out_dir": str(self.out_dir), **{k: getattr(self, k) for k in keys},
                           "signal_offsets_std": signal}, indent=2)


def generate(
    out_dir: Path | str, scale: float = 1.0, seed: int = 0, config: SyntheticConfig | None = None,
    progress: bool = True, ids_as_clusters: bool = False,
) -> SyntheticSummary:
    """Write the six KuaiRand-1K files into `out_dir` (it plays the role of `KuaiRand-1K/data`);
    `config` defaults to the default signal mix (`signal_config(DEFAULT_SIGNAL)`).

    `ids_as_clusters` writes each logged video id as its cluster's (the same events otherwise): the
    planted signal with a perfect video tag, readable from ids that are seen thousands of times
    (the video feature files keep the videos' own ids)."""
    config = config if config is not None else signal_config(DEFAULT_SIGNAL)
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    bar = tqdm(total=6, disable=not progress, file=sys.stderr, unit="step", desc="synthetic")
    world = World.draw(rng, scale, config)
    bar.update()
    standard, sequence = _standard_events(rng, world, config)
    bar.update()
    random_log = _random_events(rng, world, scale, config)
    if ids_as_clusters:
        for log in (standard, random_log):
            log["video_id"] = world.video_cluster[log["video_id"]]
    bar.update()
    early = standard["date"] <= schema.EARLY_DATES[1]  # split by date, as in the real files
    rows = {
        schema.LOG_STANDARD_EARLY: _write_log(out / schema.LOG_STANDARD_EARLY, standard, early),
        schema.LOG_STANDARD_LATE: _write_log(out / schema.LOG_STANDARD_LATE, standard, ~early),
        schema.LOG_RANDOM: _write_log(out / schema.LOG_RANDOM, random_log),
    }
    bar.update()
    rows[schema.USER_FEATURES] = write_user_features(out / schema.USER_FEATURES, rng, world, standard["user_id"])
    bar.update()
    rows.update(write_video_features(out, rng, world, config))
    bar.update()
    bar.close()
    return SyntheticSummary(
        out, scale, seed, rows, world.num_users, world.num_videos, world.taste, world.video_cluster,
        world.quality, world.propensity, world, sequence,
    )


# ---------------------------------------------------------------- standard logs
def _standard_events(
    rng: np.random.Generator, world: World, cfg: SyntheticConfig
) -> tuple[dict[str, np.ndarray], SequenceWorld | None]:
    # Sessions: starts on a random active day at a diurnal hour; sorted per user by start.
    per_user = np.maximum(2, np.round(world.events_per_user / cfg.session_mean_events)).astype(np.int64)
    s_user = np.repeat(np.arange(world.num_users), per_user)
    first_day = world.first_day[s_user]
    day = first_day + (rng.random(len(s_user)) * (NUM_DAYS - first_day)).astype(np.int64)
    # Every user is active in the late log (as all 1,000 real users are): its last session
    # falls on a late day.
    last = np.cumsum(per_user) - 1
    day[last] = np.maximum(day[last], LATE_DAY + rng.integers(0, NUM_DAYS - LATE_DAY, len(last)))
    hour = rng.choice(24, size=len(s_user), p=_DIURNAL / _DIURNAL.sum())
    s_start = T0 + day * schema.DAY_MS + hour * 3_600_000 + rng.integers(0, 3_600_000, len(s_user))
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
    inside = time_ms < T_END
    user, time_ms, tab = user[inside], time_ms[inside], screen_tab[screen_index][inside]
    sequence = None
    if cfg.sequence.active:
        drawn = draw_sequential_events(rng, world, cfg, user, time_ms)
        video, sequence = drawn.video, drawn.world
        actions = draw_actions_given_clicks(rng, drawn.z, drawn.click, cfg.rates, cfg)
    else:
        video = world.sample_videos(rng, user, cfg.taste_exposure, cfg.popularity_exponent)
        actions = draw_actions(rng, world.affinity(user, video), cfg.rates, cfg)
    log = _assemble(rng, world, user, video, time_ms, actions, tab, is_rand=0, cfg=cfg)
    return _disorder(rng, log, cfg), sequence


def _random_events(
    rng: np.random.Generator, world: World, scale: float, cfg: SyntheticConfig
) -> dict[str, np.ndarray]:
    """The random log: uniformly exposed videos, late dates only, one item per screen."""
    n = max(1, round(cfg.random_rows * scale))
    user = rng.integers(0, world.num_users, n)
    time_ms = rng.integers(T_LATE, T_END, n)
    order = np.lexsort((time_ms, user))
    user, time_ms = user[order], time_ms[order]
    video = rng.integers(0, world.num_videos, n)
    rates = np.array(cfg.rates) * (cfg.random_click_rate / cfg.rates[0])  # rarer actions scale with clicks
    rates[schema.TASKS.index("click")] = cfg.random_click_rate
    rates[schema.TASKS.index("long_view")] = cfg.random_long_view_rate
    actions = draw_actions(rng, world.affinity(user, video), tuple(rates), cfg)
    return _assemble(rng, world, user, video, time_ms, actions, _tabs(rng, n, cfg), is_rand=1, cfg=cfg)


def _assemble(
    rng: np.random.Generator, world: World, user: np.ndarray, video: np.ndarray, time_ms: np.ndarray,
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


# ---------------------------------------------------------------- writing
def _write_log(path: Path, log: dict[str, np.ndarray], rows: np.ndarray | None = None) -> int:
    pick = slice(None) if rows is None else rows
    table = pa.table({name: pa.array(log[name][pick], pa.int64()) for name in schema.LOG_COLUMNS})
    write_csv(path, table)
    return table.num_rows



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a synthetic KuaiRand-1K data directory.")
    parser.add_argument("--out", required=True, type=Path, help="directory for the six CSV files")
    parser.add_argument("--scale", type=float, default=1.0, help="1.0 = real size (11.7M log rows)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--signal", choices=tuple(SIGNALS), default=DEFAULT_SIGNAL,
                        help="planted signal: item = cluster taste + video quality; user = taste + per-user "
                             "propensity; mixed = all three (default); sequential = a weaker taste + what each "
                             "user clicked lately, so the order of events matters")
    parser.add_argument("--regime", choices=REGIMES, default=None,
                        help="a catalogue x tags x signal regime (data/synthetic_regimes.py); replaces --signal")
    parser.add_argument("--ids_as_clusters", action="store_true",
                        help="log each video as its cluster's id: the signal with a perfect video tag")
    parser.add_argument("--no_progress", action="store_true")
    args = parser.parse_args(argv)
    config = regime_config(args.regime) if args.regime else signal_config(args.signal)
    summary = generate(args.out, scale=args.scale, seed=args.seed, config=config,
                       progress=not args.no_progress, ids_as_clusters=args.ids_as_clusters)
    print(summary.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
