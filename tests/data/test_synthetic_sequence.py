"""The sequential signal (`--signal sequential`): exposures and clicks that depend on the order and
recency of each user's earlier events, drawn deterministically."""
from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import pytest

from data import schema
from data.synthetic import generate, main, signal_config
from data.synthetic_sequence import draw_sequential_events, replay
from data.synthetic_world import T0, SequentialRules, World
from model.metrics import auc

HOUR_MS = 3_600_000


def _digest(out_dir) -> str:
    h = hashlib.sha256()
    for name in schema.RAW_FILES:
        h.update((out_dir / name).read_bytes())
    return h.hexdigest()


def test_sequential_generation_is_deterministic(tmp_path):
    config = signal_config("sequential")
    a, b, c = (generate(tmp_path / name, 0.0005, seed, config, progress=False)
               for name, seed in (("a", 1), ("b", 1), ("c", 2)))
    assert _digest(a.out_dir) == _digest(b.out_dir) != _digest(c.out_dir)
    assert a.sequence is not None and a.sequence.click_intercept == b.sequence.click_intercept


def test_ids_as_clusters_logs_the_same_events_under_their_clusters_ids(tmp_path):
    import pyarrow.csv as pc

    config = signal_config("sequential")
    plain = generate(tmp_path / "plain", 0.0005, 1, config, progress=False)
    tagged = generate(tmp_path / "tagged", 0.0005, 1, config, progress=False, ids_as_clusters=True)
    for name in (schema.LOG_STANDARD_EARLY, schema.LOG_STANDARD_LATE, schema.LOG_RANDOM):
        a, b = pc.read_csv(plain.out_dir / name), pc.read_csv(tagged.out_dir / name)
        videos = a.column("video_id").to_numpy()
        np.testing.assert_array_equal(b.column("video_id").to_numpy(), plain.video_cluster[videos])
        assert len(np.unique(b.column("video_id").to_numpy())) < len(np.unique(videos))
        assert a.drop(["video_id"]).equals(b.drop(["video_id"]))


def _timelines(rng: np.random.Generator, num_users: int, visits: int = 8, per_visit: int = 40):
    """[N] users and times, shuffled: visits of `per_visit` events ~15 s apart, hours apart."""
    user = np.repeat(np.arange(num_users), visits * per_visit)
    position = np.tile(np.arange(visits * per_visit), num_users)
    gap = np.where(position % per_visit == 0, rng.uniform(2, 30, len(user)) * HOUR_MS, rng.exponential(15_000, len(user)))
    gap[position == 0] = 0
    time_ms = T0 + np.cumsum(gap).astype(np.int64)
    time_ms -= np.repeat(time_ms[position == 0] - T0, visits * per_visit)
    shuffle = rng.permutation(len(user))
    return user[shuffle], time_ms[shuffle]


@pytest.fixture(scope="module")
def drawn():
    """A small world's events drawn under the sequential rules, and the inputs they came from."""
    config = signal_config("sequential")
    rng = np.random.default_rng(11)
    world = World.draw(rng, 0.0005, config)  # 22 users, 2186 videos
    user, time_ms = _timelines(rng, world.num_users)
    return config, world, user, time_ms, draw_sequential_events(rng, world, config, user, time_ms)


def test_replay_gives_the_affinity_each_event_was_drawn_with(drawn):
    _config, world, user, time_ms, events = drawn
    order = np.lexsort((time_ms, user))
    cluster = world.video_cluster[events.video[order]]
    sequential = replay(events.world, user[order], time_ms[order], cluster, events.click[order])
    expected = events.z[order] - world.affinity(user[order], events.video[order])
    np.testing.assert_allclose(sequential, expected, atol=1e-9)
    assert sequential.std() > 0.5  # the sequence moves the affinity by much more than round-off


def test_clicks_follow_the_recent_events(drawn):
    """The sequential part ranks clicks far better than the (weakened) taste alone, and the target
    click rate holds."""
    config, world, user, _time_ms, events = drawn
    affinity = world.affinity(user, events.video)
    assert auc(events.z, events.click) > auc(affinity, events.click) + 0.1
    assert abs(events.click.mean() - config.rates[0]) < 0.03


def test_the_feed_follows_recent_clicks(drawn):
    """With part of the feed drawn from the recent interest, an event is more often of the cluster of
    the user's previous click (or its successor) than when the feed ignores it."""
    config, world, user, time_ms, _ = drawn

    def follows_last_click(rules: SequentialRules) -> float:
        rng = np.random.default_rng(3)
        events = draw_sequential_events(rng, world, replace(config, sequence=rules), user, time_ms)
        order = np.lexsort((time_ms, user))
        cluster, click, u = world.video_cluster[events.video[order]], events.click[order], user[order]
        latest = np.maximum.accumulate(np.where(click, np.arange(len(u)), -1))  # last click up to each event
        before = np.r_[-1, latest[:-1]]  # last click before each event
        user_start = np.searchsorted(u, u)
        seen = before >= user_start
        last_cluster = cluster[np.maximum(before, 0)]
        hit = (cluster == last_cluster) | (cluster == events.world.successor[last_cluster])
        return hit[seen].mean()

    assert follows_last_click(config.sequence) > 1.5 * follows_last_click(replace(config.sequence, feed_follows_interest=0.0))


def test_shuffling_a_history_window_changes_the_sequential_part(drawn):
    """The same events in another order, each time slot keeping its time, give the next event another
    sequential affinity: the signal reads the order, not only the counts."""
    _config, world, user, time_ms, events = drawn
    order = np.lexsort((time_ms, user))
    u, t = user[order], time_ms[order]
    cluster, click = world.video_cluster[events.video[order]], events.click[order]
    rng = np.random.default_rng(0)
    changed = []
    for first in np.flatnonzero(np.r_[True, u[1:] != u[:-1]]):
        window = np.arange(first + 100, first + 140)  # 40 events, then the event scored at first + 140
        shuffled = cluster.copy(), click.copy()
        permutation = rng.permutation(window)
        shuffled[0][window], shuffled[1][window] = cluster[permutation], click[permutation]
        before = replay(events.world, u, t, cluster, click)
        after = replay(events.world, u, t, *shuffled)
        np.testing.assert_array_equal(before[: first + 100], after[: first + 100])  # the events before the window
        changed.append(abs(before[first + 140] - after[first + 140]) > 1e-3)
        if len(changed) == 5:
            break
    assert sum(changed) >= 4


@pytest.mark.parametrize("field, value", [("interest_weight", -1.0), ("feed_follows_interest", 1.5),
                                          ("interest_half_life_events", 0.0), ("fatigue_half_life_hours", -2.0)])
def test_bad_rules_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=rf"SequentialRules\.{field} must be .*got {value}"):
        SequentialRules(**{field: value})


def test_an_unknown_signal_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"unknown signal 'sequence'; choose one of item, user, mixed, sequential"):
        signal_config("sequence")
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x"), "--signal", "sequence"])
    assert "invalid choice: 'sequence'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
