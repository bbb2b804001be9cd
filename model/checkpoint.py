"""Checkpoints: weights saved with the config that built them, and a model fingerprint.

A checkpoint directory holds `model.pt` (format version, config, state dict, the video tag table
of a model that embeds tags, free-form metadata such as the training data's manifest) and a
human-readable `config.json`.
Loading refuses a checkpoint whose config differs from the one the caller expects,
naming every differing field, instead of failing later with a shape error (or worse,
silently serving with the wrong vocabulary).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model.config import HSTUConfig
from model.recommender import HSTURecommender
from model.video_side_features import VideoSideFeatures
from model.video_tags import VideoTagTable

CHECKPOINT_FILE = "model.pt"
CONFIG_FILE = "config.json"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not fit what the caller asked for."""


@dataclass(frozen=True)
class Checkpoint:
    model: HSTURecommender
    metadata: dict = field(default_factory=dict)


def save_checkpoint(model: HSTURecommender, directory: str | Path, metadata: dict | None = None) -> Path:
    """Write the checkpoint atomically (temp file + rename) and return its path."""
    if model.config.num_video_tags and model.video_tags is None:
        raise ValueError("the model embeds video tags but has no VideoTagTable: nothing could serve its checkpoint")
    if model.config.side_feature_hash_size and model.side_features is None:
        raise ValueError("the model embeds video side features but has no VideoSideFeatures: nothing could serve "
                         "its checkpoint")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    payload = {
        "format_version": FORMAT_VERSION,
        "config": model.config.to_dict(),
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "metadata": metadata or {},
    }
    if model.video_tags is not None:
        payload["video_tags"] = model.video_tags.tensors()
    if model.side_features is not None:
        payload["side_features"] = model.side_features.tensors()
    _atomic_write(directory / CHECKPOINT_FILE, lambda f: torch.save(payload, f))
    text = json.dumps({"config": model.config.to_dict(), "metadata": metadata or {}}, indent=2, sort_keys=True)
    _atomic_write(directory / CONFIG_FILE, lambda f: f.write(text.encode()))
    return directory / CHECKPOINT_FILE


def load_checkpoint(
    directory: str | Path,
    device: torch.device | str = "cpu",
    expected_config: HSTUConfig | None = None,
    attention_window: int | None = None,
) -> Checkpoint:
    """The model saved in `directory`, checked against its config (and `expected_config`).

    `attention_window` serves the weights through another sliding attention window than the saved one
    (an ablation: the weights do not depend on it, the model's fingerprint does)."""
    path = Path(directory) / CHECKPOINT_FILE
    if not path.is_file():
        raise CheckpointError(f"No checkpoint at {path} (train one with `python -m model.train`)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file
        raise CheckpointError(f"Cannot read checkpoint {path}: {err}") from err
    if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
        version = payload.get("format_version") if isinstance(payload, dict) else None
        raise CheckpointError(f"Checkpoint {path} has format version {version}, this code reads {FORMAT_VERSION}")
    try:
        config = HSTUConfig.from_dict(payload["config"])
        if attention_window is not None:
            config = config.replace(attention_window=attention_window)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"Checkpoint {path} has an invalid config: {err}") from err
    if expected_config is not None and config != expected_config:
        diffs = config_differences(config, expected_config)
        raise CheckpointError(f"Checkpoint {path} does not match the expected config: {diffs}")
    model = HSTURecommender(config, device=device)
    # The catalogue snapshots a model's tokens read (model/video_tags.py, model/video_side_features.py).
    for needed, key, table, what in ((config.num_video_tags, "video_tags", VideoTagTable, "video tag"),
                                     (config.side_feature_hash_size, "side_features", VideoSideFeatures,
                                      "video side-feature")):
        if not needed:
            continue
        if key not in payload:
            raise CheckpointError(f"Checkpoint {path} embeds {what}s but holds no {what} table")
        try:
            setattr(model, key, table.from_tensors(payload[key]))
        except ValueError as err:
            raise CheckpointError(f"Checkpoint {path}: its {what} table is unusable: {err}") from err
    _check_shapes(path, model.state_dict(), payload.get("state_dict"))
    missing, unexpected = model.load_state_dict(payload["state_dict"], strict=False)
    if missing or unexpected:
        raise CheckpointError(f"Checkpoint {path} weights do not fit its config: missing {missing}, unexpected {unexpected}")
    return Checkpoint(model=model.eval(), metadata=payload.get("metadata", {}))


def _check_shapes(path: Path, expected: dict[str, torch.Tensor], stored: object) -> None:
    """Name the first tensor whose stored shape is not the one its config builds (load_state_dict
    would raise a RuntimeError listing every mismatch without saying which side is which)."""
    if not isinstance(stored, dict):
        raise CheckpointError(f"Checkpoint {path} holds no state_dict (got {type(stored).__name__})")
    for name, tensor in stored.items():
        want = expected.get(name)
        if want is not None and isinstance(tensor, torch.Tensor) and tensor.shape != want.shape:
            raise CheckpointError(
                f"Checkpoint {path}: tensor {name!r} has shape {tuple(tensor.shape)} in the weights, "
                f"but its config builds {tuple(want.shape)}"
            )


def config_differences(actual: HSTUConfig, expected: HSTUConfig) -> str:
    a, e = actual.to_dict(), expected.to_dict()
    return ", ".join(f"{k}: checkpoint has {a[k]!r}, expected {e[k]!r}" for k in a if a[k] != e[k])


def model_fingerprint(model: HSTURecommender) -> str:
    """SHA-256 over config, weights and catalogue tables: K/V computed by one model are never read by another."""
    digest = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True).encode())
    for table in (model.video_tags, model.side_features):
        if table is not None:
            digest.update(table.digest().encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
