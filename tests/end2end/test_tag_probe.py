"""benchmark/tag_probe.py: on generated sequential data the tags carry click signal that random tags do not."""
from __future__ import annotations

import numpy as np
from tag_probe import main, probe

from data.dataset import InferenceDataset
from helpers import build_processed
from model.video_tags import VideoTagTable


def test_tags_carry_the_sequential_signal_and_random_tags_do_not(tmp_path, capsys):
    dataset = InferenceDataset(build_processed(tmp_path, scale=0.002, seed=3, signal="sequential"))
    tags = VideoTagTable.from_dataset_dir(dataset.root)
    result = probe(dataset, tags, window=128, split_date=20220422)
    assert result["candidates"] > 1000
    assert result["same_tag_events"] > 0.58 and result["same_tag_click_rate"] > 0.55
    shuffled = VideoTagTable(tags.video_ids, np.random.default_rng(0).permutation(tags.tag_rows), tags.tags)
    at_random = probe(dataset, shuffled, window=128, split_date=20220422)["same_tag_events"]
    assert at_random < 0.55  # a little above chance: a video shown again shares its own tag
    assert result["same_tag_events"] - at_random >= 0.08
    assert main(["--data_dir", str(dataset.root), "--output", str(tmp_path / "p.json")]) == 0
    assert "same_tag_events" in capsys.readouterr().out and (tmp_path / "p.json").is_file()
