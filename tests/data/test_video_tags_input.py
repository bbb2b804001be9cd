"""The video tags from raw basic video features to the preprocessed output, and the generator's tags."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from data import schema
from data.manifest import PreprocessParams
from data.preprocess import preprocess
from data.raw import RawDataError, read_video_tags
from data.synthetic import generate
from data.synthetic_world import signal_config
from helpers import MINUTE, T0, feature_row, log_row, write_raw_dir
from model.video_tags import VideoTagTable

BASIC_HEADER = ",".join(schema.VIDEO_BASIC_COLUMNS)


def basic_features(path: Path, tags: dict[int, str]) -> Path:
    """A basic video feature file whose `tag` cells are `tags` (video_id -> raw cell text)."""
    other = ",".join(["0", "NORMAL", "2022-01-01", "ShortImport", "public", "1000", "720", "1280", "0", "4"])
    lines = [BASIC_HEADER] + [f"{video},{other},{cell}" for video, cell in tags.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def raw_dir(root: Path, tags: dict[int, str] | None) -> Path:
    early = [log_row(user, 100 + visit, T0 + visit * 60 * MINUTE) for user in (1, 2) for visit in range(2)]
    late = [log_row(user, 109, T0 + 200 * MINUTE) for user in (1, 2)]
    data = write_raw_dir(root, early, late, [feature_row(1), feature_row(2)])
    if tags is not None:
        basic_features(data / schema.VIDEO_FEATURES_BASIC, tags)
    return data


def test_primary_tags_are_read_and_untagged_videos_left_out(tmp_path: Path):
    path = basic_features(tmp_path / "basic.csv", {100: "28", 101: '"2,28"', 102: "", 103: '" 7 , 9"', 109: "40"})
    table = read_video_tags(path)
    assert table.column("video_id").to_pylist() == [100, 101, 103, 109]
    assert table.column("tag").to_pylist() == [28, 2, 7, 40]


@pytest.mark.parametrize("cells, column, line, problem", [
    ({100: "28", 101: "x7"}, "tag", 3, "expected comma-separated category ids, got 'x7'"),
    ({100: "28", 101: '"3,,4"'}, "tag", 3, "expected comma-separated category ids"),
    ({100: "28", 101: "-5"}, "tag", 3, "expected comma-separated category ids, got '-5'"),
    ({-3: "28"}, "video_id", 2, "negative id -3"),
])  # fmt: skip
def test_bad_tag_files_name_column_and_line(tmp_path: Path, cells, column, line, problem):
    path = basic_features(tmp_path / "basic.csv", cells)
    with pytest.raises(RawDataError) as err:
        read_video_tags(path)
    assert (err.value.column, err.value.line) == (column, line)
    assert problem in str(err.value)


def test_a_duplicate_video_is_refused(tmp_path: Path):
    path = tmp_path / "basic.csv"
    basic_features(path, {100: "28", 101: "3"})
    path.write_text(path.read_text() + path.read_text().splitlines()[1] + "\n")
    with pytest.raises(RawDataError, match="line 4: duplicate video_id"):
        read_video_tags(path)


def test_preprocess_writes_tags_only_when_the_source_has_them(tmp_path: Path):
    tagged = preprocess(raw_dir(tmp_path / "a", {100: "28", 101: '"5,6"', 109: "28"}), tmp_path / "out_a",
                        PreprocessParams(), progress=False)
    assert schema.VIDEO_FEATURES_BASIC in tagged.input_files
    table = VideoTagTable.from_dataset_dir(tmp_path / "out_a")
    assert table.rows(np.array([100, 101, 109, 102])).tolist() == [2, 1, 2, 0]
    preprocess(raw_dir(tmp_path / "b", None), tmp_path / "out_b", PreprocessParams(), progress=False)
    assert VideoTagTable.from_dataset_dir(tmp_path / "out_b") is None
    # A second run over an output with tags, from a source without them, replaces the whole output.
    preprocess(raw_dir(tmp_path / "c", None), tmp_path / "out_a", PreprocessParams(), progress=False)
    assert sorted(p.name for p in (tmp_path / "out_a").iterdir()) == sorted(schema.OUTPUT_FILES)


def test_a_bad_tag_file_writes_nothing(tmp_path: Path):
    src = raw_dir(tmp_path / "a", {100: "28", 101: "?"})
    with pytest.raises(RawDataError, match="column 'tag': line 3"):
        preprocess(src, tmp_path / "out", PreprocessParams(), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no output, nothing left beside it


def test_generated_tags_follow_the_clusters(tmp_path: Path):
    """The primary tag names the video's cluster for about `tag_fidelity` of the videos."""
    config = signal_config("mixed", tag_fidelity=0.8, second_tag_share=0.3)
    summary = generate(tmp_path, scale=0.002, seed=5, config=config, progress=False)
    table = read_video_tags(tmp_path / schema.VIDEO_FEATURES_BASIC)
    videos, tags = table.column("video_id").to_numpy(), table.column("tag").to_numpy()
    clusters = summary.video_cluster[videos]
    # The category of each cluster is its most frequent primary tag.
    k = len(np.unique(clusters))
    counts = np.zeros((k, tags.max() + 1), np.int64)
    np.add.at(counts, (clusters, tags), 1)
    agree = counts.max(axis=1).sum() / len(videos)
    assert 0.75 < agree < 0.86  # 0.8 of the videos, plus the random draws that hit their own category
    assert len(np.unique(counts.argmax(axis=1))) == k  # one category per cluster


def test_training_with_tags_on_data_without_them_is_refused(tmp_path: Path):
    from data.dataset import InferenceDataset
    from model.train import train
    from model.train_params import TrainParams

    preprocess(raw_dir(tmp_path / "a", None), tmp_path / "out", PreprocessParams(), progress=False)
    with pytest.raises(ValueError, match="has no video tags"):
        train(InferenceDataset(tmp_path / "out"), TrainParams(preset="tiny", video_tags=True))


def test_tag_probe_refuses_data_without_tags(tmp_path: Path, capsys):
    from benchmark.quality.tag_probe import main

    preprocess(raw_dir(tmp_path / "a", None), tmp_path / "out", PreprocessParams(), progress=False)
    assert main(["--data_dir", str(tmp_path / "out")]) == 2
    assert "has no video tags" in capsys.readouterr().err
