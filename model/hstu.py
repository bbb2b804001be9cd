"""The HSTU layer, on a batch's token rows.

    x̂ = LN(x);   u, v, q, k = split(SiLU(x̂ W + b))
    A_ij = SiLU(α q_i·k_j + rab_p(i - j) + rab_t(t_i - t_j) + [tag_i == tag_j] rab_tag) / N
                                      α = 1/sqrt(head_dim), N = config.max_seq_len (fixed)
    out  = x + W_o(u ⊙ LN(A V))

rab_p and rab_t are the layer's relative position and time bias, rab_tag its per-head offset for a
key of the query's video tag (model/attention/relative_bias.py; absent when the config has no
buckets for them, or no tag match). With `config.attention_window` = K, query i sees
only keys j > i - K (its last K keys) and the contextual prefix: the view of a long history that a
model trained on K-event crops was trained on.

Rows of x [T, d] are every user's *history* tokens (prefix + events, causal, the only ones
written to the KV cache), then every user's *candidates* (M-FALCON: each sees all history and
itself, never another candidate; history never sees candidates). A layer projects only the
tokens computed in this visit; the keys and values of the whole window come from a `KVStore`
(the paged KV cache, or the rows themselves when nothing is cached). One code path, one
launch per operation for the whole batch.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch.nn.functional as F
from torch import Tensor, nn

from model.attention import BatchAttention, BiasInputs, RelativeAttentionBias, attend
from model.config import HSTUConfig
from model.kv_store import KVStore


class HSTULayer(nn.Module):
    def __init__(self, config: HSTUConfig, index: int):
        super().__init__()
        self.index = index
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.alpha = 1.0 / math.sqrt(config.head_dim)
        self.normalizer = float(config.max_seq_len)
        a = config.attention_dim
        self.input_norm = nn.LayerNorm(config.hidden_dim)
        self.uvqk = nn.Linear(config.hidden_dim, 4 * a)
        self.attention_norm = nn.LayerNorm(a)
        self.output = nn.Linear(a, config.hidden_dim)
        self.dropout = nn.Dropout(config.dropout)
        buckets = (config.num_position_buckets, config.num_time_buckets)
        self.relative_bias = (RelativeAttentionBias(config.num_heads, *buckets, tag_match=config.tag_match_bias)
                              if any(buckets) or config.tag_match_bias else None)

    def forward(
        self,
        x: Tensor,  # [T, d]: history rows [0, n_hist), then candidate rows
        attention: BatchAttention,
        kv: KVStore,
        device_inputs: Mapping[str, Tensor],
        history_outputs_needed: bool = True,
        bias_inputs: BiasInputs | None = None,
    ) -> Tensor:
        """-> x' [T, d]; with history_outputs_needed=False (the last layer), only the candidate rows
        x'[n_hist:] [M, d]: the history rows still produce their K/V, but are not attended."""
        n_hist = attention.plan.num_history_rows
        H, D = self.num_heads, self.head_dim
        uvqk = F.silu(self.uvqk(self.input_norm(x)))  # [T, 4 H D]
        u, v, q, k = (t.reshape(-1, H, D) for t in uvqk.chunk(4, dim=-1))  # each [T, H, D]
        keys, values = kv.layer_kv(self.index, k, v, n_hist, device_inputs)
        attended = attend(
            q, k, v, keys, values, attention, candidates_only=not history_outputs_needed,
            alpha=self.alpha, normalizer=self.normalizer, bias=self.relative_bias, bias_inputs=bias_inputs,
        ).reshape(-1, H * D)  # [T, H D]
        rows = slice(None) if history_outputs_needed else slice(n_hist, None)
        gated = u.reshape(-1, H * D)[rows] * self.attention_norm(attended[rows])
        return x[rows] + self.dropout(self.output(gated))
