"""The regimes the synthetic generator covers: catalogue x tags x signal, each a `SyntheticConfig`.

    config = regime_config("dense-absent-sequential")
    generate(out_dir, scale=0.008, seed=0, config=config)

A regime is named `CATALOGUE-TAGS-SIGNAL`:

    catalogue  dense    a fixed catalogue of DENSE_CATALOGUE videos, each seen many times (a head of
                        popular videos, or a small service): ids repeat, so a model can learn them
               sparse   the real catalogue's size per event (4.37M videos for 11.7M events): most videos
                        are seen once or twice, so only what they share (tags, authors) carries over
    tags       informative  the primary tag names the video's cluster for TAG_FIDELITY of the videos
               coarse   a tag names one of CLUSTERS_PER_COARSE_TAG clusters (a top-level category)
               absent   tags are drawn at random: they carry nothing
    signal     sequential   what a user clicks next follows the order of the last clicks (the successor of
                            a recent cluster, fatigue, a feed that follows interest; data/synthetic_world.py)
               taste    users like a few clusters, steadily: order carries nothing, the bag of the
                        history does

Why these axes: KuaiRand-1K's catalogue is sparse (docs/data.md), but a service's head and a smaller
catalogue are dense; its tags are noisy categories; and both kinds of signal are what a user's
history can carry. The settings come from the dataset's shape (shared/KUAIRAND_1K.md), not from a model.
"""
from __future__ import annotations

from itertools import product

from data.synthetic_world import SIGNALS, SyntheticConfig

DENSE_CATALOGUE = 1000
TAG_FIDELITY = 0.7
CLUSTERS_PER_COARSE_TAG = 4

CATALOGUES: dict[str, dict[str, object]] = {"dense": {"catalogue_videos": DENSE_CATALOGUE}, "sparse": {}}
TAGS: dict[str, dict[str, object]] = {
    "informative": {"tag_fidelity": TAG_FIDELITY},
    "coarse": {"tag_fidelity": TAG_FIDELITY, "clusters_per_tag": CLUSTERS_PER_COARSE_TAG},
    "absent": {"tag_fidelity": 0.0},
}
REGIME_SIGNALS: dict[str, dict[str, object]] = {
    "sequential": SIGNALS["sequential"],
    # Each user likes a few of the clusters (a peaked Dirichlet) and nothing else moves a click.
    "taste": {**SIGNALS["item"], "item_quality_std": 0.0, "taste_concentration": 0.1},
}
REGIMES: tuple[str, ...] = tuple("-".join(parts) for parts in product(CATALOGUES, TAGS, REGIME_SIGNALS))


def regime_config(name: str, **overrides) -> SyntheticConfig:
    """The SyntheticConfig of a regime `CATALOGUE-TAGS-SIGNAL` (`REGIMES`), with other fields replaced."""
    parts = name.split("-")
    if len(parts) != 3 or parts[0] not in CATALOGUES or parts[1] not in TAGS or parts[2] not in REGIME_SIGNALS:
        raise ValueError(f"unknown regime {name!r}; choose one of {', '.join(REGIMES)}")
    catalogue, tags, signal = parts
    return SyntheticConfig(**{**REGIME_SIGNALS[signal], **CATALOGUES[catalogue], **TAGS[tags], **overrides})
