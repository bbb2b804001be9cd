"""HSTU attention for a whole batch in a fixed number of torch ops: the CPU path and the reference.

It walks the (query block, key block) pairs of a `BlockSchedule` (model/attention/blocked_schedule.py) in
chunks: gather the blocks' queries and keys, score, mask, multiply by the values, and add each
block's output into its query rows. The op count depends on the number of chunks (the batch's
total work), never on the number of users, and nothing is read back from the device.

With a relative bias (model/attention/relative_bias.py), each pair's scores get the bias of its
(query, key) distances: the bucket index of every pair is computed once per forward, by the first
layer, and every layer then gathers its own table's rows with it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from model.attention.base import KeyWindow
from model.attention.relative_bias import BiasInputs, RelativeAttentionBias

MAX_SCORE_ELEMENTS = 1 << 22  # per chunk: the [pairs, H, QB, KB] scores stay near the cache (16 MiB in fp32)


def blocked_hstu_attention(
    q: Tensor,  # [T, H, D] every row of the batch: history rows, then candidate rows
    k: Tensor,  # [T, H, D]
    v: Tensor,  # [T, H, D]
    keys: Tensor,  # [R, H, D] rows the schedule's key_rows index (the KV pages, or k itself)
    values: Tensor,  # [R, H, D]
    schedule: dict[str, Tensor],  # the BlockSchedule's arrays on q's device
    num_blocks: int,
    num_pairs: int,
    num_history_rows: int,
    alpha: float,
    normalizer: float,
    bias: RelativeAttentionBias | None = None,
    bias_inputs: BiasInputs | None = None,
    schedule_name: str = "",
    key_window: KeyWindow | None = None,
) -> Tensor:
    """-> [T, H, D]: rows the schedule covers hold their attention output (others are 0).

    Pairs are gathered and multiplied in chunks; each pair's output is added into its query
    block (a few large slices), and every row then gathers its output from its block.
    `schedule_name` names the schedule in `bias_inputs`' per-forward cache of bucket indices.
    With `key_window` a row also skips the keys before its block_key_start, but the window's sink.
    """
    _, H, D = q.shape
    acc_dtype = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
    query_block, key_block = schedule["block_rows"].shape[1], schedule["key_rows"].shape[1]
    # α is applied to the queries, [T, H, D], rather than to every [QB, KB] score tile (4x the elements at D = 128).
    q_padded = torch.cat([q * alpha, q.new_zeros(1, H, D)])  # row T: what padding query slots read
    q_blocks = q_padded.index_select(0, schedule["block_rows"].reshape(-1)).view(num_blocks, query_block, H, D)
    grad = torch.is_grad_enabled()
    q_blocks = q_blocks.permute(2, 0, 1, 3)  # [H, Q, QB, D]
    q_blocks = q_blocks.contiguous() if not grad and q.device.type == "cpu" else q_blocks
    block_out = torch.zeros(H, num_blocks, query_block, D, dtype=acc_dtype, device=q.device)
    pairs_per_chunk = max(1, MAX_SCORE_ELEMENTS // (H * query_block * key_block))
    # [H, P * (T + 1)]: gathering along dim 1 gives each head's [p, QB, KB] scores contiguous, as the
    # head-major scores are laid out (the [pairs, H] layout made the add strided).
    table = bias.pair_table().t().contiguous().to(q.dtype) if bias is not None else None
    for first in range(0, num_pairs, pairs_per_chunk):
        chunk = slice(first, first + pairs_per_chunk)
        blocks = schedule["pair_blocks"][chunk]  # [p]
        key_rows = schedule["key_rows"][chunk].reshape(-1)
        p = len(key_rows) // key_block
        k_pairs = keys.index_select(0, key_rows).view(p, key_block, H, D).to(q.dtype)  # [p, KB, H, D]
        v_pairs = values.index_select(0, key_rows).view(p, key_block, H, D).to(q.dtype)
        scores = _per_head_matmul(q_blocks.index_select(1, blocks), k_pairs, keys_side=True)  # [H, p, QB, KB], α included
        if table is not None:
            index = _pair_index(bias, bias_inputs, schedule, schedule_name, chunk, blocks, key_rows)  # [p, QB, KB]
            pair_bias = table.index_select(1, index.view(-1)).view(H, p, query_block, key_block)
            scores = scores + pair_bias if grad else scores.add_(pair_bias)
        scores = F.silu(scores, inplace=not grad)
        key_end = schedule["block_key_end"].index_select(0, blocks)  # [p, QB]
        key_positions = schedule["key_positions"][chunk][:, None, :]  # [p, 1, KB]
        hidden = key_positions >= key_end[:, :, None]  # [p, QB, KB]
        if key_window is not None:  # sliding window: also the keys before each row's window start
            key_start = schedule["block_key_start"].index_select(0, blocks)[:, :, None]
            hidden = hidden | ((key_positions < key_start) & (key_positions >= key_window.sink))
        scores = scores.masked_fill(hidden, 0.0) if grad else scores.masked_fill_(hidden, 0.0)  # [p, QB, KB] per head
        pair_out = _per_head_matmul(scores, v_pairs, keys_side=False).to(acc_dtype)  # [H, p, QB, D]
        block_out = block_out.index_add(1, blocks, pair_out) if grad else block_out.index_add_(1, blocks, pair_out)
    slots = block_out.permute(1, 2, 0, 3).reshape(num_blocks * query_block, H, D)
    slots = torch.cat([slots, slots.new_zeros(1, H, D)])  # the slot of rows no block covers
    out = slots.index_select(0, schedule["row_source"])  # [T, H, D]
    # M-FALCON: each candidate also sees itself, and no other candidate (never in the key rows).
    q_c, k_c, v_c = q[num_history_rows:], k[num_history_rows:], v[num_history_rows:]
    self_logit = alpha * (q_c * k_c).sum(-1, keepdim=True)  # [M, H, 1]
    if bias is not None:
        self_logit = self_logit + bias.self_bias().to(q.dtype)[:, None]
    self_score = F.silu(self_logit)
    out = torch.cat([out[:num_history_rows], out[num_history_rows:] + (self_score * v_c).to(acc_dtype)])
    return (out / normalizer).to(q.dtype)


def _per_head_matmul(a: Tensor, rows: Tensor, keys_side: bool) -> Tensor:
    """a [H, p, M, X] times each head's tile of rows [p, KB, H, D]: -> [H, p, M, KB] (keys_side: a @ tile^T,
    the scores) or [H, p, M, D] (a @ tile, the values' sum).

    Without autograd, one bmm per head reads its tiles where the gather left them: a head's [KB, D]
    tile is a strided matrix BLAS takes as is (rows H * D apart), and each head's result fills a
    contiguous slice of the output. A single matmul over [p, H] batches would first copy every
    gathered key and value tile into batch-contiguous order (a third of the cached path's time on
    CPU). Autograd takes no `out=`, so training runs that single matmul, and so does a GPU, where one
    launch beats H (the Triton backend is what serves there).
    """
    tiles = rows.permute(0, 2, 3, 1) if keys_side else rows.transpose(1, 2)  # [p, H, D, KB] / [p, H, KB, D]
    if torch.is_grad_enabled() or a.device.type != "cpu":
        return torch.matmul(a.transpose(0, 1), tiles).transpose(0, 1)
    heads, p, m = a.shape[:3]
    out = a.new_empty(heads, p, m, tiles.shape[-1])
    for head in range(heads):
        torch.bmm(a[head], tiles[:, head], out=out[head])
    return out


def _pair_index(bias: RelativeAttentionBias, inputs: BiasInputs, schedule: dict[str, Tensor], schedule_name: str,
                chunk: slice, blocks: Tensor, key_rows: Tensor) -> Tensor:
    """The chunk's [p, QB, KB] rows of the pair table: computed by the forward's first layer, reused by the others."""
    key = (schedule_name, chunk.start)
    index = inputs.pair_index_cache.get(key)
    if index is None:
        p, query_block = len(blocks), schedule["block_rows"].shape[1]
        query_rows = schedule["block_rows"].index_select(0, blocks).view(-1)
        query_stamps = inputs.query_stamps.index_select(0, query_rows).view(p, query_block, 1)
        key_stamps = inputs.key_stamps.index_select(0, key_rows).view(p, 1, -1)
        query_positions = schedule["block_query_positions"].index_select(0, blocks)[:, :, None]
        key_positions = schedule["key_positions"][chunk][:, None, :]
        index = bias.pair_index(query_positions, key_positions, query_stamps, key_stamps)
        inputs.pair_index_cache[key] = index
    return index
