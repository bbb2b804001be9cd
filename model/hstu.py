"""The HSTU layer and its attention, on jagged tokens.

    x̂ = LN(x);   u, v, q, k = split(SiLU(x̂ W + b))
    A_ij = SiLU(α q_i·k_j) / N        α = 1/sqrt(head_dim), N = config.max_seq_len (fixed)
    out  = x + W_o(u ⊙ LN(A V))

Every user's tokens are its *history* tokens (prefix + events, causal, and the only ones
written to the KV cache) and its *candidates* (M-FALCON: each sees all history and
itself, never another candidate; history never sees candidates). A layer projects only
the tokens computed in this visit; the keys and values of the user's whole window come
from a `KVStore`: the paged KV cache when serving incrementally, or just the tokens
themselves when nothing is cached (full recompute). One code path serves both.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from data.jagged import offsets_from_lengths
from model.config import HSTUConfig

QUERY_TILE = 1024  # history queries per attention tile: bounds memory, skips fully masked keys


class KVStore(Protocol):
    """Where a layer's history K/V go, and where the whole window's K/V come from."""

    def store_and_load(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New history K/V [sum new, H, D] -> window K/V [sum (cached + new), H, D]."""
        ...


@dataclass(frozen=True)
class AttentionPlan:
    """Per-user jagged extents, as Python ints (read once per forward, used by every layer)."""

    history_offsets: list[int]  # [B + 1] into the computed history tokens
    candidate_offsets: list[int]  # [B + 1] into the candidates
    window_offsets: list[int]  # [B + 1] into the window K/V returned by the KVStore
    cached_lengths: list[int]  # [B] window tokens that precede the computed ones

    @property
    def batch_size(self) -> int:
        return len(self.cached_lengths)

    @classmethod
    def from_lengths(
        cls,
        history_lengths: torch.Tensor,  # [B] tokens computed now
        candidate_lengths: torch.Tensor,  # [B]
        window_lengths: torch.Tensor,  # [B] tokens the KVStore returns (cached + computed)
        cached_lengths: torch.Tensor | None,  # [B]; None: nothing cached
    ) -> AttentionPlan:
        cached = [0] * history_lengths.numel() if cached_lengths is None else cached_lengths.tolist()
        return cls(
            history_offsets=offsets_from_lengths(history_lengths).tolist(),
            candidate_offsets=offsets_from_lengths(candidate_lengths).tolist(),
            window_offsets=offsets_from_lengths(window_lengths).tolist(),
            cached_lengths=cached,
        )


def hstu_attention(
    q_hist: torch.Tensor | None,  # [n, H, D] computed history queries (None: outputs not needed)
    q_cand: torch.Tensor,  # [m, H, D]
    k_cand: torch.Tensor,  # [m, H, D]
    v_cand: torch.Tensor,  # [m, H, D]
    k_window: torch.Tensor,  # [c + n, H, D] the window's keys, the last n being the computed ones
    v_window: torch.Tensor,  # [c + n, H, D]
    num_cached: int,  # c
    alpha: float,
    normalizer: float,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One user's HSTU attention. -> (history outputs [n, H, D] or None, candidate outputs [m, H, D]).

    History queries run in tiles of QUERY_TILE rows, each against the keys up to its last
    query (only its diagonal block needs masking); the candidates ride along with the last
    tile, which sees every key, so a visit with few new events costs one matmul pair.
    """
    n = 0 if q_hist is None else q_hist.shape[0]
    m = q_cand.shape[0]
    window = k_window.shape[0]
    k_t = k_window.permute(1, 2, 0)  # [H, D, T]
    v_h = v_window.transpose(0, 1)  # [H, T, D]
    q = (torch.cat([q_hist, q_cand]) if n else q_cand).transpose(0, 1) * alpha  # [H, n + m, D]
    tile_starts = list(range(0, n, QUERY_TILE)) or [0]
    outputs = []
    for i, r0 in enumerate(tile_starts):
        last = i == len(tile_starts) - 1
        r1 = n + m if last else r0 + QUERY_TILE
        key_end = window if last else num_cached + r1  # later keys are masked for every row
        scores = _silu(torch.matmul(q[:, r0:r1], k_t[:, :, :key_end]))  # [H, r, key_end]
        h1 = min(r1, n)  # rows r0..h1 are history queries: query i sees key j <= i
        if h1 > r0:
            diagonal = scores[:, : h1 - r0, num_cached + r0 : num_cached + h1]  # [H, h, h]
            diagonal.masked_fill_(_strictly_upper(h1 - r0, scores.device), 0.0)
        outputs.append(torch.matmul(scores, v_h[:, :key_end]))  # [H, r, D]
    out = torch.cat(outputs, 1).transpose(0, 1)  # [n + m, H, D]
    self_score = F.silu(alpha * (q_cand * k_cand).sum(-1, keepdim=True))  # [m, H, 1]
    out_cand = (out[n:] + self_score * v_cand) / normalizer
    return (out[:n] / normalizer if q_hist is not None else None), out_cand


def _silu(scores: torch.Tensor) -> torch.Tensor:
    """SiLU of a fresh score matrix, in place when no gradient needs its input."""
    return F.silu(scores, inplace=not torch.is_grad_enabled())


_MASKS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _strictly_upper(size: int, device: torch.device) -> torch.Tensor:
    key = (size, device)
    if key not in _MASKS:
        with torch.inference_mode(False):  # cached across calls: must stay usable by autograd
            _MASKS[key] = torch.ones(size, size, dtype=torch.bool, device=device).triu(1)
    return _MASKS[key]


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

    def forward(
        self,
        x_hist: torch.Tensor,  # [sum n, d]
        x_cand: torch.Tensor,  # [M, d]
        plan: AttentionPlan,
        kv: KVStore,
        history_outputs_needed: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (x_hist', x_cand'). With history_outputs_needed=False (the last layer) only the
        history K/V are produced; the history rows come back unchanged."""
        n_hist = x_hist.shape[0]
        H, D = self.num_heads, self.head_dim
        uvqk = F.silu(self.uvqk(self.input_norm(torch.cat([x_hist, x_cand]))))  # [n + M, 4 H D]
        u, v, q, k = (t.reshape(-1, H, D) for t in uvqk.chunk(4, dim=-1))  # each [n + M, H, D]
        k_window, v_window = kv.store_and_load(self.index, k[:n_hist], v[:n_hist])

        hist_out, cand_out = [], []
        for b in range(plan.batch_size):
            h0, h1 = plan.history_offsets[b], plan.history_offsets[b + 1]
            c0, c1 = n_hist + plan.candidate_offsets[b], n_hist + plan.candidate_offsets[b + 1]
            w0, w1 = plan.window_offsets[b], plan.window_offsets[b + 1]
            out_h, out_c = hstu_attention(
                q[h0:h1] if history_outputs_needed else None,
                q[c0:c1], k[c0:c1], v[c0:c1],
                k_window[w0:w1], v_window[w0:w1],
                num_cached=plan.cached_lengths[b], alpha=self.alpha, normalizer=self.normalizer,
            )
            if out_h is not None:
                hist_out.append(out_h)
            cand_out.append(out_c)

        if history_outputs_needed:
            attended, rows, residual = torch.cat(hist_out + cand_out), slice(None), torch.cat([x_hist, x_cand])
        else:
            attended, rows, residual = torch.cat(cand_out), slice(n_hist, None), x_cand
        attended = attended.reshape(attended.shape[0], H * D)  # [rows, H D]
        out = residual + self.dropout(self.output(u.reshape(-1, H * D)[rows] * self.attention_norm(attended)))
        if history_outputs_needed:
            return out[:n_hist], out[n_hist:]
        return x_hist, out
