"""What the end-to-end replay serves: the model, the visits and their warm-up, and the cache sized for them.

The replay (benchmark/serving/end2end.py) and the KV benchmarks that replay the same visits
(kvcache/codec_report.py, kvcache/entropy.py) build them here, so that each serves what the replay serves.
"""
from __future__ import annotations

import argparse
import logging

import numpy as np
import torch

from benchmark.cli import DTYPES
from data.dataset import InferenceDataset
from kvcache import KVCacheConfig
from model.cache_config import kv_cache_config, page_layout
from model.checkpoint import CheckpointError, load_checkpoint
from model.config import config_for_dataset
from model.fresh_model import fresh_model
from model.recommender import HSTURecommender
from model.train_params import RECIPES, TrainParams

log = logging.getLogger("end2end")


def load_model(args: argparse.Namespace, dataset: InferenceDataset) -> HSTURecommender:
    expected_features = tuple(dataset.user_feature_cardinalities)
    if args.checkpoint is None:
        log.warning("WARNING: no --checkpoint given: serving a RANDOMLY INITIALISED model "
                    "(parity and speed are meaningful, AUCs are not)")
        torch.manual_seed(args.seed)
        if args.recipe is None:
            config = config_for_dataset(args.preset, dataset)
            if args.attention_window is not None:
                config = config.replace(attention_window=args.attention_window)
            model = HSTURecommender(config, device=args.device)
        else:  # the start of training: the recipe's shape and initial weights
            recipe = {**RECIPES[args.recipe], "attention_window": args.attention_window}
            model = fresh_model(dataset, TrainParams(preset=args.preset, device=args.device, **recipe))
    else:
        model = load_checkpoint(args.checkpoint, device=args.device, attention_window=args.attention_window).model
        if model.config.use_contextual_prefix and model.config.user_feature_cardinalities != expected_features:
            raise CheckpointError(
                f"Checkpoint {args.checkpoint} was trained for user-feature vocabularies "
                f"{list(model.config.user_feature_cardinalities)}, the data in {args.data_dir} has "
                f"{list(expected_features)}: retrain on this data"
            )
    return model.to(DTYPES[args.dtype]).eval()


def window_pages(model: HSTURecommender, dataset: InferenceDataset, indices: np.ndarray, page_size: int) -> np.ndarray:
    """[n] pages the window of each request occupies in the cache."""
    return -(-model.layout.window_tokens(dataset.requests.end[indices]) // page_size)


def working_set_pages(model: HSTURecommender, dataset: InferenceDataset, indices: np.ndarray,
                      page_size: int) -> tuple[int, int]:
    """-> (pages to keep every replayed user's largest window on the device at once,
           pages of the largest single window)."""
    users = dataset.requests.user_id[indices]
    largest = {}
    for u, n in zip(users.tolist(), window_pages(model, dataset, indices, page_size).tolist()):
        largest[u] = max(largest.get(u, 0), n)
    return sum(largest.values()), max(largest.values())


def largest_batch_pages(model: HSTURecommender, dataset: InferenceDataset, batches: list[np.ndarray],
                        page_size: int) -> int:
    """The fewest device pages that serve every batch: the users of a batch cannot evict one
    another, so the pool must hold all their windows at once."""
    return max((int(window_pages(model, dataset, b, page_size).sum()) for b in batches), default=0)


def warmup_batches(dataset: InferenceDataset, indices: np.ndarray, from_ms: int, batch_size: int) -> list[np.ndarray]:
    """Each replayed user's last visit before the replay window: serving it leaves the cache
    exactly as if every earlier visit had been served (cache contents depend only on the window)."""
    req = dataset.requests
    users = np.unique(req.user_id[indices])
    earlier = dataset.request_indices(until_time_ms=from_ms)
    earlier = earlier[np.isin(req.user_id[earlier], users)]
    _, last_pos = np.unique(req.user_id[earlier][::-1], return_index=True)
    last = np.sort(earlier[::-1][last_pos])
    return list(dataset.batches(last, batch_size))


def cache_config(args: argparse.Namespace, model: HSTURecommender, working_set: int, largest_window: int,
                 page_size: int, fingerprint: str) -> KVCacheConfig:
    """By default the device pool holds a quarter of the working set (so users are evicted and
    reloaded) but always at least one full batch of the largest windows."""
    num_pages = args.kv_pages
    if num_pages is None:
        num_pages = max(working_set // 4, args.batch_size * largest_window)
    bytes_per_page = page_layout(model.config, DTYPES[args.dtype], page_size).page_nbytes
    host_capacity = args.host_capacity
    if host_capacity is None:
        host_capacity = int(working_set * bytes_per_page * 1.5) + bytes_per_page
    return kv_cache_config(
        model.config, num_pages=num_pages, page_size=page_size, keep_unread_kv=args.keep_unread_kv,
        dtype=DTYPES[args.dtype], device=args.device, host_capacity_bytes=host_capacity, async_offload=args.async_offload,
        kv_codec=args.kv_codec, **tier_settings(args, fingerprint),
    )


def tier_settings(args: argparse.Namespace, fingerprint: str) -> dict:
    """KVCacheConfig fields of the tier below host memory. Redis keys are namespaced by the
    model fingerprint, so nodes serving another model never read these K/V."""
    if args.kv_tier == "disk":
        return {"persistent_dir": args.kv_dir, "persistent_capacity_bytes": args.tier_capacity}
    if args.kv_tier == "redis":
        return {"redis_url": args.redis_url, "redis_namespace": fingerprint, "redis_capacity_bytes": args.tier_capacity}
    return {}
