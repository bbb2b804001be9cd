"""The generator's regimes (catalogue x tags x signal) and the video side features it writes and the
preprocessor reads."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from data import schema
from data.raw import RawDataError, read_video_side_features, read_video_tags
from data.synthetic import generate
from data.synthetic_regimes import CLUSTERS_PER_COARSE_TAG, DENSE_CATALOGUE, REGIMES, regime_config

BASIC_HEADER = ",".join(schema.VIDEO_BASIC_COLUMNS)



def _tag_agreement(summary, out: Path) -> tuple[float, int]:
    """-> (share of videos whose primary tag is their cluster's most frequent one, clusters per tag)."""
    table = read_video_tags(out / schema.VIDEO_FEATURES_BASIC)
    videos, tags = table.column("video_id").to_numpy(), table.column("tag").to_numpy()
    clusters = summary.video_cluster[videos]
    counts = np.zeros((clusters.max() + 1, tags.max() + 1), np.int64)
    np.add.at(counts, (clusters, tags), 1)
    category = counts.argmax(axis=1)
    return float((category[clusters] == tags).mean()), int(np.bincount(category).max())


@pytest.mark.parametrize("tags", ["informative", "coarse", "absent"])
def test_tags_name_one_cluster_several_or_none(tmp_path: Path, tags: str):
    summary = generate(tmp_path, scale=0.002, seed=3, config=regime_config(f"sparse-{tags}-taste"), progress=False)
    agree, clusters_per_category = _tag_agreement(summary, tmp_path)
    if tags == "absent":
        assert agree < 0.2
    else:
        assert agree > 0.65
        assert clusters_per_category == (CLUSTERS_PER_COARSE_TAG if tags == "coarse" else 1)


def test_a_dense_catalogue_has_its_size_at_any_scale_and_videos_repeat(tmp_path: Path):
    summary = generate(tmp_path, scale=0.002, seed=4, config=regime_config("dense-absent-sequential"), progress=False)
    assert summary.num_videos == DENSE_CATALOGUE
    sparse = generate(tmp_path / "s", scale=0.002, seed=4, config=regime_config("sparse-absent-sequential"),
                      progress=False)
    assert sparse.num_videos > 5 * DENSE_CATALOGUE
    assert summary.sequence is not None and sparse.sequence is not None


def test_authors_specialise_in_a_cluster(tmp_path: Path):
    summary = generate(tmp_path, scale=0.002, seed=6, config=regime_config("sparse-informative-taste"), progress=False)
    table = read_video_side_features(tmp_path / schema.VIDEO_FEATURES_BASIC)
    videos, authors = table.column("video_id").to_numpy(), table.column("author_id").to_numpy()
    clusters = summary.video_cluster[videos]
    counts = np.zeros((authors.max() + 1, clusters.max() + 1), np.int64)
    np.add.at(counts, (authors, clusters), 1)
    assert 0.7 < counts.max(axis=1).sum() / len(videos) < 0.95  # author_fidelity 0.8 plus chance


def test_every_regime_builds_and_bad_names_are_refused():
    assert len(REGIMES) == 12
    for name in REGIMES:
        regime_config(name)
    with pytest.raises(ValueError, match="unknown regime 'dense-sequential'"):
        regime_config("dense-sequential")


def test_side_features_are_read_and_bad_cells_named(tmp_path: Path):
    path = tmp_path / "basic.csv"
    row = "{video},{author},NORMAL,2022-01-01,{upload},public,{duration},720,1280,7,4,28"
    lines = [BASIC_HEADER, row.format(video=1, author=5, upload="Web", duration="1500.0"),
             row.format(video=2, author="", upload="", duration="")]
    path.write_text("\n".join(lines) + "\n")
    table = read_video_side_features(path)
    assert table.column("author_id").to_pylist() == [5, None]
    assert table.column("video_duration").to_pylist() == [1500.0, None]
    assert table.column("upload_type").to_pylist() == ["Web", ""]  # an empty type reads as unknown
    path.write_text("\n".join([*lines, row.format(video=3, author=-4, upload="Web", duration="1")]) + "\n")
    with pytest.raises(RawDataError) as err:
        read_video_side_features(path)
    assert (err.value.column, err.value.line) == ("author_id", 4)
