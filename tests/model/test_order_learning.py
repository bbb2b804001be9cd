"""The model can learn to read order: the tiny preset, trained briefly on the order task
(model/order_task.py), scores held-out users well as logged and at chance with their histories
shuffled."""
from __future__ import annotations

import numpy as np
import pytest

from model.config import preset
from model.order_task import OrderTask, learn_order


def test_tiny_preset_learns_an_order_rule_that_shuffling_destroys():
    progress = learn_order(OrderTask(rule="last_event"), preset("tiny"), steps=300, learning_rate=1e-3,
                           eval_every=300)
    final = progress[-1]
    assert final.auc >= 0.85
    assert abs(final.shuffled_auc - 0.5) <= 0.1  # the tags are all still there; their order is not
    assert final.shuffled_change >= 0.3


def test_order_task_labels_follow_the_rule():
    task = OrderTask(history=12, candidates=6, rule="recent_clicks", recent=4, num_videos=1000)
    batch = task.batch(np.random.default_rng(3), num_users=50)
    tags = task.tag_table.rows(batch.video_ids).reshape(50, 12)
    clicks = (batch.action_weights.reshape(50, 12) & 1).astype(bool)
    candidate_tags = task.tag_table.rows(batch.candidate_video_ids).reshape(50, 6)
    expected = [[t in set(tags[u, -4:][clicks[u, -4:]]) for t in candidate_tags[u]] for u in range(50)]
    assert np.array_equal(batch.labels[:, 0].reshape(50, 6).astype(bool), np.array(expected))
    assert 0.05 < batch.labels[:, 0].mean() < 0.6
    shuffled = task.batch(np.random.default_rng(3), num_users=50, shuffled=True)
    assert np.array_equal(shuffled.labels, batch.labels)  # labelled before the shuffle
    assert np.array_equal(np.sort(shuffled.video_ids.reshape(50, 12)), np.sort(batch.video_ids.reshape(50, 12)))
    assert not np.array_equal(shuffled.video_ids, batch.video_ids)
    with pytest.raises(ValueError, match="rule must be one of"):
        OrderTask(rule="newest")
