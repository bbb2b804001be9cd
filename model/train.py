"""Train the ranking model on preprocessed visits (the serving forward, full recompute, no cache).

    python -m model.train --data_dir OUT --checkpoint DIR [--preset demo] [--split_date 20220422]

Visits before the split date are the training period; its last `--holdout_fraction` (in
time) is held out. Every visit scores its candidates with the serving forward over its
window, cropped to the last `--max_history_events` events, with per-task binary
cross-entropy. After each epoch the holdout is scored exactly as serving scores it; the
epoch with the best holdout click AUC (or lowest loss, `--select_on loss`) is kept and training
stops after `--patience` epochs without a better one. Embedding tables (and the per-video logit offsets, at their own rate)
get sparse gradients (SparseAdam), dense layers AdamW with warm-up and cosine decay, so a
step costs what the batch touches, not the vocabulary size. The report gives training
samples (candidates) per second.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from data.batch import VisitBatch
from data.dataset import InferenceDataset
from data.schema import TASKS
from model.attention import BlockedAttention
from model.checkpoint import save_checkpoint
from model.config import PRESET_NAMES
from model.embeddings import VIDEO_ID_TABLE
from model.evaluation import EarlyStopping, score_requests, window_batch
from model.fresh_model import fresh_model
from model.item_cooccurrence import start_from_cooccurrence
from model.metrics import per_task_auc, selection_score
from model.next_item_loss import NextItemLoss, NextItemTargets
from model.recommender import HSTURecommender, ModelInputs
from model.train_arguments import add_recipe_arguments, parse_recipe_arguments, recipe_params
from model.train_params import EpochReport, TrainParams, TrainReport, split_requests
from model.train_schedule import CANDIDATE_TERM, group_factor, schedule, shuffled_batches

log = logging.getLogger(__name__)
# The blocked attention while training, with 128 query rows x 128 keys per block: cropped windows are
# short, and the backward pays for every padded slot of a block, so blocks smaller than serving's pay off.
TRAINING_ATTENTION = BlockedAttention(query_block=128, key_block=128)


def _optimizers(model: HSTURecommender, params: TrainParams, extra: nn.Module | None = None,
                ) -> tuple[list[torch.optim.Optimizer], list[nn.Parameter]]:
    """SparseAdam for the embedding tables (a step costs the rows a batch touches, and a rare
    video's row moves at the full rate whenever it is seen; the video-id rows at their own rate), AdamW for
    the dense layers and for
    `extra`'s parameters (a training-only loss module) at the layers' rate, and for the relative
    bias tables at `params.bias_learning_rate` when set (a table entry is one scalar offset: at the
    layers' rate it would stay where its prior put it)."""
    tables = model.embedder.collection.embeddings
    token_tables = [table for name, table in tables.items() if name != VIDEO_ID_TABLE]
    taste_tables = model.user_taste.tables() if model.user_taste is not None else []
    for table in _sparse_tables(model):
        table.sparse = True
    groups = [{"params": [t.weight for t in token_tables], "lr": params.embedding_learning_rate},
              {"params": [tables[VIDEO_ID_TABLE].weight], "lr": params.id_learning_rate},
              {"params": [model.embedder.video_bias.weight], "lr": params.video_bias_learning_rate,
               CANDIDATE_TERM: True}]
    if taste_tables:
        groups.append({"params": [t.weight for t in taste_tables], "lr": params.taste_learning_rate, CANDIDATE_TERM: True})
    counters = list(model.counter_features.parameters()) if model.counter_features is not None else []
    bias = [p for layer in model.layers if layer.relative_bias is not None and params.bias_learning_rate is not None
            for p in layer.relative_bias.parameters()]
    own_rate = {id(p) for group in groups for p in group["params"]} | {id(p) for p in counters + bias}
    layers = [p for p in model.parameters() if id(p) not in own_rate]
    layers += list(extra.parameters()) if extra is not None else []
    dense_groups = [{"params": layers, "lr": params.learning_rate}]
    if bias:
        dense_groups.append({"params": bias, "lr": params.bias_learning_rate})
    if counters:
        dense_groups.append({"params": counters, "lr": params.counter_learning_rate, CANDIDATE_TERM: True})
    return [
        torch.optim.SparseAdam(groups),
        torch.optim.AdamW(dense_groups, lr=params.learning_rate, weight_decay=1e-4),
    ], layers + bias + counters


def _losses(model: HSTURecommender, batch: VisitBatch,
            next_item: NextItemLoss | None) -> tuple[ModelInputs, Tensor, Tensor]:
    """A step's planned inputs, its mean BCE over the candidates' tasks, and its next-item loss
    (a zero without one), unweighted."""
    inputs = model.prepare_inputs(batch)
    labels = torch.from_numpy(batch.labels).to(model.device)
    if next_item is None:
        bce = F.binary_cross_entropy_with_logits(model.run(inputs), labels)
        return inputs, bce, bce.new_zeros(())
    states = model.encode(inputs, history_rows=True)  # [T, d]
    logits = model.score(states[inputs.attention.plan.num_history_rows:], inputs)[: inputs.num_candidates]
    auxiliary = next_item(model, states, NextItemTargets.of(batch, inputs.features))
    return inputs, F.binary_cross_entropy_with_logits(logits, labels), auxiliary


def _row_penalty(model: HSTURecommender, inputs: ModelInputs, params: TrainParams) -> Tensor | float:
    """L2 on the per-id rows this batch read, and on those only (their gradients stay sparse):
    `video_l2` x the mean squared norm of the tokens' video rows and of the candidates' video_bias
    rows, `taste_l2` x that of the user-taste rows. A row seen k times is pulled in k times, as a
    full-batch L2 weighs it against its k losses."""
    penalty = 0.0
    if params.video_l2:
        ids = torch.from_numpy(inputs.features.token_ids["video_id"]).to(model.device)
        tokens = model.embedder.collection.embeddings[VIDEO_ID_TABLE](ids)  # [N + M, d]
        bias = model.embedder.candidate_bias(inputs.device_inputs)  # [M, num_tasks]
        penalty = penalty + params.video_l2 * (tokens.pow(2).sum(-1).mean() + bias.pow(2).sum(-1).mean())
    if params.taste_l2 and model.user_taste is not None:
        penalty = penalty + params.taste_l2 * model.user_taste.row_penalty(inputs.device_inputs)
    return penalty


def _sparse_tables(model: HSTURecommender) -> list[nn.Embedding]:
    """Every per-id table: trained with sparse gradients, one row per id a batch reads."""
    taste = model.user_taste.tables() if model.user_taste is not None else []
    return [*model.embedder.collection.embeddings.values(), model.embedder.video_bias, *taste]


def train(
    dataset: InferenceDataset, params: TrainParams, model: HSTURecommender | None = None
) -> tuple[HSTURecommender, TrainReport]:
    """Train on the visits before the split date; keep the epoch with the best holdout score (`select_on`).

    `model` (default: a fresh one of `params.preset` with `params.dropout`, seeded by `params.seed`, its id
    rows started as `params.id_start` says) is trained in place and returned."""
    torch.manual_seed(params.seed)
    rng = np.random.default_rng(params.seed)
    train_idx, holdout_idx = split_requests(dataset, params)
    if model is None:
        model = fresh_model(dataset, params)
        if params.id_start == "cooccurrence":  # from the events before the holdout's first visit
            start_from_cooccurrence(model, dataset, int(dataset.requests.time_ms[holdout_idx].min()), params.seed)
    # The blocked torch path: the Triton kernel computes forwards only (it has no backward).
    serving_backend, model.attention_backend = model.attention_backend, TRAINING_ATTENTION
    started = time.perf_counter()
    next_item = NextItemLoss(model.config.hidden_dim).to(model.device) if params.next_item_loss_weight else None
    optimizers, dense_params = _optimizers(model, params, next_item)
    base_lrs = [[g["lr"] for g in opt.param_groups] for opt in optimizers]
    steps_per_epoch = len(shuffled_batches(dataset, train_idx, params.batch_size, np.random.default_rng(params.seed)))
    total_steps = max(1, params.epochs * steps_per_epoch)
    delay_steps = params.candidate_terms_delay_epochs * steps_per_epoch
    stopper = EarlyStopping(params.patience)
    epochs: list[EpochReport] = []
    step, loss_ema, next_item_ema, candidates, requests, step_seconds = 0, math.nan, math.nan, 0, 0, 0.0
    out_of_time = False
    for epoch in range(params.epochs):
        epoch_started = time.perf_counter()
        batches = shuffled_batches(dataset, train_idx, params.batch_size, rng)
        bar = tqdm(batches, desc=f"train epoch {epoch + 1}/{params.epochs}", file=sys.stderr)
        model.train()
        for idx in bar:
            step_started = time.perf_counter()
            factor = schedule(step, total_steps, params.warmup_steps)
            for opt, lrs in zip(optimizers, base_lrs):
                for group, lr in zip(opt.param_groups, lrs):
                    group["lr"] = lr * group_factor(group, factor, step, delay_steps, params.warmup_steps)
            batch = window_batch(model, dataset, idx, params.max_history_events, params.history_targets)
            inputs, bce, next_item_loss = _losses(model, batch, next_item)
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            (bce + params.next_item_loss_weight * next_item_loss + _row_penalty(model, inputs, params)).backward()
            torch.nn.utils.clip_grad_norm_(dense_params, 1.0)
            for opt in optimizers:
                opt.step()
            step += 1
            candidates += len(batch.candidate_video_ids)
            requests += batch.batch_size
            step_seconds += time.perf_counter() - step_started
            loss, next_item_value = torch.stack([bce, next_item_loss]).tolist()  # the step's one read-back
            loss_ema = loss if math.isnan(loss_ema) else 0.95 * loss_ema + 0.05 * loss
            next_item_ema = next_item_value if math.isnan(next_item_ema) else 0.95 * next_item_ema + 0.05 * next_item_value
            postfix = {"loss": f"{loss_ema:.4f}", "cand_per_s": f"{candidates / step_seconds:.0f}"}
            if next_item is not None:
                postfix["next_item"] = f"{next_item_ema:.3f}"
            bar.set_postfix(postfix)
            if params.max_train_seconds and time.perf_counter() - started > params.max_train_seconds:
                out_of_time = True
                break
        bar.close()
        model.attention_backend = "blocked"  # the holdout is scored exactly as serving on CPU scores it
        holdout = score_requests(model, dataset, holdout_idx, params.batch_size, desc="holdout")
        model.attention_backend = TRAINING_ATTENTION
        holdout_loss = holdout.mean_bce()
        auc = per_task_auc(holdout.logits, holdout.labels, TASKS)
        epochs.append(EpochReport(epoch + 1, step, loss_ema, holdout_loss, auc, time.perf_counter() - epoch_started))
        tqdm.write(f"epoch {epoch + 1}: train loss {loss_ema:.4f}, holdout loss {holdout_loss:.4f}, "
                   f"holdout click AUC {_fmt(auc.get('click'))}", file=sys.stderr)
        score = selection_score(params.select_on, holdout_loss, auc.get("click"),
                                "select epochs on the loss instead (--select_on loss)")
        if stopper.update(epoch + 1, score, model) or out_of_time:
            break
    stopper.restore_best(model)
    for table in _sparse_tables(model):
        table.sparse = False
    model.attention_backend = serving_backend
    model = model.eval()
    best = next(e for e in epochs if e.epoch == stopper.best_epoch)
    report = TrainReport(
        train_requests=len(train_idx), holdout_requests=len(holdout_idx), steps=step,
        seconds=time.perf_counter() - started, final_loss=loss_ema, holdout_auc=best.holdout_auc,
        best_epoch=best.epoch, stopped_early=len(epochs) < params.epochs and not out_of_time,
        candidates_per_second=candidates / max(step_seconds, 1e-9), requests_per_second=requests / max(step_seconds, 1e-9),
        epochs=epochs,
    )
    return model, report


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_dir", required=True, help="preprocessor_inference.py output directory")
    p.add_argument("--checkpoint", required=True, help="directory to write the checkpoint into")
    d = TrainParams()
    p.add_argument("--preset", default=d.preset, choices=PRESET_NAMES)
    p.add_argument("--split_date", type=int, default=d.split_date, help="YYYYMMDD; train on visits before it")
    p.add_argument("--holdout_fraction", type=float, default=d.holdout_fraction)
    add_recipe_arguments(p)
    p.add_argument("--batch_size", type=int, default=d.batch_size)
    p.add_argument("--max_train_requests", type=int, default=None)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device)
    return parse_recipe_arguments(p, argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _parse_args(argv)
    try:
        params = recipe_params(args, preset=args.preset, split_date=args.split_date,
                               holdout_fraction=args.holdout_fraction, batch_size=args.batch_size,
                               max_train_requests=args.max_train_requests, seed=args.seed, device=args.device)
        dataset = InferenceDataset(args.data_dir)
        model, report = train(dataset, params)  # a model the options cannot build is refused before training
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    metadata = {"train": asdict(report), "params": asdict(params), "dataset": json.loads(dataset.manifest.to_json())}
    path = save_checkpoint(model, args.checkpoint, metadata=metadata)
    print(json.dumps({"checkpoint": str(path), **asdict(report)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
