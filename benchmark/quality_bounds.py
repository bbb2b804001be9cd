"""What synthetic data lets any model reach: the click AUC of the generator's own quantities.

    python benchmark/quality_bounds.py --data_dir <processed> --scale 0.005 --seed 7 --signal item

Redraws the world the data was generated from (the same `data.synthetic` scale, seed and signal,
checked against the manifest's row counts) and scores quality_benchmark.py's evaluated candidates
with what a model could at best know:

    oracle affinity        taste + quality + propensity, the true logit (less the action noise)
    taste / quality / propensity alone
    propensity + quality from sightings
                           the true propensity plus each video's posterior mean quality given every
                           training-period sighting of it, everything else about those sightings
                           known (unseen videos: the prior mean). No model that learns a video only
                           from its sightings knows its quality better.
    taste, true clusters   the user's share of training exposures in the candidate's true cluster
    taste, co-exposure clusters
                           the same with clusters recovered from who was shown what (a 64-topic
                           mixture fitted by EM on the training exposures), and how pure they are

A model above "propensity + quality from sightings" is reading taste or the user's own recent
history; the taste rows say how much taste is worth when clusters are known and when they must be
recovered. Prints the table and writes JSON (--output). Meant for demo-sized data (tens of
thousands of videos): the topic fit holds [64, videos] matrices.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from data import schema
from data.dataset import InferenceDataset
from data.synthetic import generate
from data.synthetic_world import SIGNALS, World, intercept, sigmoid, signal_config
from model.baselines import Interactions
from model.metrics import auc
from model.quality import QualitySplit, quality_split
from model.train import DEFAULT_SPLIT_DATE

QUALITY_GRID = np.linspace(-5.0, 5.0, 101)  # posterior support of a video's quality, affinity units
SIGHTING_BUCKETS = ((1, 2), (2, 5), (5, 20), (20, None))
LOG_FILES = (schema.LOG_STANDARD_EARLY, schema.LOG_STANDARD_LATE)  # what preprocessing reads
CHUNK_ROWS = 100_000  # sightings per step of the quality posterior ([rows, grid] floats)


def quality_posterior_mean(world: World, events: Interactions, click_rate: float, slope: float,
                           quality_std: float) -> tuple[np.ndarray, np.ndarray]:
    """-> (videos, [V] posterior mean quality) from the clicks of `events`, each sighting's taste and
    propensity known: a grid posterior under the generator's click model and its normal prior."""
    affinity = world.affinity(events.user_ids, events.video_ids)
    bias = intercept(affinity, slope, click_rate)
    rest = affinity - world.quality[events.video_ids]
    videos, row = np.unique(events.video_ids, return_inverse=True)
    clicked = events.labels[:, 0] > 0.5
    log_lik = np.zeros((len(videos), len(QUALITY_GRID)))
    for start in range(0, len(row), CHUNK_ROWS):
        part = slice(start, start + CHUNK_ROWS)
        p = sigmoid(bias + slope * (rest[part, None] + QUALITY_GRID[None]))  # [chunk, G]
        np.add.at(log_lik, row[part], np.where(clicked[part, None], np.log(p), np.log1p(-p)))
    log_post = log_lik - QUALITY_GRID[None] ** 2 / (2 * max(quality_std, 1e-9) ** 2)
    post = np.exp(log_post - log_post.max(axis=1, keepdims=True))
    return videos, (post * QUALITY_GRID).sum(axis=1) / post.sum(axis=1)


def coexposure_topics(users: np.ndarray, videos: np.ndarray, num_topics: int, iterations: int,
                      rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A topic mixture of exposures fitted by EM: P(video | user) = Σ_k θ[user, k] φ[k, video].
    -> (user ids, [U, K] θ, video ids, [K, V] φ)."""
    user_ids, u = np.unique(users, return_inverse=True)
    video_ids, v = np.unique(videos, return_inverse=True)
    pair, count = np.unique(u * len(video_ids) + v, return_counts=True)
    pu, pv = pair // len(video_ids), pair % len(video_ids)
    theta = rng.dirichlet(np.ones(num_topics), len(user_ids))
    phi = rng.dirichlet(np.ones(len(video_ids)), num_topics)
    for _ in range(iterations):
        resp = theta[pu] * phi[:, pv].T  # [P, K]
        resp *= (count / resp.sum(axis=1))[:, None]
        theta = np.zeros_like(theta)
        np.add.at(theta, pu, resp)
        theta = (theta + 1e-3) / (theta + 1e-3).sum(axis=1, keepdims=True)
        phi = np.zeros_like(phi)
        np.add.at(phi.T, pv, resp)
        phi = (phi + 1e-6) / (phi + 1e-6).sum(axis=1, keepdims=True)
    return user_ids, theta, video_ids, phi


def _data_rows(path: Path) -> int:
    with open(path) as f:
        return sum(1 for _ in f) - 1  # less the header


def _lookup(keys: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """-> (index into sorted `keys`, found) for each of `wanted`."""
    index = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
    return index, keys[index] == wanted


def bounds(world: World, split: QualitySplit, num_clusters: int, click_rate: float, slope: float,
           quality_std: float, iterations: int, rng: np.random.Generator) -> tuple[dict[str, float], list[dict]]:
    """-> (click AUC of each score in the module docstring, co-exposure cluster purity by sightings)."""
    pairs, training = split.eval_pairs, split.training_period_events
    u, v, clicks = pairs.user_ids, pairs.video_ids, pairs.labels[:, 0]
    scores = {
        "oracle affinity": world.affinity(u, v),
        "taste alone": world.taste_affinity(u, v),
        "quality alone": world.quality[v],
        "propensity alone": world.propensity[u],
    }
    seen_videos, quality = quality_posterior_mean(world, training, click_rate, slope, quality_std)
    index, seen = _lookup(seen_videos, v)
    scores["propensity + quality from sightings"] = world.propensity[u] + np.where(seen, quality[index], 0.0)

    exposure = np.zeros((world.num_users, num_clusters))
    np.add.at(exposure, (training.user_ids, world.video_cluster[training.video_ids]), 1.0)
    share = (exposure + 0.1) / (exposure + 0.1).sum(axis=1, keepdims=True)
    scores["taste, true clusters"] = np.log(share[u, world.video_cluster[v]])

    user_ids, theta, video_ids, phi = coexposure_topics(training.user_ids, training.video_ids, num_clusters, iterations, rng)
    uu, _ = _lookup(user_ids, u)
    vv, v_seen = _lookup(video_ids, v)
    prior = theta.mean(axis=0)
    # log P(v | user) / P(v): how much likelier this user is to be shown the video than anyone
    lift = np.log((theta[uu] * phi[:, vv].T).sum(axis=1)) - np.log((prior * phi[:, vv].T).sum(axis=1))
    scores["taste, co-exposure clusters"] = np.where(v_seen, lift, 0.0)

    sightings = np.bincount(np.searchsorted(video_ids, training.video_ids), minlength=len(video_ids))
    topic = phi.argmax(axis=0)
    true_cluster = world.video_cluster[video_ids]
    purity = []
    for low, high in SIGHTING_BUCKETS:
        in_bucket = (sightings >= low) & (sightings < (high or np.inf))
        table = np.zeros((num_clusters, num_clusters))
        np.add.at(table, (topic[in_bucket], true_cluster[in_bucket]), 1.0)
        candidates = v_seen & in_bucket[vv]
        purity.append({
            "sightings": f"{low}+" if high is None else str(low) if high == low + 1 else f"{low}-{high - 1}",
            "videos": int(in_bucket.sum()), "candidates": int(candidates.sum()),
            "purity": float(table.max(axis=1).sum() / max(in_bucket.sum(), 1)),
            "auc_coexposure": auc(lift[candidates], clicks[candidates]),
            "auc_true_clusters": auc(scores["taste, true clusters"][candidates], clicks[candidates]),
        })
    return {name: auc(score, clicks) for name, score in scores.items()}, purity


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_dir", required=True, help="preprocessor_inference.py output of the synthetic logs")
    p.add_argument("--scale", type=float, required=True, help="data.synthetic --scale the logs were made with")
    p.add_argument("--seed", type=int, required=True, help="data.synthetic --seed")
    p.add_argument("--signal", choices=tuple(SIGNALS), required=True, help="data.synthetic --signal")
    p.add_argument("--split_date", type=int, default=DEFAULT_SPLIT_DATE)
    p.add_argument("--max_eval_requests", type=int, default=None)
    p.add_argument("--em_iterations", type=int, default=100)
    p.add_argument("--output", type=Path, help="JSON results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    config = signal_config(args.signal)
    try:
        dataset = InferenceDataset(args.data_dir)
        split = quality_split(dataset, args.split_date, max_eval_requests=args.max_eval_requests)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as raw:
        summary = generate(raw, args.scale, args.seed, config, progress=False)
        rows = {name: _data_rows(Path(raw) / name) for name in LOG_FILES}
    logged = dataset.manifest.counts.rows_read
    if any(logged.get(name) != count for name, count in rows.items()):
        print(f"error: {args.data_dir} was not made by data.synthetic --scale {args.scale} --seed {args.seed} "
              f"--signal {args.signal}: log rows {logged} vs {rows}", file=sys.stderr)
        return 2
    aucs, purity = bounds(summary.world, split, config.num_clusters, config.rates[schema.TASKS.index("click")],
                          config.signal_strength,
                          config.item_quality_std / config.signal_strength, args.em_iterations,
                          np.random.default_rng(args.seed))
    print(f"\nclick AUC on {len(split.eval_requests)} visits from {args.split_date} on "
          f"({len(split.eval_pairs.user_ids)} candidates), --signal {args.signal}")
    for name, value in aucs.items():
        print(f"  {name:<40} {'n/a' if value is None else f'{value:.4f}'}")
    print("co-exposure clusters by the video's training sightings:")
    for row in purity:
        print(f"  {row['sightings']:>5} sightings: {row['videos']:>6} videos, {row['candidates']:>6} candidates, "
              f"purity {row['purity']:.3f}, AUC {row['auc_coexposure'] or float('nan'):.4f} "
              f"(true clusters {row['auc_true_clusters'] or float('nan'):.4f})")
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"auc": aucs, "coexposure_purity": purity}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
