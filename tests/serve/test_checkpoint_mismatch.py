"""A checkpoint whose weights do not fit its own config: the node and the end-to-end example refuse
it with one line naming the tensor and both shapes, not a traceback (issue 21)."""
from __future__ import annotations

import logging
import shutil

import pytest
import torch

from model.checkpoint import CHECKPOINT_FILE, CheckpointError, load_checkpoint


@pytest.fixture()
def mismatched(serving_artifacts, tmp_path):
    """(data dir, a copy of the checkpoint with one weight widened by a column, that weight's name)."""
    data_dir, checkpoint = serving_artifacts
    bad = tmp_path / "checkpoint"
    shutil.copytree(checkpoint, bad)
    payload = torch.load(bad / CHECKPOINT_FILE, map_location="cpu", weights_only=True)
    name = next(n for n, t in payload["state_dict"].items() if t.dim() == 2)
    weight = payload["state_dict"][name]
    payload["state_dict"][name] = torch.cat([weight, weight[:, :1]], dim=1)
    torch.save(payload, bad / CHECKPOINT_FILE)
    shapes = (tuple(weight.shape[:1]) + (weight.shape[1] + 1,), tuple(weight.shape))
    return data_dir, bad, name, shapes


def test_load_checkpoint_names_the_tensor_and_both_shapes(mismatched):
    _, bad, name, (stored, built) = mismatched
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(bad)
    message = str(refused.value)
    assert f"tensor {name!r} has shape {stored} in the weights, but its config builds {built}" in message


def test_the_end_to_end_example_prints_an_error_line(mismatched, capsys):
    from benchmark.serving.end2end import main

    data_dir, bad, name, (stored, built) = mismatched
    assert main(["--data_dir", str(data_dir), "--checkpoint", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "error: --checkpoint:" in err and name in err and str(stored) in err and str(built) in err
    assert "Traceback" not in err


def test_the_node_refuses_to_start(mismatched, caplog):
    from serve.node import main

    data_dir, bad, name, _ = mismatched
    with caplog.at_level(logging.ERROR, logger="serve.node"):
        assert main(["--data_dir", str(data_dir), "--checkpoint", str(bad), "--port", "1"]) == 2
    assert any("cannot start" in r.getMessage() and name in r.getMessage() for r in caplog.records)
