"""The model training starts from: a preset shaped by a recipe, and the start the recipe asks of it.

    model = fresh_model(dataset, TrainParams(preset="demo"))

`model.train.train` starts from it; `benchmark/inference_end2end_example.py --recipe` serves it
untrained, so a replay (the GPU report's) runs the kernels the trained checkpoint will need.
"""
from __future__ import annotations

import torch

from data import schema
from data.dataset import InferenceDataset
from model.config import config_for_dataset
from model.embeddings import VIDEO_ID_TABLE
from model.features import VIDEO_TAG
from model.recommender import HSTURecommender
from model.train_params import TrainParams, trained_attention_window
from model.video_side_features import VideoSideFeatures
from model.video_tags import VideoTagTable


def fresh_model(dataset: InferenceDataset, params: TrainParams) -> HSTURecommender:
    """The model `train` starts from: `params.preset` for this data, shaped by the recipe's model fields
    (dropout, id rows, window, tags, tag match) and initialised by `initialise`, on `params.device`.
    Seed torch first for a reproducible draw (`train` seeds it with `params.seed`)."""
    config = config_for_dataset(params.preset, dataset).replace(dropout=params.dropout, id_dropout=params.id_dropout)
    overrides = {name: getattr(params, name) for name in ("position_table_size", "video_hash_size", "user_hash_size")
                 if getattr(params, name) is not None}
    config = config.replace(**overrides, attention_window=trained_attention_window(params))
    tags = VideoTagTable.from_dataset_dir(dataset.root) if params.video_tags is not False else None
    if params.video_tags and tags is None:
        raise ValueError(f"{dataset.root} has no video tags (its source had no "
                         f"{schema.VIDEO_FEATURES_BASIC}); train without video_tags")
    if tags is not None:
        config = config.replace(num_video_tags=tags.num_rows, tag_match_bias=params.tag_match_bias)
    sides = None
    if params.side_feature_hash_size:
        sides = VideoSideFeatures.from_dataset_dir(dataset.root, params.side_feature_hash_size)
        config = config.replace(side_feature_hash_size=params.side_feature_hash_size if sides is not None else 0)
    model = HSTURecommender(config, device=params.device, video_tags=tags, side_features=sides)
    initialise(model, params)
    return model


def initialise(model: HSTURecommender, params: TrainParams) -> None:
    """The start `params` asks of a fresh model (TrainParams.tag_embedding_std, .id_embedding_std,
    .tied_query_key_init, .tag_match_prior); a tag setting is skipped by a model without tags."""
    tables = model.embedder.collection.embeddings
    with torch.no_grad():
        if params.tag_match_prior is not None and model.config.tag_match_bias:
            for layer in model.layers:
                layer.relative_bias.tag_match.fill_(params.tag_match_prior)
        if params.tag_embedding_std is not None and model.config.num_video_tags:
            tables[f"table_{VIDEO_TAG}"].weight.normal_(std=params.tag_embedding_std)
        if params.id_embedding_std is not None:
            tables[VIDEO_ID_TABLE].weight.normal_(std=params.id_embedding_std)
        if params.tied_query_key_init:
            for layer in model.layers:
                for tensor in (layer.uvqk.weight, layer.uvqk.bias):
                    _, _, query, key = tensor.chunk(4, dim=0)  # the rows of u, v, q and k (views)
                    key.copy_(query)
