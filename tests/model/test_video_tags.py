"""Video tags: the table, the token feature it feeds, the checkpoint that carries it, and parity."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import (
    Visit,
    assert_logits_close,
    random_candidates,
    random_histories,
    random_tag_table,
    sensitive_model,
    serve,
    tagged_model,
    tiny_config,
)
from model.checkpoint import CheckpointError, load_checkpoint, model_fingerprint, save_checkpoint
from model.video_tags import UNKNOWN_TAG_ROW, VideoTagTable


def test_table_maps_videos_to_dense_rows_and_unknown_videos_to_row_zero():
    table = VideoTagTable.from_pairs(np.array([40, 7, 12, 3]), np.array([900, 5, 900, 77]))
    assert table.num_rows == 4  # unknown + tags 5, 77, 900
    assert table.rows(np.array([3, 7, 12, 40, 41, -1, 0])).tolist() == [2, 1, 3, 3, 0, 0, 0]
    assert VideoTagTable.from_pairs(np.array([], np.int64), np.array([], np.int64)).rows(np.array([5])).tolist() == [0]
    with pytest.raises(ValueError, match="video 7 has more than one tag"):
        VideoTagTable.from_pairs(np.array([7, 7]), np.array([1, 2]))


def test_a_model_that_embeds_tags_refuses_to_run_without_a_fitting_table():
    rng = np.random.default_rng(0)
    cfg = tiny_config(num_video_tags=5)
    model = sensitive_model(cfg, 0)
    histories = random_histories(rng, 2, 10, cfg)
    visits = [Visit(u, 10, random_candidates(rng, 2)) for u in histories]
    with pytest.raises(ValueError, match="no VideoTagTable"):
        serve(model, None, histories, visits)
    with pytest.raises(ValueError, match="13 rows, the model's tag embedding 5"):
        model.video_tags = random_tag_table(rng, num_tags=12)
    with pytest.raises(ValueError, match="no tag embedding"):
        sensitive_model(tiny_config(), 0).video_tags = random_tag_table(rng, num_tags=2)


def test_the_tag_is_read_for_history_and_candidates():
    """Changing only the tag table moves the scores; a video the table does not know reads row 0."""
    rng = np.random.default_rng(1)
    table = random_tag_table(rng)
    model = tagged_model(1, table)
    histories = random_histories(rng, 3, 30, model.config)
    visits = [Visit(u, 30, random_candidates(rng, 4)) for u in histories]
    before = serve(model, None, histories, visits)
    retagged = VideoTagTable.from_pairs(table.video_ids, np.roll(table.tags[table.tag_rows - 1], 1))
    fingerprint = model_fingerprint(model)
    model.video_tags = retagged
    after = serve(model, None, histories, visits)
    assert (after - before).abs().max() > 1e-2
    assert model_fingerprint(model) != fingerprint  # K/V of the old tags are never reused
    # Untagged videos all read UNKNOWN_TAG_ROW: with none known, the scores follow that row alone.
    model.video_tags = VideoTagTable.from_pairs(np.array([10**9]), np.array([1]))
    blank = serve(model, None, histories, visits)
    with torch.no_grad():
        model.embedder.collection.embeddings["table_video_tag"].weight[UNKNOWN_TAG_ROW].normal_()
    assert (serve(model, None, histories, visits) - blank).abs().max() > 1e-2


def test_checkpoint_carries_the_table(tmp_path):
    rng = np.random.default_rng(3)
    model = tagged_model(3, random_tag_table(rng))
    save_checkpoint(model, tmp_path / "ck")
    loaded = load_checkpoint(tmp_path / "ck").model
    assert np.array_equal(loaded.video_tags.video_ids, model.video_tags.video_ids)
    assert np.array_equal(loaded.video_tags.tag_rows, model.video_tags.tag_rows)
    assert model_fingerprint(loaded) == model_fingerprint(model)
    histories = random_histories(rng, 2, 20, model.config)
    visits = [Visit(u, 20, random_candidates(rng, 3)) for u in histories]
    assert_logits_close(serve(loaded, None, histories, visits), serve(model, None, histories, visits))

    payload = torch.load(tmp_path / "ck" / "model.pt", weights_only=True)
    del payload["video_tags"]
    torch.save(payload, tmp_path / "ck" / "model.pt")
    with pytest.raises(CheckpointError, match="embeds video tags but holds no video tag table"):
        load_checkpoint(tmp_path / "ck")
