"""HSTU attention for a whole batch in a fixed number of torch ops: the CPU path and the reference.

It walks the (query block, key block) pairs of a `BlockSchedule` (model/attention/plan.py) in
chunks: gather the blocks' queries and keys, score, mask, multiply by the values, and add each
block's output into its query rows. The op count depends on the number of chunks (the batch's
total work), never on the number of users, and nothing is read back from the device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

MAX_SCORE_ELEMENTS = 1 << 25  # per chunk: bounds the [pairs, H, QB, KB] score tensor (128 MiB in fp32)


def blocked_hstu_attention(
    q: Tensor,  # [T, H, D] every row of the batch: history rows, then candidate rows
    k: Tensor,  # [T, H, D]
    v: Tensor,  # [T, H, D]
    keys: Tensor,  # [R, H, D] rows the schedule's key_rows index (the KV pages, or k itself)
    values: Tensor,  # [R, H, D]
    schedule: dict[str, Tensor],  # query_rows, query_key_end, key_rows, key_positions on q's device
    num_pairs: int,
    num_history_rows: int,
    alpha: float,
    normalizer: float,
) -> Tensor:
    """-> [T, H, D]: rows the schedule covers hold their attention output (others are 0)."""
    T, H, D = q.shape
    acc_dtype = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
    q_padded = torch.cat([q, q.new_zeros(1, H, D)])  # row T: what padding query slots read
    out = torch.zeros(T + 1, H, D, dtype=acc_dtype, device=q.device)
    query_block, key_block = schedule["query_rows"].shape[1], schedule["key_rows"].shape[1]
    pairs_per_chunk = max(1, MAX_SCORE_ELEMENTS // (H * query_block * key_block))
    grad = torch.is_grad_enabled()
    for first in range(0, num_pairs, pairs_per_chunk):
        chunk = slice(first, first + pairs_per_chunk)
        query_rows = schedule["query_rows"][chunk]  # [p, QB]
        key_rows = schedule["key_rows"][chunk]  # [p, KB]
        q_blocks = q_padded[query_rows]  # [p, QB, H, D]
        k_blocks = keys[key_rows].to(q.dtype)  # [p, KB, H, D]
        v_blocks = values[key_rows].to(q.dtype)
        scores = F.silu(torch.einsum("pqhd,pkhd->phqk", q_blocks, k_blocks) * alpha, inplace=not grad)
        seen = schedule["key_positions"][chunk][:, None, :] < schedule["query_key_end"][chunk][:, :, None]  # [p, QB, KB]
        scores = scores.masked_fill(~seen[:, None], 0.0) if grad else scores.masked_fill_(~seen[:, None], 0.0)
        block_out = torch.einsum("phqk,pkhd->pqhd", scores, v_blocks)  # [p, QB, H, D]
        out = out.index_add(0, query_rows.reshape(-1), block_out.reshape(-1, H, D).to(acc_dtype))
    out = out[:T]
    # M-FALCON: each candidate also sees itself, and no other candidate (never in the key rows).
    q_c, k_c, v_c = q[num_history_rows:], k[num_history_rows:], v[num_history_rows:]
    self_score = F.silu(alpha * (q_c * k_c).sum(-1, keepdim=True))  # [M, H, 1]
    out = torch.cat([out[:num_history_rows], out[num_history_rows:] + (self_score * v_c).to(acc_dtype)])
    return (out / normalizer).to(q.dtype)
