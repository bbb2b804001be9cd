"""The generator's planted signal is selectable: item-level (cluster taste + video quality, no
per-user propensity), user-level (taste + propensity) or mixed (all three, the default)."""
from __future__ import annotations

import numpy as np
import pytest

from data import schema
from data.raw import read_log
from data.synthetic import SIGNALS, SyntheticConfig, generate, main, signal_config
from model.metrics import auc

SCALE = 0.002


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """signal name -> (summary, standard-log events of the generated files)."""
    out = {}
    for signal in SIGNALS:
        summary = generate(tmp_path_factory.mktemp(signal), SCALE, seed=5, config=signal_config(signal), progress=False)
        logs = [read_log(summary.out_dir / name) for name in schema.STANDARD_LOGS]
        columns = ("user_id", "video_id", "is_click")
        out[signal] = (summary, {c: np.concatenate([log.column(c).to_numpy() for log in logs]) for c in columns})
    return out


def test_signal_presets_set_the_offsets():
    assert signal_config("item").user_propensity_std == 0.0 and signal_config("item").item_quality_std > 0
    assert signal_config("user").item_quality_std == 0.0 and signal_config("user").user_propensity_std > 0
    mixed = signal_config("mixed")
    assert mixed.user_propensity_std > 0 and mixed.item_quality_std > 0
    assert SyntheticConfig() == mixed  # the default data carries both kinds of signal
    assert signal_config("item", num_clusters=8).num_clusters == 8
    with pytest.raises(ValueError, match=r"unknown signal 'items'.*item, user, mixed"):
        signal_config("items")


def test_item_signal_has_no_user_propensity(generated):
    summary, _ = generated["item"]
    assert np.all(summary.user_propensity == 0.0)
    assert summary.video_quality.std() > 0.5
    user_summary, _ = generated["user"]
    assert np.all(user_summary.video_quality == 0.0) and user_summary.user_propensity.std() > 0.5


def test_item_signal_is_learnable_from_items_not_users(generated):
    """On item-level data the clicks follow the (user, video) pair: the oracle affinity ranks clicks
    well, video quality alone helps, and the user's own click rate carries next to nothing."""
    summary, events = generated["item"]
    users, videos, clicks = events["user_id"], events["video_id"], events["is_click"]
    assert auc(summary.world.affinity(users, videos), clicks) > 0.72
    assert auc(summary.video_quality[videos], clicks) > 0.6
    user_rate = np.bincount(users, weights=clicks) / np.bincount(users)
    assert auc(user_rate[users], clicks) < 0.56
    # With a propensity (the "user" signal) the user's click rate alone is a strong scorer.
    _summary_u, events_u = generated["user"]
    rate_u = np.bincount(events_u["user_id"], weights=events_u["is_click"]) / np.bincount(events_u["user_id"])
    assert auc(rate_u[events_u["user_id"]], events_u["is_click"]) > 0.65


def test_signals_keep_the_published_click_rate(generated):
    for signal, (_, events) in generated.items():
        assert abs(events["is_click"].mean() - 0.378) < 0.02, signal


def test_cli_selects_the_signal(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "item"), "--scale", "0.0005", "--seed", "1", "--signal", "item",
                 "--no_progress"]) == 0
    assert '"user_propensity_std": 0.0' in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x"), "--signal", "bogus"])
    assert not (tmp_path / "x").exists()
