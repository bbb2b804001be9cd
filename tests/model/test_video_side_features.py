"""Video side features (author, music, duration, upload type): the table, the tokens they feed, the
checkpoint that carries them, cached == full recompute with them, and the preprocessed file they come from."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import (
    Visit,
    assert_logits_close,
    build_processed,
    random_candidates,
    random_histories,
    sensitive_model,
    serve,
    tiny_config,
)
from kvcache import KVCacheManager
from model.cache_config import kv_cache_config
from model.checkpoint import CheckpointError, load_checkpoint, model_fingerprint, save_checkpoint
from model.video_side_features import DURATION_ROWS, SIDE_FEATURES, VideoSideFeatures

HASH_ROWS = 31


def random_side_table(rng: np.random.Generator) -> VideoSideFeatures:
    """Side features for a random half of the video ids random_candidates / random_histories draw from."""
    videos = rng.choice(50_000, size=25_000, replace=False)
    columns = {"author_id": rng.integers(0, 500, len(videos)), "music_id": rng.integers(0, 90, len(videos)),
               "video_duration": rng.uniform(1_000, 300_000, len(videos)),
               "upload_type": rng.choice(np.array(["Web", "ShortImport", "LongImport"], dtype=object), len(videos))}
    return VideoSideFeatures.from_columns(videos, columns, HASH_ROWS)


def side_model(seed: int, table: VideoSideFeatures):
    model = sensitive_model(tiny_config(side_feature_hash_size=HASH_ROWS), seed)
    model.side_features = table
    return model


def test_rows_hash_ids_bucket_durations_and_read_unknowns_as_row_zero():
    table = VideoSideFeatures.from_columns(
        np.array([30, 10, 20]),
        {"author_id": np.array([5.0, np.nan, 64.0]), "video_duration": np.array([0.0, 3_000.0, 10**9]),
         "upload_type": np.array(["b", None, "a"], dtype=object)}, hash_rows=11)
    rows = table.rows(np.array([10, 20, 30, 40]))
    assert rows["author"].tolist() == [0, 1 + 64 % 10, 1 + 5, 0]  # NaN id and unheld video: unknown
    assert rows["music"].tolist() == [0, 0, 0, 0]  # no music column
    assert rows["duration"].tolist() == [1 + 4, DURATION_ROWS - 1, 1, 0]  # 2 log2(1 + 3 s) = 4
    assert rows["upload_type"].tolist() == [0, 1, 2, 0]  # ranks of "a", "b"
    with pytest.raises(ValueError, match="listed twice"):
        VideoSideFeatures.from_columns(np.array([1, 1]), {}, hash_rows=11)
    with pytest.raises(ValueError, match="hash_rows must be >= 2"):
        VideoSideFeatures.from_columns(np.array([1]), {}, hash_rows=1)


def test_every_side_feature_moves_the_scores_and_the_fingerprint():
    rng = np.random.default_rng(0)
    table = random_side_table(rng)
    model = side_model(0, table)
    histories = random_histories(rng, 3, 30, model.config)
    visits = [Visit(u, 30, random_candidates(rng, 4)) for u in histories]
    before = serve(model, None, histories, visits)
    fingerprint = model_fingerprint(model)
    for j, name in enumerate(SIDE_FEATURES):
        rows = table.feature_rows.copy()
        rows[:, j] = 0
        model.side_features = VideoSideFeatures(table.video_ids, rows, HASH_ROWS)
        assert (serve(model, None, histories, visits) - before).abs().max() > 1e-3, name
        assert model_fingerprint(model) != fingerprint
    model.side_features = table
    assert_logits_close(serve(model, None, histories, visits), before)


def test_a_model_with_side_features_refuses_a_missing_or_mismatched_table():
    rng = np.random.default_rng(1)
    model = sensitive_model(tiny_config(side_feature_hash_size=HASH_ROWS), 0)
    histories = random_histories(rng, 2, 10, model.config)
    visits = [Visit(u, 10, random_candidates(rng, 2)) for u in histories]
    with pytest.raises(ValueError, match="no VideoSideFeatures"):
        serve(model, None, histories, visits)
    with pytest.raises(ValueError, match="hashes into 11 rows"):
        model.side_features = VideoSideFeatures.from_columns(np.array([1]), {}, hash_rows=11)


def test_cached_serving_equals_full_recompute_with_side_features():
    rng = np.random.default_rng(2)
    model = side_model(2, random_side_table(rng))
    cfg = model.config
    histories = random_histories(rng, 3, 40, cfg)
    cache = KVCacheManager(kv_cache_config(cfg, num_pages=256))
    for end in (12, 25, 40):  # three visits of each user through the cache
        visits = [Visit(u, end, random_candidates(rng, 3)) for u in histories]
        assert_logits_close(serve(model, cache, histories, visits), serve(model, None, histories, visits))


def test_checkpoint_carries_the_table(tmp_path):
    rng = np.random.default_rng(3)
    model = side_model(3, random_side_table(rng))
    save_checkpoint(model, tmp_path / "ck")
    loaded = load_checkpoint(tmp_path / "ck").model
    assert np.array_equal(loaded.side_features.feature_rows, model.side_features.feature_rows)
    assert model_fingerprint(loaded) == model_fingerprint(model)
    payload = torch.load(tmp_path / "ck" / "model.pt", weights_only=True)
    del payload["side_features"]
    torch.save(payload, tmp_path / "ck" / "model.pt")
    with pytest.raises(CheckpointError, match="embeds video side-features but holds no video side-feature table"):
        load_checkpoint(tmp_path / "ck")


def test_preprocessing_keeps_the_side_features_of_the_basic_video_features(tmp_path):
    processed = build_processed(tmp_path, scale=0.002, seed=5)
    table = VideoSideFeatures.from_dataset_dir(processed, HASH_ROWS)
    assert table is not None and len(table.video_ids) > 0
    known = (table.feature_rows > 0).mean(axis=0)
    assert (known > 0.99).all(), dict(zip(SIDE_FEATURES, known))  # the generator fills every cell


def test_a_fresh_model_reads_the_side_features_when_asked(tmp_path):
    from data.dataset import InferenceDataset
    from model.fresh_model import fresh_model
    from model.train_params import TrainParams

    dataset = InferenceDataset(build_processed(tmp_path, scale=0.002, seed=5))
    model = fresh_model(dataset, TrainParams(preset="tiny", side_feature_hash_size=HASH_ROWS))
    assert model.config.side_feature_hash_size == HASH_ROWS and model.side_features is not None
    assert fresh_model(dataset, TrainParams(preset="tiny", side_feature_hash_size=0)).side_features is None
    with pytest.raises(ValueError, match="side_feature_hash_size must be 0 \\(none\\) or >= 2, got 1"):
        TrainParams(side_feature_hash_size=1)
