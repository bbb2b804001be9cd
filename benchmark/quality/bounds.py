"""What synthetic data lets any model reach: the click AUC of the generator's own quantities.

    python -m benchmark.quality.bounds --data_dir <processed> --scale 0.005 --seed 7 --signal item

Redraws the world the data was generated from (the same `data.synthetic` scale, seed and signal,
checked against the manifest's row counts) and scores benchmark/quality/against_baselines.py's evaluated candidates
with what a model could at best know:

    oracle affinity        taste + quality + propensity, the true logit (less the action noise)
    taste / quality / propensity alone
    propensity + quality from sightings
                           the true propensity plus each video's posterior mean quality given every
                           training-period sighting of it, everything else about those sightings
                           known (unseen videos: the prior mean)
    taste, true clusters   the user's share of training exposures in the candidate's true cluster
    Bayes: world known, videos from sightings
                           the Bayes-optimal click probability when every user's taste, propensity
                           and the generator's rules are known, and only each video's cluster and
                           quality are not: those are inferred from who was shown the video in
                           training, whether they clicked, and that it is shown to this user now

The Bayes row bounds any model that learns videos from the training period's logs: a real one must
also learn the users' tastes, which that row is given. It is broken down by how many training
sightings the candidate's video has, with how often its most likely cluster is the true one.

On `--signal sequential` data, where exposures and clicks depend on the order of each user's events,
those rows' click and exposure models do not hold; the script scores instead with and without the
order of the history (benchmark/quality/sequence_bounds.py): the oracle, the history in order, the history as
a bag of events, the affinity alone, and what the order is worth (in order less bag); and, where the
data has video tags, the last three again with each video's cluster read from its tag.

Prints the table and writes JSON (--output). Meant for demo-sized data (tens of thousands of
videos): the posterior holds a [videos, clusters, 29] array.
"""
from __future__ import annotations

import argparse
import sys
import tempfile

import numpy as np

from benchmark.cli import add_data_dir, add_output
from benchmark.quality.sequence_bounds import order_bounds
from benchmark.report import write_json
from data import schema
from data.dataset import InferenceDataset
from data.jagged import sorted_lookup
from data.schema import DEFAULT_SPLIT_DATE
from data.synthetic import SyntheticSummary, generate
from data.synthetic_regimes import REGIMES, regime_config
from data.synthetic_world import SIGNALS, SyntheticConfig, World, intercept, sigmoid, signal_config
from model.baselines import Interactions
from model.metrics import auc
from model.quality import QualitySplit, quality_split
from model.video_tags import VideoTagTable

QUALITY_GRID = np.linspace(-5.0, 5.0, 101)  # posterior support of a video's quality, affinity units
SIGHTING_BUCKETS = ((0, 1), (1, 2), (2, 5), (5, 20), (20, None))  # [low, high) training sightings
BAYES_QUALITY_GRID = np.linspace(-3.5, 3.5, 29, dtype=np.float32)  # coarser: it is crossed with the clusters
BAYES_CHUNK_ROWS = 4_000  # rows per step of the Bayes posterior ([rows, clusters, grid] floats)
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
    for part in _chunks(len(row), CHUNK_ROWS):
        p = sigmoid(bias + slope * (rest[part, None] + QUALITY_GRID[None]))  # [chunk, G]
        np.add.at(log_lik, row[part], np.where(clicked[part, None], np.log(p), np.log1p(-p)))
    log_post = log_lik - QUALITY_GRID[None] ** 2 / (2 * max(quality_std, 1e-9) ** 2)
    post = np.exp(log_post - log_post.max(axis=1, keepdims=True))
    return videos, (post * QUALITY_GRID).sum(axis=1) / post.sum(axis=1)


def bayes_click_probability(world: World, config: SyntheticConfig, training: Interactions, pairs: Interactions,
                            click_rate: float) -> tuple[np.ndarray, np.ndarray]:
    """The Bayes-optimal click probability of each pair when everything about the world is known
    except each video's cluster and quality, which are inferred from the video's training sightings
    (who was shown it, and whether they clicked) and from its being shown to this user now.
    -> ([M] probability, [M] whether the posterior's most likely cluster is the true one)."""
    k, slope = world.taste.shape[1], config.signal_strength
    quality_std = config.item_quality_std / slope
    taste = world.cluster_taste_affinity().astype(np.float32)  # [U, K]
    # log P(a video of cluster c is shown to user u), up to a factor that does not depend on c
    # (clusters are the same size, so a video's rank in its cluster says nothing of which it is)
    shown = np.log(world.cluster_exposure_probability(config.taste_exposure)).astype(np.float32)
    bias = intercept(world.affinity(training.user_ids, training.video_ids), slope, click_rate)
    grid = BAYES_QUALITY_GRID[None, None]

    def click_probability(users: np.ndarray) -> np.ndarray:  # -> [n, K, G]
        return sigmoid(bias + slope * (taste[users][:, :, None] + grid + world.propensity[users][:, None, None]))

    videos, row = np.unique(training.video_ids, return_inverse=True)
    log_lik = np.zeros((len(videos), k, grid.shape[-1]), np.float32)  # each video's sightings, summed
    clicked = training.labels[:, 0] > 0.5
    for part in _chunks(len(row), BAYES_CHUNK_ROWS):
        users, p = training.user_ids[part], click_probability(training.user_ids[part])
        np.add.at(log_lik, row[part], shown[users][:, :, None] + np.where(clicked[part, None, None], np.log(p), np.log1p(-p)))
    if quality_std > 0:
        log_prior = -grid ** 2 / (2 * quality_std ** 2)
    else:  # a world without quality: all the mass on the grid point at 0
        log_prior = np.where(np.abs(grid) == np.abs(grid).min(), 0.0, -np.inf)
    index, seen = sorted_lookup(videos, pairs.video_ids)
    probability, map_right = np.zeros(len(pairs.user_ids)), np.zeros(len(pairs.user_ids), bool)
    for part in _chunks(len(probability), BAYES_CHUNK_ROWS):
        users = pairs.user_ids[part]
        log_post = np.where(seen[part, None, None], log_lik[index[part]], 0.0) + log_prior + shown[users][:, :, None]
        post = np.exp(log_post - log_post.max(axis=(1, 2), keepdims=True))
        post /= post.sum(axis=(1, 2), keepdims=True)
        probability[part] = (post * click_probability(users)).sum(axis=(1, 2))
        map_right[part] = post.sum(axis=2).argmax(axis=1) == world.video_cluster[pairs.video_ids[part]]
    return probability, map_right


def _chunks(n: int, size: int):
    """Slices of [0, n) of at most `size` rows: the posteriors are [rows, grid] or [rows, clusters, grid]."""
    for start in range(0, n, size):
        yield slice(start, start + size)


def bounds(world: World, config: SyntheticConfig, split: QualitySplit) -> tuple[dict[str, float | None], list[dict]]:
    """-> (click AUC of each score in the module docstring, the Bayes row by the video's training sightings)."""
    num_clusters, slope = config.num_clusters, config.signal_strength
    quality_std, click_rate = config.item_quality_std / slope, config.rates[schema.TASKS.index("click")]
    pairs, training = split.eval_pairs, split.training_period_events
    u, v, clicks = pairs.user_ids, pairs.video_ids, pairs.labels[:, 0]
    scores = {
        "oracle affinity": world.affinity(u, v),
        "taste alone": world.taste_affinity(u, v),
        "quality alone": world.quality[v],
        "propensity alone": world.propensity[u],
    }
    seen_videos, quality = quality_posterior_mean(world, training, click_rate, slope, quality_std)
    index, seen = sorted_lookup(seen_videos, v)
    scores["propensity + quality from sightings"] = world.propensity[u] + np.where(seen, quality[index], 0.0)

    exposure = np.zeros((world.num_users, num_clusters))
    np.add.at(exposure, (training.user_ids, world.video_cluster[training.video_ids]), 1.0)
    share = (exposure + 0.1) / (exposure + 0.1).sum(axis=1, keepdims=True)
    scores["taste, true clusters"] = np.log(share[u, world.video_cluster[v]])

    probability, map_right = bayes_click_probability(world, config, training, pairs, click_rate)
    scores["Bayes: world known, videos from sightings"] = probability

    by_sightings = []
    for label, rows in sighting_buckets(candidate_sightings(training.video_ids, v)):
        by_sightings.append({
            "sightings": label, "candidates": int(rows.sum()),
            "cluster_recovered": float(map_right[rows].mean()) if rows.any() else None,
            "auc_bayes": auc(probability[rows], clicks[rows]),
            "auc_taste_true_clusters": auc(scores["taste, true clusters"][rows], clicks[rows]),
        })
    return {name: auc(score, clicks) for name, score in scores.items()}, by_sightings


def candidate_sightings(training_videos: np.ndarray, candidate_videos: np.ndarray) -> np.ndarray:
    """[M] how often each candidate's video was exposed in the training period: what a model can learn of
    that video from its id.

    >>> candidate_sightings(np.array([4, 4, 9]), np.array([4, 9, 7]))
    array([2, 1, 0])
    """
    videos, counts = np.unique(training_videos, return_counts=True)
    index, seen = sorted_lookup(videos, candidate_videos)  # index is a valid row even where unseen
    return np.where(seen, counts[index], 0) if len(videos) else np.zeros(len(index), np.int64)


def sighting_buckets(sightings: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """(label, bool rows) of each `SIGHTING_BUCKETS` range."""
    return [(f"{low}+" if high is None else str(low) if high == low + 1 else f"{low}-{high - 1}",
             (sightings >= low) & (sightings < (high or np.inf))) for low, high in SIGHTING_BUCKETS]


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _report_sightings(summary: SyntheticSummary, config: SyntheticConfig, split: QualitySplit, header: str) -> dict:
    aucs, by_sightings = bounds(summary.world, config, split)
    print(header)
    _print_aucs(aucs)
    print("the Bayes row by the video's training sightings:")
    for row in by_sightings:
        recovered = "n/a" if row["cluster_recovered"] is None else f"{row['cluster_recovered']:.3f}"
        print(f"  {row['sightings']:>5} sightings: {row['candidates']:>6} candidates, cluster recovered {recovered}, "
              f"AUC {_fmt(row['auc_bayes'])} (taste with true clusters {_fmt(row['auc_taste_true_clusters'])})")
    return {"auc": aucs, "bayes_by_sightings": by_sightings}


def _report_order(summary: SyntheticSummary, dataset: InferenceDataset, split: QualitySplit, header: str) -> dict:
    aucs, gains = order_bounds(summary.world, summary.sequence, dataset, split,
                               tags=VideoTagTable.from_dataset_dir(dataset.root))
    print(header)
    _print_aucs(aucs)
    for reading, gain in gains.items():
        print(f"order is worth {_fmt(gain) if gain is None else f'{gain:+.4f}'} click AUC with {reading} "
              "(history in order less history as a bag)")
    # No row here infers a video's cluster from its id; how often the ids were seen says what that could add.
    sightings = candidate_sightings(split.training_period_events.video_ids, split.eval_pairs.video_ids)
    shares = {label: float(rows.mean()) for label, rows in sighting_buckets(sightings)}
    print("candidates by their video's training sightings: "
          + ", ".join(f"{label} {share:.1%}" for label, share in shares.items()))
    return {"auc": aucs, "order_gain": gains, "candidate_share_by_sightings": shares}


def _print_aucs(aucs: dict[str, float | None]) -> None:
    for name, value in aucs.items():
        print(f"  {name:<44} {_fmt(value)}")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(p, help="preprocessor_inference.py output of the synthetic logs")
    p.add_argument("--scale", type=float, required=True, help="data.synthetic --scale the logs were made with")
    p.add_argument("--seed", type=int, required=True, help="data.synthetic --seed")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--signal", choices=tuple(SIGNALS), help="data.synthetic --signal")
    source.add_argument("--regime", choices=REGIMES, help="data.synthetic --regime")
    p.add_argument("--split_date", type=int, default=DEFAULT_SPLIT_DATE)
    p.add_argument("--max_eval_requests", type=int, default=None)
    add_output(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    config = regime_config(args.regime) if args.regime else signal_config(args.signal)
    made_by = f"--regime {args.regime}" if args.regime else f"--signal {args.signal}"
    try:
        dataset = InferenceDataset(args.data_dir)
        split = quality_split(dataset, args.split_date, max_eval_requests=args.max_eval_requests)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as raw:
        summary = generate(raw, args.scale, args.seed, config, progress=False)
    rows = {name: summary.rows[name] for name in LOG_FILES}
    logged = dataset.manifest.counts.rows_read
    if any(logged.get(name) != count for name, count in rows.items()):
        print(f"error: {args.data_dir} was not made by data.synthetic --scale {args.scale} --seed {args.seed} "
              f"{made_by}: log rows {logged} vs {rows}", file=sys.stderr)
        return 2
    header = (f"\nclick AUC on {len(split.eval_requests)} visits from {args.split_date} on "
              f"({len(split.eval_pairs.user_ids)} candidates), {made_by}")
    if summary.sequence is not None:
        report = _report_order(summary, dataset, split, header)
    else:
        report = _report_sightings(summary, config, split, header)
    write_json(args.output, {**report, "candidates": len(split.eval_pairs.user_ids)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
