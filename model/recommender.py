"""HSTURecommender: embeddings -> HSTU layers -> multi-task head, with or without a KV cache."""
from __future__ import annotations

import torch
from torch import nn

from data.batch import VisitBatch
from kvcache import KVCacheManager, KVCacheMetadata
from model.config import NUM_ACTION_IDS, HSTUConfig
from model.embeddings import TokenEmbedder
from model.hstu import AttentionPlan, HSTULayer, KVStore
from model.kv_store import PagedKV, WindowKV
from model.token_layout import TokenLayout, TokenSpans


class StaleKVCacheError(RuntimeError):
    """The KV cache no longer holds what the batch was planned against (e.g. evicted from
    every tier by another caller in between). Nothing was changed; re-plan the visit."""


class HSTURecommender(nn.Module):
    def __init__(self, config: HSTUConfig, device: torch.device | str | None = None):
        super().__init__()
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.config = config
        self.layout = TokenLayout(config)
        self.embedder = TokenEmbedder(config, self.layout, device=device)
        self.layers = nn.ModuleList(HSTULayer(config, i) for i in range(config.num_layers))
        self.output_norm = nn.LayerNorm(config.hidden_dim)
        self.head = nn.Sequential(
            nn.Linear(config.hidden_dim, config.mlp_hidden_dim),
            nn.SiLU(),
            nn.Linear(config.mlp_hidden_dim, config.num_tasks),
        )
        self.to(device)

    @property
    def device(self) -> torch.device:
        return self.output_norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.output_norm.weight.dtype

    def forward(
        self, batch: VisitBatch, kv_cache: KVCacheManager | None = None, cache_tags: list[bytes] | None = None
    ) -> torch.Tensor:
        """Candidate logits [sum candidate_lengths, num_tasks].

        Without a cache the batch must carry each user's whole window (starts ==
        window_starts). With one, it carries only the uncached events: the cache is
        prepared for the new history tokens, every layer appends their K/V and attends over
        cached + new, and the cache is committed only if the whole forward succeeds (rolled
        back and re-raised otherwise). `cache_tags` (one per user, see model/cache_tag.py)
        are stored with the users' K/V on commit.
        """
        spans = self.layout.spans(batch.window_starts, batch.starts, batch.history_lengths)
        self._validate(batch, spans, cached=kv_cache is not None)
        x_hist, x_cand = self.embedder(batch, spans)
        x_hist, x_cand = x_hist.to(self.dtype), x_cand.to(self.dtype)
        if kv_cache is None:
            plan = AttentionPlan.from_lengths(spans.history_lengths, batch.candidate_lengths, spans.history_lengths, None)
            return self.run_layers(x_hist, x_cand, plan, WindowKV())

        user_ids = batch.user_ids.tolist()
        metadata = kv_cache.prepare_kv_cache(user_ids, spans.start_pos, spans.history_lengths, tags=cache_tags)
        try:
            _check_cache_matches_plan(metadata, spans, batch, user_ids)
            plan = AttentionPlan.from_lengths(
                spans.history_lengths, batch.candidate_lengths, metadata.total_lengths, metadata.cached_lengths
            )
            logits = self.run_layers(x_hist, x_cand, plan, PagedKV(kv_cache, metadata))
        except BaseException:
            kv_cache.rollback(metadata)
            raise
        kv_cache.commit(metadata)
        return logits

    def run_layers(self, x_hist: torch.Tensor, x_cand: torch.Tensor, plan: AttentionPlan, kv: KVStore) -> torch.Tensor:
        """The HSTU block and head on token embeddings: what the benchmarks time on its own."""
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x_hist, x_cand = layer(x_hist, x_cand, plan, kv, history_outputs_needed=i < last)
        return self.head(self.output_norm(x_cand)).float()  # [M, num_tasks]

    def _validate(self, batch: VisitBatch, spans: TokenSpans, cached: bool) -> None:
        """Refuse a malformed batch before any state is touched, naming the user and range."""
        cfg = self.config
        sizes = {
            "video_ids": (batch.video_ids.numel(), batch.history_lengths),
            "candidate_video_ids": (batch.candidate_video_ids.numel(), batch.candidate_lengths),
        }
        for name, (numel, lengths) in sizes.items():
            if numel != int(lengths.sum()):
                raise ValueError(f"VisitBatch.{name} has {numel} values but its lengths sum to {int(lengths.sum())}")
        if batch.labels.shape != (batch.candidate_video_ids.numel(), cfg.num_tasks):
            raise ValueError(f"VisitBatch.labels has shape {tuple(batch.labels.shape)}, expected "
                             f"({batch.candidate_video_ids.numel()}, {cfg.num_tasks})")
        bad_start = (batch.starts < batch.window_starts) | (batch.history_lengths < 0)
        if not cached:
            bad_start |= batch.starts != batch.window_starts
        window_tokens = spans.expected_cached_lengths + spans.history_lengths
        too_long = window_tokens > cfg.max_seq_len
        for mask, what in ((bad_start, "events outside its window" if cached else
                            "a partial window without a KV cache (full recompute needs starts == window_starts)"),
                           (too_long, f"a window longer than max_seq_len={cfg.max_seq_len} tokens")):
            if bool(mask.any()):
                b = int(torch.nonzero(mask)[0])
                raise ValueError(
                    f"User {int(batch.user_ids[b])}: batch carries {what}: window starts at event "
                    f"{int(batch.window_starts[b])}, events {int(batch.starts[b])} to {int(batch.ends[b]) - 1}"
                )
        n_features = len(cfg.user_feature_cardinalities) if cfg.use_contextual_prefix else 0
        if n_features:
            if batch.user_features.ndim != 2 or batch.user_features.shape[1] < n_features:
                raise ValueError(f"VisitBatch.user_features has shape {tuple(batch.user_features.shape)}, "
                                 f"the model needs {n_features} features per user")
            limits = torch.tensor(cfg.user_feature_cardinalities, device=batch.user_features.device)
            bad = (batch.user_features[:, :n_features] < 0) | (batch.user_features[:, :n_features] >= limits)
            if bool(bad.any()):
                b, j = (int(i) for i in torch.nonzero(bad)[0])
                raise ValueError(f"User {int(batch.user_ids[b])}: user feature {j} = "
                                 f"{int(batch.user_features[b, j])} is outside [0, {cfg.user_feature_cardinalities[j]})")
        for name in ("video_ids", "candidate_video_ids"):
            values = getattr(batch, name)
            if values.numel() and int(values.min()) < 0:
                raise ValueError(f"VisitBatch.{name} contains a negative id")
        if batch.action_weights.numel() and not bool(((batch.action_weights >= 0) & (batch.action_weights < NUM_ACTION_IDS)).all()):
            raise ValueError(f"VisitBatch.action_weights must be 8-bit action masks in [0, {NUM_ACTION_IDS})")


def _check_cache_matches_plan(
    metadata: KVCacheMetadata, spans: TokenSpans, batch: VisitBatch, user_ids: list[int]
) -> None:
    """The cache must hold exactly the window tokens before the computed ones; a user whose
    data vanished in between would otherwise be served with a truncated window."""
    expected_start = batch.window_starts.to(metadata.cached_start_pos.device)
    expected_len = spans.expected_cached_lengths.to(metadata.cached_lengths.device)
    bad = (metadata.cached_start_pos != expected_start) | (metadata.cached_lengths != expected_len)
    if bool(bad.any()):
        b = int(torch.nonzero(bad)[0])
        raise StaleKVCacheError(
            f"User {user_ids[b]}: the KV cache holds {int(metadata.cached_lengths[b])} tokens from position "
            f"{int(metadata.cached_start_pos[b])}, the batch expected {int(expected_len[b])} from {int(expected_start[b])}"
        )
