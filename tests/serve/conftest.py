"""Fixtures of the serving tests: a tiny preprocessed dataset and a checkpoint that nodes load fast."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import build_processed, sensitive_model


@pytest.fixture(scope="session")
def serving_artifacts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(preprocessed data dir, checkpoint dir) of the tiny preset, with weights that make every token count."""
    from data.dataset import InferenceDataset
    from model.checkpoint import save_checkpoint
    from model.config import config_for_dataset

    root = tmp_path_factory.mktemp("serving")
    processed = build_processed(root)
    model = sensitive_model(config_for_dataset("tiny", InferenceDataset(processed)), seed=0)
    save_checkpoint(model, root / "checkpoint")
    return processed, root / "checkpoint"
