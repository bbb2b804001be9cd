"""Train the ranking model on preprocessed visits (full recompute, no cache).

    python -m model.train --data_dir OUT --checkpoint DIR [--preset demo] [--split_date 20220422]

Visits before the split date are the training period; its last `--holdout_fraction` (in
time) is held out for per-task AUC. Every visit scores its candidates with the model's
own window over the history, exactly as serving does, with per-task binary
cross-entropy. Embedding tables get sparse gradients (SparseAdam), dense layers AdamW,
so a step costs what the batch touches, not the vocabulary size.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from data.dataset import InferenceDataset
from data.schema import TASKS
from model.checkpoint import save_checkpoint
from model.config import PRESET_NAMES, HSTUConfig, preset
from model.metrics import per_task_auc
from model.recommender import HSTURecommender

log = logging.getLogger(__name__)
BEIJING = dt.timezone(dt.timedelta(hours=8))
DEFAULT_SPLIT_DATE = 20220422  # first day of the second standard log


@dataclass(frozen=True)
class TrainParams:
    preset: str = "demo"
    split_date: int = DEFAULT_SPLIT_DATE
    holdout_fraction: float = 0.1
    epochs: int = 1
    batch_size: int = 16
    learning_rate: float = 1e-3
    embedding_learning_rate: float = 1e-2
    max_train_requests: int | None = None
    max_train_seconds: float | None = None
    seed: int = 0
    device: str = "cpu"


@dataclass(frozen=True)
class TrainReport:
    train_requests: int
    holdout_requests: int
    steps: int
    seconds: float
    final_loss: float
    holdout_auc: dict[str, float | None]


def date_to_ms(yyyymmdd: int) -> int:
    """Midnight (Beijing time, the dataset's clock) of a YYYYMMDD date, in epoch ms."""
    day = dt.datetime.strptime(str(yyyymmdd), "%Y%m%d").replace(tzinfo=BEIJING)
    return int(day.timestamp() * 1000)


def config_for_dataset(preset_name: str, dataset: InferenceDataset) -> HSTUConfig:
    """The preset with the dataset's user-feature vocabulary (the contextual prefix)."""
    return preset(preset_name, user_feature_cardinalities=tuple(dataset.user_feature_cardinalities))


def full_window_batch(model: HSTURecommender, dataset: InferenceDataset, indices: np.ndarray):
    windows = model.layout.window_start(dataset.requests.end[indices])
    return dataset.make_batch(indices, windows, windows)


def evaluate(model: HSTURecommender, dataset: InferenceDataset, indices: np.ndarray, batch_size: int,
             desc: str = "evaluate") -> dict[str, float | None]:
    logits, labels = [], []
    model.eval()
    with torch.inference_mode():
        for idx in tqdm(list(dataset.batches(indices, batch_size)), desc=desc, leave=False, file=sys.stderr):
            batch = full_window_batch(model, dataset, idx)
            logits.append(model(batch).cpu())
            labels.append(torch.from_numpy(batch.labels))
    if not logits:
        return {name: None for name in TASKS}
    return per_task_auc(torch.cat(logits).numpy(), torch.cat(labels).numpy(), TASKS)


def split_requests(dataset: InferenceDataset, params: TrainParams) -> tuple[np.ndarray, np.ndarray]:
    period = dataset.request_indices(until_time_ms=date_to_ms(params.split_date))
    if len(period) < 2:
        raise ValueError(f"Only {len(period)} visits before {params.split_date}: nothing to train on")
    n_holdout = max(1, round(len(period) * params.holdout_fraction))
    train, holdout = period[:-n_holdout], period[-n_holdout:]
    if params.max_train_requests is not None:
        train = train[-params.max_train_requests:]  # the most recent ones: longest histories
    return train, holdout


def train(dataset: InferenceDataset, params: TrainParams) -> tuple[HSTURecommender, TrainReport]:
    torch.manual_seed(params.seed)
    rng = np.random.default_rng(params.seed)
    model = HSTURecommender(config_for_dataset(params.preset, dataset).replace(dropout=0.1), device=params.device)
    for table in model.embedder.collection.embeddings.values():
        table.sparse = True  # row-sparse gradients: only looked-up rows are updated
    embedding_params = list(model.embedder.collection.parameters())
    embedding_ids = {id(p) for p in embedding_params}
    dense_params = [p for p in model.parameters() if id(p) not in embedding_ids]
    optimizers = [
        torch.optim.SparseAdam(embedding_params, lr=params.embedding_learning_rate),
        torch.optim.AdamW(dense_params, lr=params.learning_rate, weight_decay=1e-4),
    ]
    train_idx, holdout_idx = split_requests(dataset, params)
    started, step, loss_ema = time.perf_counter(), 0, math.nan
    for epoch in range(params.epochs):
        # Shuffle visits across time: batches are i.i.d., each still with distinct users.
        order = train_idx[rng.permutation(len(train_idx))]
        batches = list(dataset.batches(order, params.batch_size))
        bar = tqdm(batches, desc=f"train epoch {epoch + 1}/{params.epochs}", file=sys.stderr)
        model.train()
        for idx in bar:
            batch = full_window_batch(model, dataset, idx)
            logits = model(batch)
            loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(batch.labels).to(logits.device))
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(dense_params, 1.0)
            for opt in optimizers:
                opt.step()
            step += 1
            loss_ema = loss.item() if math.isnan(loss_ema) else 0.95 * loss_ema + 0.05 * loss.item()
            bar.set_postfix(loss=f"{loss_ema:.4f}")
            if params.max_train_seconds and time.perf_counter() - started > params.max_train_seconds:
                break
    for table in model.embedder.collection.embeddings.values():
        table.sparse = False
    model = model.eval()
    seconds = time.perf_counter() - started
    holdout_auc = evaluate(model, dataset, holdout_idx, params.batch_size, desc="holdout AUC")
    report = TrainReport(len(train_idx), len(holdout_idx), step, seconds, loss_ema, holdout_auc)
    return model, report


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_dir", required=True, help="preprocessor_inference.py output directory")
    p.add_argument("--checkpoint", required=True, help="directory to write the checkpoint into")
    d = TrainParams()
    p.add_argument("--preset", default=d.preset, choices=PRESET_NAMES)
    p.add_argument("--split_date", type=int, default=d.split_date, help="YYYYMMDD; train on visits before it")
    p.add_argument("--holdout_fraction", type=float, default=d.holdout_fraction)
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch_size", type=int, default=d.batch_size)
    p.add_argument("--learning_rate", type=float, default=d.learning_rate)
    p.add_argument("--embedding_learning_rate", type=float, default=d.embedding_learning_rate)
    p.add_argument("--max_train_requests", type=int, default=None)
    p.add_argument("--max_train_seconds", type=float, default=None)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _parse_args(argv)
    params = TrainParams(**{k: v for k, v in vars(args).items() if k not in ("data_dir", "checkpoint")})
    try:
        dataset = InferenceDataset(args.data_dir)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    model, report = train(dataset, params)
    metadata = {"train": asdict(report), "params": asdict(params), "dataset": json.loads(dataset.manifest.to_json())}
    path = save_checkpoint(model, args.checkpoint, metadata=metadata)
    print(json.dumps({"checkpoint": str(path), **asdict(report)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
