"""model/weight_average.py: the moving average of the weights the trainer can score and keep."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from data.dataset import InferenceDataset
from helpers import build_processed
from model.evaluation import score_requests
from model.train import TrainParams, split_requests, train
from model.weight_average import WeightAverage


def test_the_average_follows_the_warmed_up_recurrence():
    layer = nn.Linear(3, 2)
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)
    average = WeightAverage([*layer.parameters(), frozen], decay=0.9)
    assert len(average.parameters) == 2  # the frozen one is left alone
    expected = [p.detach().clone() for p in layer.parameters()]
    for t in range(30):
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(torch.randn_like(p))
        decay = min(0.9, (1 + t) / (10 + t))
        expected = [decay * e + (1 - decay) * p.detach() for e, p in zip(expected, layer.parameters())]
        average.update()
    for got, want in zip(average.averaged, expected):
        torch.testing.assert_close(got, want)


def test_swapped_in_weights_are_the_average_and_the_training_weights_come_back():
    layer = nn.Linear(4, 4)
    average = WeightAverage(layer.parameters(), decay=0.5)
    with torch.no_grad():
        layer.weight.add_(1.0)
    average.update()
    training = layer.weight.detach().clone()
    with pytest.raises(RuntimeError, match="inside"):
        with average.swapped_in():
            torch.testing.assert_close(layer.weight.detach(), average.averaged[0])
            assert not torch.equal(layer.weight, training)
            raise RuntimeError("inside")
    assert torch.equal(layer.weight, training)


def test_a_decay_outside_zero_one_is_refused():
    for decay in (0.0, 1.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="decay must be in"):
            WeightAverage(nn.Linear(2, 2).parameters(), decay)


def test_the_trainer_scores_and_keeps_the_averaged_weights(tmp_path_factory):
    dataset = InferenceDataset(build_processed(tmp_path_factory.mktemp("average"), scale=0.002, seed=3))
    params = TrainParams(preset="tiny", epochs=2, patience=2, batch_size=8, seed=0, weight_average_decay=0.9)
    averaged, report = train(dataset, params)
    last_step, _ = train(dataset, replace(params, weight_average_decay=0.0))
    best = next(e for e in report.epochs if e.epoch == report.best_epoch)
    _, holdout = split_requests(dataset, params)
    # The kept model is the one the holdout scored: the average of that epoch, not its last step.
    assert score_requests(averaged, dataset, holdout, 8, progress=False).mean_bce() == pytest.approx(best.holdout_loss, rel=1e-5)
    weights = dict(averaged.named_parameters())
    assert any(not torch.equal(p, weights[name]) for name, p in last_step.named_parameters())
