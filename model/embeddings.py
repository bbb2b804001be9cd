"""Token embeddings through one TorchRec EmbeddingCollection.

Every token feature is a sparse id with its own table:

    event token     = E_video[hash(video)] + E_action[action bits] + E_gap[bucket(t_i - t_{i-1})]
                      + E_hour[hour(t_i)] + E_position[layout position]
    candidate token = same, with the action replaced by the learned UNKNOWN_ACTION_ID vector,
                      t_i the request time and t_{i-1} the user's last event
    prefix token j  = E_user_feature_j[value_j]            (the contextual prefix)

All of them depend only on the token's own event (and the one before it), never on the
batch or on the current time, which is what keeps cached K/V valid.

One lookup serves a whole batch: the KeyedJaggedTensor has 2B rows per feature, rows
0..B-1 for the users' computed events and rows B..2B-1 for their candidates.
"""
from __future__ import annotations

import logging

import torch
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

from data.batch import VisitBatch
from data.jagged import offsets_from_lengths, row_ids_and_ranks
from model.config import NUM_ACTION_IDS, UNKNOWN_ACTION_ID, HSTUConfig
from model.token_layout import TokenLayout, TokenSpans

# TorchRec 1.8 calls torch.fx's deprecated is_fx_tracing() on every forward, and torch logs
# a one-time notice about it that means nothing to users of this model.
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)

TOKEN_FEATURES = ("video_id", "action", "time_gap", "hour", "position")
MS_PER_HOUR = 3_600_000
UTC_OFFSET_HOURS = 8  # KuaiRand timestamps are Beijing time
GAP_BUCKETS_PER_OCTAVE = 3  # time-gap buckets are log2-spaced, 3 per doubling of seconds


def user_feature_name(j: int) -> str:
    return f"user_feature_{j}"


def hour_of_day(timestamps_ms: torch.Tensor) -> torch.Tensor:
    return (torch.div(timestamps_ms, MS_PER_HOUR, rounding_mode="floor") + UTC_OFFSET_HOURS) % 24


def time_gap_bucket(gap_ms: torch.Tensor, num_buckets: int) -> torch.Tensor:
    seconds = gap_ms.clamp(min=0).to(torch.float64) / 1000.0
    bucket = torch.floor(GAP_BUCKETS_PER_OCTAVE * torch.log2(1.0 + seconds)).to(torch.int64)
    return bucket.clamp(max=num_buckets - 1)


class TokenEmbedder(nn.Module):
    def __init__(self, config: HSTUConfig, layout: TokenLayout, device: torch.device | None = None):
        super().__init__()
        self.config = config
        self.layout = layout
        d = config.hidden_dim
        sizes = {
            "video_id": config.video_hash_size,
            "action": NUM_ACTION_IDS + 1,  # + UNKNOWN_ACTION_ID for candidates
            "time_gap": config.num_time_gap_buckets,
            "hour": 24,
            "position": config.position_table_size,
        }
        if config.use_contextual_prefix:
            for j, cardinality in enumerate(config.user_feature_cardinalities):
                sizes[user_feature_name(j)] = cardinality
        self.feature_names = tuple(sizes)
        self.collection = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name=f"table_{name}", embedding_dim=d, num_embeddings=n, feature_names=[name])
                for name, n in sizes.items()
            ],
            device=device or torch.device("cpu"),
        )
        for table in self.collection.embeddings.values():
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, batch: VisitBatch, spans: TokenSpans) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (history tokens [sum spans.history_lengths, d], candidate tokens [M, d]).

        History tokens of user b are its prefix (if this visit opens its window) followed by
        its computed events, users concatenated in batch order.
        """
        cfg = self.config
        n_events, n_cands = batch.video_ids.numel(), batch.candidate_video_ids.numel()
        event_rows, event_ranks = row_ids_and_ranks(batch.history_lengths, n_events)
        cand_rows, _ = row_ids_and_ranks(batch.candidate_lengths, n_cands)

        # Time of the event before each computed event; for a user's first carried event
        # it is batch.prev_timestamps_ms. [N]
        prev_times = torch.roll(batch.timestamps_ms, 1)
        first = event_ranks == 0
        prev_times = torch.where(first, batch.prev_timestamps_ms[event_rows], prev_times)
        # The user's last event before the candidates. [B]
        event_ends = offsets_from_lengths(batch.history_lengths)[1:]
        last_event = batch.prev_timestamps_ms
        if n_events:
            last_in_chunk = batch.timestamps_ms[(event_ends - 1).clamp(min=0)]
            last_event = torch.where(batch.history_lengths > 0, last_in_chunk, last_event)
        request_times = batch.request_times_ms[cand_rows]

        ids = {
            "video_id": (
                torch.remainder(batch.video_ids, cfg.video_hash_size),
                torch.remainder(batch.candidate_video_ids, cfg.video_hash_size),
            ),
            "action": (batch.action_weights, torch.full_like(batch.candidate_video_ids, UNKNOWN_ACTION_ID)),
            "time_gap": (
                time_gap_bucket(batch.timestamps_ms - prev_times, cfg.num_time_gap_buckets),
                time_gap_bucket(request_times - last_event[cand_rows], cfg.num_time_gap_buckets),
            ),
            "hour": (hour_of_day(batch.timestamps_ms), hour_of_day(request_times)),
            "position": (
                self.layout.position_ids(batch.starts[event_rows] + event_ranks),
                spans.candidate_positions[cand_rows],
            ),
        }
        token_lengths = torch.cat([batch.history_lengths, batch.candidate_lengths])  # [2B]
        values, lengths = [], []
        for name in TOKEN_FEATURES:
            values.extend(ids[name])
            lengths.append(token_lengths)
        num_prefix_features = len(self.feature_names) - len(TOKEN_FEATURES)
        has_prefix = spans.prefix_lengths > 0
        for j in range(num_prefix_features):
            values.append(batch.user_features[has_prefix, j])
            lengths.append(torch.cat([has_prefix.to(torch.int64), torch.zeros_like(batch.candidate_lengths)]))
        kjt = KeyedJaggedTensor(keys=list(self.feature_names), values=torch.cat(values), lengths=torch.cat(lengths))
        embedded = self.collection(kjt)

        tokens = sum(embedded[name].values() for name in TOKEN_FEATURES)  # [N + M, d]
        events, candidates = tokens[:n_events], tokens[n_events:]
        if num_prefix_features == 0 or not bool(has_prefix.any()):
            return events, candidates
        prefix = torch.stack([embedded[user_feature_name(j)].values() for j in range(num_prefix_features)], 1)
        return self._interleave_prefix(prefix, events, spans, event_rows, event_ranks), candidates

    @staticmethod
    def _interleave_prefix(
        prefix: torch.Tensor,  # [B_open, C, d] for the users that open their window
        events: torch.Tensor,  # [N, d]
        spans: TokenSpans,
        event_rows: torch.Tensor,
        event_ranks: torch.Tensor,
    ) -> torch.Tensor:
        """Lay out [prefix_b | events_b] for every user b. -> [sum history_lengths, d]"""
        starts = offsets_from_lengths(spans.history_lengths)[:-1]  # [B]
        out = events.new_empty(int(spans.history_lengths.sum()), events.shape[-1])
        out[starts[event_rows] + spans.prefix_lengths[event_rows] + event_ranks] = events
        open_users = torch.nonzero(spans.prefix_lengths > 0).squeeze(1)  # [B_open]
        C = prefix.shape[1]
        slots = starts[open_users].unsqueeze(1) + torch.arange(C, device=out.device)  # [B_open, C]
        out[slots.reshape(-1)] = prefix.reshape(-1, prefix.shape[-1])
        return out
