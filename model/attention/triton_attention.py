"""HSTU attention for a whole batch in one Triton launch per layer, reading K/V from the page pool.

Grid: (query tile, head, key split). A query tile is BLOCK_M consecutive rows of one user's
query sequence [new history rows | candidates] (`tile_users`, `tile_rows`, planned on the host).
It walks its user's keys BLOCK_N at a time, finding key j at

    paged:       page_indices[page_indptr[b] + j // PAGE] * PAGE + j % PAGE   (rows of the pool)
    contiguous:  history_offsets[b] + j                                       (rows of k/v)

so the window is never gathered into a new tensor. Scores SiLU(α q·k) are masked in registers
(history row i sees j <= c_b + i; a candidate sees j < c_b + n_b) and never written to memory;
the candidate's own key/value (M-FALCON: itself, no other candidate) is added by the tile.
Accumulation is in fp32. The key range stops at the tile's last row's key end, so blocks
above the causal diagonal are never visited; with a key window (base.KeyWindow) it starts at the
tile's first row's window start, visiting the sink's blocks (the contextual prefix) before it.

With a relative bias (model/attention/relative_bias.py) the tile computes each score's position
and time buckets, and whether query and key share a tag, in registers, from the key's window
position and its stamp (time and tag, read beside the key: the page pool's per-slot word, or the
batch's rows), and adds the bias read from the layer's small tables: no [queries x keys] bias is
ever written to memory.

HSTU has no softmax, so a long key range can be split across programs (`num_splits`) whose
partial outputs simply add: with few users (batch 1) this keeps every SM busy. Partials go
to an fp32 buffer [splits, T, H, D] summed afterwards in one op, so results do not depend on
the order programs finish in (no atomics).

What varies from batch to batch (the split count, where the candidate rows start) is a runtime
argument that Triton is told not to specialise on, so serving compiles the kernel once per
model (head_dim, dtype, page size, bias tables) and never in the middle of a batch: the
constexprs are exactly `kernel_constants(...)`, which the sm90 compile check
(model/kernel_compile.py) compiles ahead of time.

Everything the kernel reads comes in as device tensors and every grid size is a host int from
the plan, so the launch has no host sync and is captured by a CUDA graph as is. Without CUDA the
tests run the kernel on CPU through Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before triton is first imported: Triton decides at import and decoration
time whether it compiles or interprets).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from model.attention import relative_bias, token_stamp
from model.attention.base import KeyWindow
from model.attention.relative_bias import BiasInputs, RelativeAttentionBias

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install may lack triton; the torch path serves then
    triton = None

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
BLOCK_M = 64  # query rows per tile
BLOCK_N = 64  # keys per step
MAX_SPLITS = 16
TARGET_PROGRAMS_PER_SM = 2
NO_KEY_WINDOW = 1 << 30  # the key window size that stands for none: beyond every window's length


def available() -> bool:
    return triton is not None


def tile_schedule(query_lengths: np.ndarray, first_row: np.ndarray, capacity: int | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Query tiles of BLOCK_M rows covering rows first_row[b] .. query_lengths[b] - 1 of each user b.

    -> (tile_users, tile_rows) int32 [capacity]; unused entries have user -1 (the program exits).
    """
    rows = np.maximum(np.asarray(query_lengths, np.int64) - first_row, 0)
    tiles = -(-rows // BLOCK_M)
    users = np.repeat(np.arange(len(rows), dtype=np.int64), tiles)
    ranks = np.arange(len(users), dtype=np.int64) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    starts = first_row[users] + ranks * BLOCK_M
    capacity = len(users) if capacity is None else capacity
    if len(users) > capacity:
        raise ValueError(f"{len(users)} query tiles do not fit the plan's capacity of {capacity}")
    pad = capacity - len(users)
    return (np.pad(users, (0, pad), constant_values=-1).astype(np.int32),
            np.pad(starts, (0, pad)).astype(np.int32))


def allowed_splits() -> tuple[int, ...]:
    """Every split count `split_count` may choose."""
    return tuple(1 << i for i in range(MAX_SPLITS.bit_length()))


def tile_capacity(num_rows: int, num_users: int) -> int:
    """Most query tiles a batch of these row and user capacities can need."""
    return -(-num_rows // BLOCK_M) + num_users


def split_count(num_tiles: int, num_heads: int, max_keys: int, num_sms: int) -> int:
    """A power of two in [1, MAX_SPLITS]: the programs' wish rounded up, then held to the key blocks.

    The split count is a runtime argument of the kernel (no compile per value); powers of two keep the
    grid's third dimension to log2(MAX_SPLITS) + 1 sizes, and the partial-sum buffer to as many shapes.
    """
    wanted = -(-TARGET_PROGRAMS_PER_SM * num_sms // max(1, num_tiles * num_heads))
    limit = max(1, min(MAX_SPLITS, -(-max_keys // BLOCK_N)))
    splits = min(1 << max(0, wanted - 1).bit_length(), limit)
    return 1 << (splits.bit_length() - 1)


if triton is not None:
    # The bias's constants, as the constexprs a kernel may read (relative_bias.log_bucket's, per subdivision s:
    # the mantissa shift 23 - s, the exact range 2^s, and the offset (126 + s) 2^s).
    EXACT_FLOAT_LIMIT = tl.constexpr(relative_bias.EXACT_FLOAT_LIMIT)
    MS_PER_SECOND = tl.constexpr(relative_bias.MS_PER_SECOND)
    NO_TIME = tl.constexpr(relative_bias.NO_TIME)
    STAMP_TIME_BITS = tl.constexpr(token_stamp.STAMP_TIME_BITS)
    STAMP_TIME_MASK = tl.constexpr(token_stamp.STAMP_TIME_MASK)
    _P, _T = relative_bias.POSITION_SUBDIVISION, relative_bias.TIME_SUBDIVISION
    POSITION_SHIFT, POSITION_EXACT, POSITION_OFFSET = (tl.constexpr(23 - _P), tl.constexpr(1 << _P),
                                                       tl.constexpr((126 + _P) << _P))
    TIME_SHIFT, TIME_EXACT, TIME_OFFSET = tl.constexpr(23 - _T), tl.constexpr(1 << _T), tl.constexpr((126 + _T) << _T)

    @triton.jit
    def _log_bucket(distance, SHIFT: tl.constexpr, EXACT: tl.constexpr, OFFSET: tl.constexpr, NUM_BUCKETS: tl.constexpr):
        """relative_bias.log_bucket, on int64 distances in registers."""
        d = tl.minimum(tl.maximum(distance, 0), EXACT_FLOAT_LIMIT)
        mantissa_bits = d.to(tl.int32).to(tl.float32).to(tl.int32, bitcast=True) >> SHIFT
        logarithmic = mantissa_bits.to(tl.int64) - OFFSET
        return tl.minimum(tl.where(d < EXACT, d, logarithmic), NUM_BUCKETS - 1)

    # num_splits and history_rows change from batch to batch: specialising on them (Triton does for ints
    # equal to 1 or divisible by 16) would compile new variants while serving.
    @triton.jit(do_not_specialize=["num_splits", "history_rows", "key_window", "key_sink"])
    def _hstu_attention_kernel(
        Q, K, V, KEYS, VALUES, OUT,
        history_offsets, candidate_offsets, cached_lengths, page_indptr, page_indices, tile_users, tile_rows,
        QUERY_STAMPS, KEY_STAMPS, POSITION_BIAS, TIME_BIAS, TAG_BIAS,
        history_rows, num_splits, key_window, key_sink, alpha, inv_normalizer,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_keys_t, stride_keys_h, stride_values_t, stride_values_h,
        stride_os, stride_ot, stride_oh,
        PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        POSITION_BUCKETS: tl.constexpr, TIME_BUCKETS: tl.constexpr, TAG_MATCH: tl.constexpr,
    ):
        tile, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        user = tl.load(tile_users + tile)
        if user < 0:
            return
        row0 = tl.load(tile_rows + tile)
        hist0 = tl.load(history_offsets + user)
        n = tl.load(history_offsets + user + 1) - hist0
        cand0 = tl.load(candidate_offsets + user)
        m = tl.load(candidate_offsets + user + 1) - cand0
        c = tl.load(cached_lengths + user)
        window = c + n

        rows = row0 + tl.arange(0, BM)  # rows of the user's query sequence
        valid_row = rows < n + m
        is_history = rows < n
        q_rows = tl.where(is_history, hist0 + rows, history_rows + cand0 + rows - n)
        key_end = tl.where(is_history, c + rows + 1, window)  # keys j < key_end are seen
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + q_rows[:, None] * stride_qt + head * stride_qh + dims[None, :],
                    mask=valid_row[:, None], other=0.0)
        query_positions = tl.where(is_history, c + rows, window)
        if TIME_BUCKETS > 0 or TAG_MATCH:  # token_stamp's packing: the tag row above the time's bits
            query_stamps = tl.load(QUERY_STAMPS + q_rows, mask=valid_row, other=NO_TIME)
        if TIME_BUCKETS > 0:
            query_times = tl.where(query_stamps < 0, NO_TIME, query_stamps & STAMP_TIME_MASK)
        if TAG_MATCH:
            query_tags = query_stamps >> STAMP_TIME_BITS

        last = tl.minimum(row0 + BM, n + m) - 1
        tile_keys = tl.where(last < n, c + last + 1, window)
        blocks = tl.cdiv(tile_keys, BN)
        # The blocks visited: the sink's, then those from the first row's window start (0 without a window).
        tile_start = tl.maximum(tl.where(row0 < n, c + row0 + 1, window) - key_window, 0)
        start_block = tl.minimum(tile_start // BN, blocks)
        sink_blocks = tl.minimum(tl.cdiv(key_sink, BN), start_block)
        visits = sink_blocks + blocks - start_block
        per_split = tl.cdiv(visits, num_splits)
        first_visit = split * per_split
        last_visit = tl.minimum(visits, first_visit + per_split)

        acc = tl.zeros((BM, HEAD_DIM), dtype=tl.float32)
        for visit in range(first_visit, last_visit):
            block = visit + (visit >= sink_blocks).to(tl.int32) * (start_block - sink_blocks)
            keys = block * BN + tl.arange(0, BN)
            valid_key = keys < window
            if PAGE_SIZE > 0:
                page = tl.load(page_indices + tl.load(page_indptr + user) + keys // PAGE_SIZE, mask=valid_key, other=0)
                key_rows = page.to(tl.int64) * PAGE_SIZE + keys % PAGE_SIZE
            else:
                key_rows = (hist0 + keys).to(tl.int64)
            k = tl.load(KEYS + key_rows[:, None] * stride_keys_t + head * stride_keys_h + dims[None, :],
                        mask=valid_key[:, None], other=0.0)
            if UPCAST:
                scores = tl.dot(q.to(tl.float32), tl.trans(k).to(tl.float32), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k).to(q.dtype), input_precision=PRECISION)
            scores = scores * alpha  # [BM, BN] fp32
            if POSITION_BUCKETS > 0:
                bucket = _log_bucket(query_positions[:, None] - keys[None, :], POSITION_SHIFT, POSITION_EXACT,
                                     POSITION_OFFSET, POSITION_BUCKETS)
                scores += tl.load(POSITION_BIAS + head * POSITION_BUCKETS + bucket)
            if TIME_BUCKETS > 0 or TAG_MATCH:
                key_stamps = tl.load(KEY_STAMPS + key_rows, mask=valid_key, other=NO_TIME)
            if TIME_BUCKETS > 0:
                key_times = tl.where(key_stamps < 0, NO_TIME, key_stamps & STAMP_TIME_MASK)
                seconds = tl.maximum(query_times[:, None] - key_times[None, :], 0) // MS_PER_SECOND
                bucket = _log_bucket(seconds, TIME_SHIFT, TIME_EXACT, TIME_OFFSET, TIME_BUCKETS)
                bucket = tl.where((query_times[:, None] < 0) | (key_times[None, :] < 0), TIME_BUCKETS, bucket)
                scores += tl.load(TIME_BIAS + head * (TIME_BUCKETS + 1) + bucket)
            if TAG_MATCH:
                same_tag = (query_tags[:, None] == (key_stamps >> STAMP_TIME_BITS)[None, :]) & (query_tags[:, None] > 0)
                scores += tl.where(same_tag, tl.load(TAG_BIAS + head), 0.0)
            scores = scores * tl.sigmoid(scores)
            seen = (keys[None, :] < key_end[:, None]) & ((keys[None, :] >= key_end[:, None] - key_window)
                                                        | (keys[None, :] < key_sink))
            scores = tl.where(seen, scores, 0.0)
            v = tl.load(VALUES + key_rows[:, None] * stride_values_t + head * stride_values_h + dims[None, :],
                        mask=valid_key[:, None], other=0.0)
            if UPCAST:
                acc += tl.dot(scores.to(q.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(scores.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)

        if split == 0:  # a candidate also sees itself
            own = valid_row & ~is_history
            k_own = tl.load(K + q_rows[:, None] * stride_kt + head * stride_kh + dims[None, :],
                            mask=own[:, None], other=0.0).to(tl.float32)
            v_own = tl.load(V + q_rows[:, None] * stride_vt + head * stride_vh + dims[None, :],
                            mask=own[:, None], other=0.0).to(tl.float32)
            self_score = tl.sum(q.to(tl.float32) * k_own, axis=1) * alpha
            if POSITION_BUCKETS > 0:  # distance 0
                self_score += tl.load(POSITION_BIAS + head * POSITION_BUCKETS)
            if TIME_BUCKETS > 0:  # 0 seconds
                self_score += tl.load(TIME_BIAS + head * (TIME_BUCKETS + 1))
            self_score = self_score * tl.sigmoid(self_score)
            acc += self_score[:, None] * v_own

        out = OUT + split * stride_os + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :]
        tl.store(out, acc * inv_normalizer, mask=valid_row[:, None])


@dataclass(frozen=True)
class KernelConstants:
    """The kernel's compile-time constants: one compiled variant per distinct value."""

    page_size: int  # 0: contiguous keys
    head_dim: int
    precision: str  # tl.dot's input precision: "ieee" (fp32 parity needs full-precision dots) or "tf32"
    upcast: bool  # dots in fp32 from bf16/fp16 inputs (Triton's interpreter has no bf16/fp16 dot)
    position_buckets: int  # 0: no position bias
    time_buckets: int  # 0: no time bias
    tag_match: bool = False
    num_warps: int = 4
    num_stages: int = 2

    def constexprs(self) -> dict[str, object]:
        return dict(PAGE_SIZE=self.page_size, HEAD_DIM=self.head_dim, BM=BLOCK_M, BN=BLOCK_N,
                    PRECISION=self.precision, UPCAST=self.upcast,
                    POSITION_BUCKETS=self.position_buckets, TIME_BUCKETS=self.time_buckets, TAG_MATCH=self.tag_match)


def kernel_constants(page_size: int, head_dim: int, dtype: torch.dtype, position_buckets: int, time_buckets: int,
                     tag_match: bool = False, interpreted: bool = _INTERPRETED) -> KernelConstants:
    """The constants a launch with these inputs compiles (`interpreted`: under TRITON_INTERPRET)."""
    return KernelConstants(page_size, head_dim, "ieee" if dtype == torch.float32 else "tf32",
                           interpreted and dtype != torch.float32, position_buckets, time_buckets, tag_match)


def triton_hstu_attention(
    q: Tensor,  # [T, H, D] (rows may be strided; the last dim contiguous)
    k: Tensor,
    v: Tensor,
    keys: Tensor,  # [R, H, D] the page pool's rows (paged) or k itself (contiguous)
    values: Tensor,
    arrays: Mapping[str, Tensor],  # int32: history_offsets, candidate_offsets, cached_lengths, page_indptr,
    #                                page_indices, tile_users, tile_rows
    history_rows: int,  # candidate rows start here
    page_size: int,  # 0: contiguous keys
    splits: int,
    alpha: float,
    normalizer: float,
    bias: RelativeAttentionBias | None = None,
    bias_inputs: BiasInputs | None = None,
    key_window: KeyWindow | None = None,
) -> Tensor:
    """-> [T, H, D] in q's dtype; rows no tile covers are 0."""
    T, H, D = q.shape
    tiles = arrays["tile_users"].shape[0]
    position_buckets = bias.num_position_buckets if bias is not None else 0
    time_buckets = bias.num_time_buckets if bias is not None else 0
    # Tables as fp32 the kernel adds to its fp32 scores; tensors it never reads (no bias) stand in for absent ones.
    position_bias = bias.position.float().contiguous() if position_buckets else q
    time_bias = bias.time.float().contiguous() if time_buckets else q
    tag_match = bias is not None and bias.tag_match is not None
    tag_bias = bias.tag_match.float().contiguous() if tag_match else q
    stamped = time_buckets or tag_match
    query_stamps = bias_inputs.query_stamps if stamped else arrays["tile_rows"]
    key_stamps = bias_inputs.key_stamps if stamped else arrays["tile_rows"]
    # Partial sums [splits, T, H, D] in fp32 whatever the split count: one output type, so one compiled
    # variant serves every split (bf16 at one split pays a cast of the output, not a compile).
    out = torch.zeros((splits, T, H, D), dtype=torch.float32, device=q.device)
    constants = kernel_constants(page_size, D, q.dtype, position_buckets, time_buckets, tag_match)
    window_size, window_sink = (key_window.size, key_window.sink) if key_window else (NO_KEY_WINDOW, 0)
    if tiles:
        _hstu_attention_kernel[(tiles, H, splits)](
            q, k, v, keys, values, out,
            arrays["history_offsets"], arrays["candidate_offsets"], arrays["cached_lengths"],
            arrays["page_indptr"], arrays["page_indices"], arrays["tile_users"], arrays["tile_rows"],
            query_stamps, key_stamps, position_bias, time_bias, tag_bias,
            history_rows, splits, window_size, window_sink, alpha, 1.0 / normalizer,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            **constants.constexprs(), num_warps=constants.num_warps, num_stages=constants.num_stages,
        )
    return (out.sum(0) if splits > 1 else out[0]).to(q.dtype)
