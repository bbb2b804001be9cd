"""Synthetic visit batches for the benchmarks: B users with random histories of a given length.

`visit_batches` returns the same visits twice: carrying every event of each user's window (full
recompute), and carrying only the last `new` events (the rest is in the KV cache). Ids are random
within the model's tables; timestamps are one minute apart; no contextual prefix is needed.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmark.cli import DTYPES, add_device, add_dtype, refuse_missing_cuda
from data.batch import VisitBatch
from model.config import HSTUConfig, preset
from model.recommender import HSTURecommender
from model.video_tags import VideoTagTable

T0_MS = 1_649_376_000_000
VIDEO_ID_RANGE = 10  # visit_batches draws video ids below this many times the model's video rows
BENCHMARK_TAGS = 64  # about the demo data's 65 tag rows


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """--preset, --dtype, --device and the attention's options of a benchmark's model (`model_from_flags`)."""
    p.add_argument("--preset", default="kuairand-1k")
    add_dtype(p)
    add_device(p)
    p.add_argument("--attention_window", type=int, default=0,
                   help="sliding attention window in events, 0 = every key (--recipe sequence serves 512)")
    p.add_argument("--tag_match", action="store_true",
                   help=f"tag every video (one of {BENCHMARK_TAGS} tags at random) and add the tag-match term")


def model_from_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> HSTURecommender:
    """The preset's model with small embedding tables and no contextual prefix (lookups are a small part of
    the cost, and the model then fits anywhere), seeded, in --dtype on --device, in eval mode."""
    refuse_missing_cuda(p, args.device)
    device = torch.device(args.device)
    if args.attention_window < 0:
        p.error(f"--attention_window must be >= 0, got {args.attention_window}")
    cfg = preset(args.preset, video_hash_size=1024, user_feature_cardinalities=(),
                 attention_window=args.attention_window)
    tags = None
    if args.tag_match:  # every id visit_batches draws gets a tag, so the term fires as often as the tags repeat
        videos = np.arange(VIDEO_ID_RANGE * cfg.video_hash_size)
        tags = VideoTagTable.from_pairs(videos, np.random.default_rng(0).integers(0, BENCHMARK_TAGS, len(videos)))
        cfg = cfg.replace(num_video_tags=tags.num_rows, tag_match_bias=True)
    torch.manual_seed(0)
    return HSTURecommender(cfg, device=device, video_tags=tags).to(DTYPES[args.dtype]).eval()


def visit_batches(config: HSTUConfig, batch: int, history: int, new: int, candidates: int, seed: int = 0
                  ) -> tuple[VisitBatch, VisitBatch]:
    """-> (full: events [0, history) of every user, incremental: events [history - new, history))."""
    rng = np.random.default_rng(seed)
    videos = rng.integers(0, VIDEO_ID_RANGE * config.video_hash_size, size=(batch, history))
    actions = rng.integers(0, 256, size=(batch, history))
    times = T0_MS + 60_000 * np.arange(history)[None, :].repeat(batch, 0)
    cands = rng.integers(0, VIDEO_ID_RANGE * config.video_hash_size, size=batch * candidates)
    num_features = len(config.user_feature_cardinalities)
    features = np.stack([rng.integers(0, c, size=batch) for c in config.user_feature_cardinalities], 1) \
        if num_features else np.zeros((batch, 0), dtype=np.int64)

    def carrying(start: int) -> VisitBatch:
        return VisitBatch(
            request_ids=np.arange(batch, dtype=np.int64),
            user_ids=np.arange(batch, dtype=np.int64),
            request_times_ms=times[:, -1] + 60_000,
            window_starts=np.zeros(batch, dtype=np.int64),
            starts=np.full(batch, start, dtype=np.int64),
            history_lengths=np.full(batch, history - start, dtype=np.int64),
            prev_timestamps_ms=times[:, max(start - 1, 0)].copy(),
            user_features=features.astype(np.int64),
            video_ids=videos[:, start:].reshape(-1).astype(np.int64),
            action_weights=actions[:, start:].reshape(-1).astype(np.int64),
            timestamps_ms=times[:, start:].reshape(-1).astype(np.int64),
            candidate_lengths=np.full(batch, candidates, dtype=np.int64),
            candidate_video_ids=cands.astype(np.int64),
            labels=None,
        )

    return carrying(0), carrying(history - new)


def long_history_config(config: HSTUConfig, longest: int) -> HSTUConfig:
    """`config` with windows of at least `longest` history tokens. N (max_seq_len) only scales
    attention and the position table only clamps, so a timing at the preset's shapes does not
    depend on raising them."""
    if longest <= config.max_seq_len:
        return config
    return config.replace(max_seq_len=longest, position_table_size=max(longest, config.position_table_size))
