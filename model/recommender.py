"""HSTURecommender: embeddings -> HSTU layers -> multi-task head, over any KV store.

    logits = model(batch)        # full recompute: every user's whole window is in the batch
    logits = model(batch, kv)    # incremental: the batch carries only what `kv` does not hold

The model knows nothing of cache transactions (prepare, commit, rollback, tags): the caller
owns them (model/inference.py) and hands the model a prepared `KVStore`. A forward is two
steps, also callable on their own: `prepare_inputs` plans the batch on the host and moves
everything the device needs in one copy; `run` is device work only (what the benchmarks time
and what a CUDA graph captures).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from data.batch import VisitBatch
from model import attention
from model.attention import AttentionBackend, AttentionBatch, BatchAttention, BiasInputs, KeyWindow, registry
from model.batch_shape import BatchShape
from model.config import NUM_ACTION_IDS, HSTUConfig
from model.counter_features import CounterFeatures
from model.embeddings import TokenEmbedder
from model.features import TokenFeatures, exact_shape, token_features
from model.hstu import HSTULayer
from model.kv_store import FullRecompute, KVStore
from model.staging import DeviceArrays, DeviceStaging
from model.token_layout import TokenLayout, TokenSpans
from model.user_taste import UserTaste
from model.video_side_features import VideoSideFeatures
from model.video_tags import VideoTagTable


@dataclass(frozen=True)
class ModelInputs:
    """A planned batch: host-side plans and the device arrays of its one upload."""

    features: TokenFeatures
    attention: BatchAttention
    device_inputs: DeviceArrays

    @property
    def num_candidates(self) -> int:
        return int(self.attention.plan.batch.candidate_offsets[-1])

    def rebound(self, buffer: Tensor) -> ModelInputs:
        """The same batch reading its arrays from another buffer of the same layout (a graph's static inputs)."""
        arrays = self.device_inputs.rebound(buffer)
        return ModelInputs(self.features, BatchAttention.from_device(self.attention.plan, arrays), arrays)


class HSTURecommender(nn.Module):
    def __init__(self, config: HSTUConfig, device: torch.device | str | None = None,
                 video_tags: VideoTagTable | None = None, side_features: VideoSideFeatures | None = None):
        """`video_tags` and `side_features`: the catalogue snapshots a model with `config.num_video_tags`
        and `config.side_feature_hash_size` reads its tokens' tags and side features from
        (model/video_tags.py, model/video_side_features.py); they can also be set later, before the first batch."""
        super().__init__()
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.config = config
        self._video_tags: VideoTagTable | None = None
        self._side_features: VideoSideFeatures | None = None
        if video_tags is not None:
            self.video_tags = video_tags
        if side_features is not None:
            self.side_features = side_features
        self.layout = TokenLayout(config)
        self.embedder = TokenEmbedder(config, device=device)
        self.layers = nn.ModuleList(HSTULayer(config, i) for i in range(config.num_layers))
        self.output_norm = nn.LayerNorm(config.hidden_dim)
        self.head = nn.Sequential(
            nn.Linear(config.hidden_dim, config.mlp_hidden_dim),
            nn.SiLU(),
            nn.Linear(config.mlp_hidden_dim, config.num_tasks),
        )
        # Candidate-only logit terms beside the head: nothing cached depends on them.
        self.user_taste = UserTaste(config, device=device) if config.user_hash_size else None
        self.counter_features = CounterFeatures(config, device=device) if config.counter_buckets else None
        self._staging: dict[torch.device, DeviceStaging] = {}
        # A backend name of model/attention/registry.py or a backend; "auto": the Triton kernel on CUDA
        # (when triton imports), the blocked torch path elsewhere.
        self.attention_backend: str | AttentionBackend = registry.AUTO
        self.to(device)

    @property
    def video_tags(self) -> VideoTagTable | None:
        return self._video_tags

    @video_tags.setter
    def video_tags(self, table: VideoTagTable) -> None:
        if not self.config.num_video_tags:
            raise ValueError("this model has no tag embedding (config.num_video_tags = 0)")
        if table.num_rows > self.config.num_video_tags:
            raise ValueError(f"the tag table has {table.num_rows} rows, the model's tag embedding "
                             f"{self.config.num_video_tags}")
        self._video_tags = table

    @property
    def side_features(self) -> VideoSideFeatures | None:
        return self._side_features

    @side_features.setter
    def side_features(self, table: VideoSideFeatures) -> None:
        if table.hash_rows != self.config.side_feature_hash_size:
            raise ValueError(f"the side-feature table hashes into {table.hash_rows} rows, the model's "
                             f"side_feature_hash_size is {self.config.side_feature_hash_size}")
        self._side_features = table

    @property
    def device(self) -> torch.device:
        return self.output_norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.output_norm.weight.dtype

    def forward(self, batch: VisitBatch, kv: KVStore | None = None) -> Tensor:
        """Candidate logits [sum candidate_lengths, num_tasks] float32.

        Without `kv` the batch must carry each user's whole window (starts == window_starts).
        With one, it carries only the uncached events, and `kv.cached_lengths` must be exactly
        the tokens of the window before them.
        """
        return self.run(self.prepare_inputs(batch, kv), kv)

    def prepare_inputs(
        self, batch: VisitBatch, kv: KVStore | None = None, shape: BatchShape | None = None, bucketed: bool = False
    ) -> ModelInputs:
        """Validate and plan the batch on the host, then move its arrays to the device in one copy.

        `shape` pads the batch to given row capacities; `bucketed` to those of its CUDA graph bucket
        (`BatchShape.bucket`); default: exact.
        """
        kv = kv if kv is not None else FullRecompute(batch.batch_size)
        spans = self.layout.spans(batch.window_starts, batch.starts, batch.history_lengths)
        self._validate(batch, spans, kv)
        if bucketed and shape is None:
            exact = exact_shape(batch, spans)
            shape = BatchShape.bucket(exact.users, exact.history_rows, exact.candidate_rows)
        features = token_features(self.config, self.layout, batch, spans, shape, self._video_tags, self._side_features)
        plan = self._plan_attention(spans, batch, kv, features.shape, bucketed=shape is not None)
        arrays = {**self.embedder.host_inputs(features), **attention.host_inputs(plan), **kv.host_inputs(features.shape),
                  "query_stamps": features.query_stamps}
        device_inputs = self._staging_for(self.device).upload(arrays)
        return ModelInputs(features, BatchAttention.from_device(plan, device_inputs), device_inputs)

    def run(self, inputs: ModelInputs, kv: KVStore | None = None) -> Tensor:
        """The embeddings, HSTU block and head on a prepared batch: device work only. -> [M, num_tasks]"""
        return self.run_padded(inputs, kv)[: inputs.num_candidates]

    def run_padded(self, inputs: ModelInputs, kv: KVStore | None = None) -> Tensor:
        """`run` over every candidate row of the batch's shape, padding included (what a CUDA graph
        captures: fixed shapes, no host work). -> [shape.candidate_rows, num_tasks] float32"""
        return self.score(self.encode(inputs, kv), inputs)

    def encode(self, inputs: ModelInputs, kv: KVStore | None = None, history_rows: bool = False) -> Tensor:
        """The embeddings and HSTU block. -> the candidate rows' states [shape.candidate_rows, d]; with
        `history_rows`, every row's [T, d], history rows first (the last layer then also attends for
        the history queries, which only training's next-item loss reads: model/next_item_loss.py)."""
        kv = kv if kv is not None else FullRecompute(inputs.attention.plan.batch.num_users)
        x = self.embedder(inputs.device_inputs, inputs.features).to(self.dtype)  # [T, d]
        query_stamps = inputs.device_inputs["query_stamps"]  # [T + 1]
        key_stamps = kv.key_stamps(query_stamps, inputs.attention.plan.num_history_rows, inputs.device_inputs)  # [R]
        bias_inputs = BiasInputs(query_stamps, key_stamps)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, inputs.attention, kv, inputs.device_inputs, history_outputs_needed=history_rows or i < last,
                      bias_inputs=bias_inputs)
        return x

    def score(self, candidate_states: Tensor, inputs: ModelInputs) -> Tensor:
        """Candidate states [shape.candidate_rows, d] -> logits [shape.candidate_rows, num_tasks] float32:
        the head, plus the candidate-only terms."""
        x = candidate_states
        logits = self.head(self.output_norm(x)) + self.embedder.candidate_bias(inputs.device_inputs).to(x.dtype)
        if self.user_taste is not None:
            logits = logits + self.user_taste(inputs.device_inputs).to(x.dtype)
        if self.counter_features is not None:
            logits = logits + self.counter_features(inputs.device_inputs).to(x.dtype)
        return logits.float()

    def resolved_attention_backend(self) -> AttentionBackend:
        """The attention backend `attention_backend` names for this model's config and device."""
        return registry.resolve(self.attention_backend, self.config, self.device)

    def _plan_attention(self, spans: TokenSpans, batch: VisitBatch, kv: KVStore, shape: BatchShape, bucketed: bool):
        key_ends = None
        if batch.candidate_history_ends is not None:  # history targets: each sees the window up to its own event
            window_starts = np.repeat(batch.window_starts, batch.candidate_lengths)
            key_ends = self.layout.num_prefix + batch.candidate_history_ends - window_starts
        window = self.config.attention_window
        key_window = KeyWindow(window, sink=self.layout.num_prefix) if window else None
        attention_batch = AttentionBatch.of(spans.history_lengths, batch.candidate_lengths, kv.cached_lengths,
                                            kv.addressing, shape, bucketed, key_ends, key_window)
        return self.resolved_attention_backend().plan(attention_batch)

    def _staging_for(self, device: torch.device) -> DeviceStaging:
        if device not in self._staging:
            self._staging[device] = DeviceStaging(device)
        return self._staging[device]

    def _validate(self, batch: VisitBatch, spans: TokenSpans, kv: KVStore) -> None:
        """Refuse a malformed batch before any state is touched, naming the user and range."""
        cfg = self.config
        for name, values, lengths in (("video_ids", batch.video_ids, batch.history_lengths),
                                      ("candidate_video_ids", batch.candidate_video_ids, batch.candidate_lengths)):
            if len(values) != int(lengths.sum()):
                raise ValueError(f"VisitBatch.{name} has {len(values)} values but its lengths sum to {int(lengths.sum())}")
        num_candidates = len(batch.candidate_video_ids)
        for name in ("candidate_history_ends", "candidate_times_ms"):
            values = getattr(batch, name)
            if values is not None and values.shape != (num_candidates,):
                raise ValueError(f"VisitBatch.{name} has shape {values.shape}, expected ({num_candidates},)")
        if batch.candidate_history_ends is not None:
            visit = np.repeat(np.arange(batch.batch_size), batch.candidate_lengths)
            outside = ((batch.candidate_history_ends < batch.window_starts[visit])
                       | (batch.candidate_history_ends > batch.ends[visit]))
            if outside.any():
                i = int(np.flatnonzero(outside)[0])
                b = int(visit[i])
                raise ValueError(f"User {int(batch.user_ids[b])}: candidate {i} sees history up to event "
                                 f"{int(batch.candidate_history_ends[i])}, outside its window "
                                 f"[{int(batch.window_starts[b])}, {int(batch.ends[b])}]")
        if batch.labels is not None and batch.labels.shape != (len(batch.candidate_video_ids), cfg.num_tasks):
            raise ValueError(f"VisitBatch.labels has shape {tuple(batch.labels.shape)}, expected "
                             f"({len(batch.candidate_video_ids)}, {cfg.num_tasks})")
        if len(kv.cached_lengths) != batch.batch_size:
            raise ValueError(f"The KV store describes {len(kv.cached_lengths)} users, the batch has {batch.batch_size}")
        outside = (batch.starts < batch.window_starts) | (batch.history_lengths < 0)
        self._refuse_users(batch, outside, "events outside its window")
        partial = kv.cached_lengths != spans.expected_cached_lengths
        what = ("a partial window without a KV cache (full recompute needs starts == window_starts)"
                if isinstance(kv, FullRecompute) else "events that do not continue what the KV cache holds")
        self._refuse_users(batch, partial, what)
        window_tokens = spans.expected_cached_lengths + spans.history_lengths
        self._refuse_users(batch, window_tokens > cfg.max_seq_len, f"a window longer than max_seq_len={cfg.max_seq_len} tokens")
        num_features = self.layout.num_prefix
        if num_features:
            features = batch.user_features
            if features.ndim != 2 or features.shape[1] < num_features:
                raise ValueError(f"VisitBatch.user_features has shape {tuple(features.shape)}, "
                                 f"the model needs {num_features} features per user")
            limits = np.asarray(cfg.user_feature_cardinalities)
            bad = (features[:, :num_features] < 0) | (features[:, :num_features] >= limits)
            if bad.any():
                b, j = np.argwhere(bad)[0]
                raise ValueError(f"User {int(batch.user_ids[b])}: user feature {j} = "
                                 f"{int(features[b, j])} is outside [0, {cfg.user_feature_cardinalities[j]})")
        for name in ("video_ids", "candidate_video_ids"):
            values = getattr(batch, name)
            if values.size and int(values.min()) < 0:
                raise ValueError(f"VisitBatch.{name} contains a negative id")
        actions = batch.action_weights
        if actions.size and ((actions < 0) | (actions >= NUM_ACTION_IDS)).any():
            raise ValueError(f"VisitBatch.action_weights must be 8-bit action masks in [0, {NUM_ACTION_IDS})")

    @staticmethod
    def _refuse_users(batch: VisitBatch, mask: np.ndarray, what: str) -> None:
        if mask.any():
            b = int(np.flatnonzero(mask)[0])
            raise ValueError(
                f"User {int(batch.user_ids[b])}: batch carries {what}: window starts at event "
                f"{int(batch.window_starts[b])}, events {int(batch.starts[b])} to {int(batch.ends[b]) - 1}"
            )
