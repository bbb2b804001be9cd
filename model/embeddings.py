"""Token embeddings through one TorchRec EmbeddingCollection (features: model/features.py).

One lookup serves a whole batch. The KeyedJaggedTensor has one row per feature: the token
features (five, six with video tags) over every event and candidate token, then one user feature per prefix token
position over the users that open their window. Its per-key sizes are known on the host,
so splitting it by key never reads lengths back from the device.

Beside the collection, `video_bias` holds one per-task logit offset per video, read for the
candidates only and added to their logits (`candidate_bias`).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor, nn
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

from model.config import NUM_ACTION_IDS, HSTUConfig
from model.features import VIDEO_TAG, TokenFeatures, token_feature_names
from model.video_side_features import side_feature_sizes

# TorchRec calls torch.fx's deprecated is_fx_tracing() on every forward, and torch logs a
# one-time notice about it that means nothing to users of this model.
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


VIDEO_ID_TABLE = "table_video_id"  # the hashed video-id rows in the collection


def user_feature_name(j: int) -> str:
    return f"user_feature_{j}"


class TokenEmbedder(nn.Module):
    def __init__(self, config: HSTUConfig, device: torch.device | None = None):
        super().__init__()
        self.config = config
        sizes = {
            "video_id": config.video_hash_size,
            "action": NUM_ACTION_IDS + 1,  # + UNKNOWN_ACTION_ID for candidates
            "time_gap": config.num_time_gap_buckets,
            "hour": 24,
            "position": config.position_table_size,
        }
        if config.num_video_tags:
            sizes[VIDEO_TAG] = config.num_video_tags
        if config.side_feature_hash_size:
            sizes.update(side_feature_sizes(config.side_feature_hash_size))
        self.token_features = token_feature_names(config)
        if config.use_contextual_prefix:
            for j, cardinality in enumerate(config.user_feature_cardinalities):
                sizes[user_feature_name(j)] = cardinality
        self.feature_names = tuple(sizes)
        self.num_prefix = len(self.feature_names) - len(self.token_features)
        self.collection = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name=f"table_{name}", embedding_dim=config.hidden_dim, num_embeddings=n,
                                feature_names=[name])
                for name, n in sizes.items()
            ],
            device=device or torch.device("cpu"),
        )
        for table in self.collection.embeddings.values():
            nn.init.normal_(table.weight, std=0.02)
        # A per-task logit offset of each candidate video: what a video's own appeal (its quality)
        # adds for every user. The token embedding carries the same id, but there it is one of
        # five summed, layer-normed inputs shared with everything the candidate attends to, which
        # makes a plain per-video offset slow to learn; here it is one row read straight into the
        # logits. Candidates only, so nothing cached depends on it.
        self.video_bias = nn.Embedding(config.video_hash_size, config.num_tasks, device=device)
        nn.init.zeros_(self.video_bias.weight)

    def host_inputs(self, features: TokenFeatures) -> dict[str, np.ndarray]:
        """The arrays `forward` needs on the device (packed into the batch's one upload)."""
        values = [features.token_ids[name] for name in self.token_features]
        values += [features.prefix_ids[:, j] for j in range(self.num_prefix)]
        return {
            "kjt_values": np.concatenate(values),
            "kjt_lengths": np.array([len(v) for v in values], dtype=np.int64),
            "token_rows": features.token_rows,
            "prefix_rows": features.prefix_rows.reshape(-1),
            "candidate_video_ids": features.candidate_video_ids,
            "candidate_user_ids": features.candidate_user_ids,
            **features.candidate_counters,
        }

    def candidate_bias(self, device_inputs: Mapping[str, Tensor]) -> Tensor:
        """-> [shape.candidate_rows, num_tasks]: each candidate row's video offset (padding rows read row 0)."""
        return self.video_bias(device_inputs["candidate_video_ids"])

    def item_embeddings(self, rows: Mapping[str, Tensor]) -> Tensor:
        """The item part of a token's embedding: each item feature's rows [U] (the hashed video id, and the
        tag and side features of a model with them) -> [U, hidden_dim], their rows summed."""
        tables = self.collection.embeddings
        return sum(tables[f"table_{name}"](feature_rows) for name, feature_rows in rows.items())

    def forward(self, device_inputs: Mapping[str, Tensor], features: TokenFeatures) -> Tensor:
        """-> x [shape.num_rows, hidden_dim] float32: token embeddings in the row layout of model/features.py
        (padding rows are zero)."""
        sizes = [len(features.token_rows)] * len(self.token_features) + [len(features.prefix_ids)] * self.num_prefix
        kjt = KeyedJaggedTensor(
            keys=list(self.feature_names),
            values=device_inputs["kjt_values"],
            lengths=device_inputs["kjt_lengths"],
            stride=1,
            length_per_key=sizes,
            offset_per_key=[0, *np.cumsum(sizes).tolist()],
        )
        embedded = self.collection(kjt)
        tokens = sum(embedded[name].values() for name in self.token_features)  # [N + M, d]
        if self.training and self.config.id_dropout:
            ids = embedded["video_id"].values()
            dropped = torch.rand(ids.shape[0], 1, device=ids.device) < self.config.id_dropout
            tokens = tokens - ids * dropped
        x = tokens.new_zeros(features.shape.num_rows + 1, tokens.shape[-1])  # + the scratch row
        x = x.index_copy(0, device_inputs["token_rows"], tokens)
        if features.prefix_ids.size:
            names = [user_feature_name(j) for j in range(self.num_prefix)]
            prefix = torch.stack([embedded[name].values() for name in names], 1)  # [P, C, d]
            x = x.index_copy(0, device_inputs["prefix_rows"], prefix.reshape(-1, prefix.shape[-1]))
        return x[: features.shape.num_rows]
