"""Where every query and key of a batch lives, planned once per batch on the host (numpy).

Rows of the layer's q/k/v [T, H, D]: first the new history rows of every user (user b has n_b
at `history_offsets[b]`), then the candidate rows (m_b at `n_hist + candidate_offsets[b]`).
User b's keys are positions 0 .. L_b - 1 of its window, L_b = c_b + n_b: c_b cached tokens and
its new history tokens, read either from the paged KV cache (after the new ones were appended)
or, with nothing cached, straight from its history rows of k/v (contiguous).

Query i of user b's query sequence [history rows | candidates] sees keys j < key_end:
history row i sees j <= c_b + i (causal); every candidate sees the whole window, j < L_b
(plus itself, added by the kernels; never another candidate). A training batch whose targets are
drawn from the history gives each candidate its own key end instead (`candidate_key_ends`: the
target's own window position, so it sees only the events before it; blocked backend only).

Two backends read a plan. `blocked` (torch, the CPU path and the reference) gets
(query block, key block) pairs: a pair exists only if some query of the block sees some key
of the block, so masked-out blocks above the diagonal are never visited. `triton` (CUDA) gets
query tiles and int32 per-user extents and page tables; its kernel walks the keys itself.
Either has a schedule for all query rows and one for candidates only (the last layer needs
no history outputs). In a bucketed shape every array has a fixed length: padding users have
no rows, padding tiles belong to user -1.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.jagged import offsets, row_ids_and_ranks
from model.batch_shape import BatchShape

QUERY_BLOCKS = (32, 64, 128, 256)  # the blocked path picks one per schedule (`query_block_for`)
KEY_BLOCK = 512
# What a small query block costs beyond its padded work: more, smaller matmuls and pairs. A block
# of qb rows is charged as qb + SMALL_BLOCK_COST rows.
SMALL_BLOCK_COST = 16
NO_KEY = np.iinfo(np.int64).max  # key position of a padding slot: above every query's key_end


@dataclass(frozen=True)
class KeyAddressing:
    """How key position j of user b maps to a row of the key/value tensor attention reads."""

    page_size: int  # 0: contiguous (key j of user b is history row history_offsets[b] + j)
    page_indptr: np.ndarray | None = None  # [B + 1] paged: user b's pages are page_indices[indptr[b]:indptr[b+1]]
    page_indices: np.ndarray | None = None  # [sum pages]

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    def rows(self, user: np.ndarray, pos: np.ndarray, history_offsets: np.ndarray) -> np.ndarray:
        """Key rows of positions `pos` of users `user` (same shape); positions must be valid."""
        if not self.paged:
            return history_offsets[user] + pos
        pages = self.page_indices[self.page_indptr[user] + pos // self.page_size]
        return pages.astype(np.int64) * self.page_size + pos % self.page_size


@dataclass(frozen=True)
class BlockSchedule:
    """Q query blocks of `query_block` rows and P (query block, key block) pairs ([..] int64).

    Every query row of the schedule lies in exactly one query block; `row_source` finds it there.
    """

    block_users: np.ndarray  # [Q] the user of each query block
    block_first_row: np.ndarray  # [Q] its first row in the user's query sequence [history | candidates]
    block_rows: np.ndarray  # [Q, query_block] row of q, or T (a padding row) past the block's end
    block_key_end: np.ndarray  # [Q, query_block] keys j < key_end are seen (0 for padding)
    block_query_positions: np.ndarray  # [Q, query_block] window position of the query (relative bias; 0 for padding)
    pair_blocks: np.ndarray  # [P] the query block of each pair (pairs of a block are consecutive)
    key_rows: np.ndarray  # [P, key_block] row of the key/value tensor (the user's key 0 for padding)
    key_positions: np.ndarray  # [P, key_block] key position j, NO_KEY for padding
    row_source: np.ndarray  # [T] slot (block * query_block + offset) holding each row; Q * query_block: none

    @property
    def num_blocks(self) -> int:
        return len(self.block_users)

    @property
    def num_pairs(self) -> int:
        return len(self.pair_blocks)


@dataclass(frozen=True)
class AttentionPlan:
    history_lengths: np.ndarray  # [B] n_b
    candidate_lengths: np.ndarray  # [B] m_b
    cached_lengths: np.ndarray  # [B] c_b
    history_offsets: np.ndarray  # [B + 1]
    candidate_offsets: np.ndarray  # [B + 1]
    addressing: KeyAddressing
    shape: BatchShape  # candidate rows start at shape.history_rows
    backend: str  # "blocked" or "triton"
    all_rows: BlockSchedule | None  # blocked backend
    candidate_rows: BlockSchedule | None
    triton_arrays: dict[str, np.ndarray] | None  # triton backend
    splits: int = 1  # triton: programs splitting each tile's key range

    @property
    def num_history_rows(self) -> int:
        return self.shape.history_rows

    @property
    def num_rows(self) -> int:
        return self.shape.num_rows


def plan_attention(
    history_lengths: np.ndarray,
    candidate_lengths: np.ndarray,
    cached_lengths: np.ndarray,
    addressing: KeyAddressing,
    shape: BatchShape | None = None,
    backend: str = "blocked",
    page_capacity: int | None = None,
    splits: int = 1,
    query_block: int | None = None,
    key_block: int | None = None,
    candidate_key_ends: np.ndarray | None = None,
) -> AttentionPlan:
    """`page_capacity` fixes the length of the triton page table (a bucket's bound); `splits` is
    the triton key split (see model/attention/triton_attention.py). `query_block` fixes the
    blocked path's query block (default: the cheapest for each schedule, `query_block_for`).
    `candidate_key_ends` [M] gives each candidate its own key end (in window positions, at most
    its user's window length; default: the window length)."""
    n = np.asarray(history_lengths, dtype=np.int64)
    m = np.asarray(candidate_lengths, dtype=np.int64)
    c = np.asarray(cached_lengths, dtype=np.int64)
    history_offsets, candidate_offsets = offsets(n), offsets(m)
    shape = shape or BatchShape.exact(len(n), int(history_offsets[-1]), int(candidate_offsets[-1]))
    common = (n, m, c, history_offsets, candidate_offsets, addressing, shape)
    if candidate_key_ends is not None:
        candidate_key_ends = np.asarray(candidate_key_ends, dtype=np.int64)
        window = np.repeat(c + n, m)
        if len(candidate_key_ends) != len(window) or np.any((candidate_key_ends < 0) | (candidate_key_ends > window)):
            raise ValueError(f"candidate_key_ends must hold one key end in [0, window length] per candidate ({len(window)})")
    if backend == "triton":
        if candidate_key_ends is not None:
            raise ValueError("per-candidate key ends (history targets, a training batch) need the blocked backend")
        return AttentionPlan(*common, backend, None, None, _triton_arrays(*common, page_capacity), splits)
    if backend != "blocked":
        raise ValueError(f"unknown attention backend {backend!r}; choose blocked or triton")
    schedule = _Scheduler(*common, key_block or KEY_BLOCK, candidate_key_ends)
    all_rows, candidate_rows = np.zeros_like(n), n
    return AttentionPlan(
        *common, backend,
        schedule.blocks(all_rows, query_block or query_block_for(n + m, c + n)),
        schedule.blocks(candidate_rows, query_block or query_block_for(m, c + n)),
        None,
    )


def query_block_for(query_rows: np.ndarray, keys: np.ndarray) -> int:
    """The query block of QUERY_BLOCKS with the least work for users with these query rows and keys.

    Rows are padded to whole blocks (a visit of 10 new events and 64 candidates leaves 71% of a
    256-row block empty) and smaller blocks cost more per row; full recompute of a long window
    pads little at any size and takes the larger blocks. Ties go to the larger block.

    >>> query_block_for(np.array([74, 74]), np.array([1000, 1500])), query_block_for(np.array([2112]), np.array([2048]))
    (128, 256)
    """
    rows, keys = np.asarray(query_rows, np.int64), np.maximum(np.asarray(keys, np.int64), 1)

    def work(qb: int) -> float:
        return float((-(-rows // qb) * keys).sum()) * (qb + SMALL_BLOCK_COST)

    return min(reversed(QUERY_BLOCKS), key=work)


def _triton_arrays(n, m, c, history_offsets, candidate_offsets, addressing, shape, page_capacity):
    from model.attention.triton_attention import tile_capacity, tile_schedule

    pad_users = shape.users - len(n)

    def padded(user_offsets: np.ndarray) -> np.ndarray:  # [B + 1] -> [users + 1]: padding users are empty
        return np.pad(user_offsets, (0, pad_users), mode="edge").astype(np.int32)

    if addressing.paged:
        indptr, indices = addressing.page_indptr, addressing.page_indices
    else:
        indptr, indices = np.zeros(len(n) + 1, np.int64), np.zeros(0, np.int64)
    capacity = max(1, len(indices) if page_capacity is None else page_capacity)
    if len(indices) > capacity:
        raise ValueError(f"{len(indices)} pages do not fit the plan's page capacity of {capacity}")
    exact = shape == BatchShape.exact(len(n), int(history_offsets[-1]), int(candidate_offsets[-1]))
    tiles = None if exact else tile_capacity(shape.num_rows, shape.users)
    arrays = {
        "history_offsets": padded(history_offsets),
        "candidate_offsets": padded(candidate_offsets),
        "cached_lengths": np.pad(c, (0, pad_users)).astype(np.int32),
        "page_indptr": padded(indptr),
        "page_indices": np.pad(indices, (0, capacity - len(indices))).astype(np.int32),
    }
    for name, first_row in (("all", np.zeros_like(n)), ("candidates", n)):
        users, rows = tile_schedule(n + m, first_row, tiles)
        arrays[f"{name}.tile_users"], arrays[f"{name}.tile_rows"] = users, rows
    return arrays


class _Scheduler:
    def __init__(
        self, n, m, c, history_offsets, candidate_offsets, addressing: KeyAddressing, shape: BatchShape, kb: int,
        candidate_key_ends: np.ndarray | None = None,
    ) -> None:
        self.n, self.m, self.c = n, m, c
        self.kb = kb
        self.candidate_key_ends = candidate_key_ends
        self.history_offsets, self.candidate_offsets = history_offsets, candidate_offsets
        self.addressing = addressing
        self.n_hist = shape.history_rows  # candidate rows start here
        self.num_rows = shape.num_rows

    def key_end(self, user: np.ndarray, row: np.ndarray) -> np.ndarray:
        """Keys seen by query row `row` (of its user's query sequence): j < key_end."""
        n, c = self.n[user], self.c[user]
        return np.where(row < n, c + row + 1, self._candidate_position(user, row))

    def query_position(self, user: np.ndarray, row: np.ndarray) -> np.ndarray:
        """Window position of query row `row`: a history row's own; a candidate's is its key end (the
        window's length, where the next event would sit, unless given per candidate)."""
        n, c = self.n[user], self.c[user]
        return np.where(row < n, c + row, self._candidate_position(user, row))

    def _candidate_position(self, user: np.ndarray, row: np.ndarray) -> np.ndarray:
        if self.candidate_key_ends is None:
            return self.c[user] + self.n[user]
        index = self.candidate_offsets[user] + row - self.n[user]  # the candidate, where row is one
        is_candidate = (row >= self.n[user]) & (index < len(self.candidate_key_ends))
        return np.where(is_candidate, self.candidate_key_ends[np.where(is_candidate, index, 0)], 0)

    def blocks(self, first_row: np.ndarray, qb: int) -> BlockSchedule:
        """The blocks of `qb` rows and pairs for query rows first_row[b] .. n_b + m_b - 1 of every user b."""
        kb = self.kb
        seq_len = self.n + self.m
        rows_per_user = np.maximum(seq_len - first_row, 0)
        block_user, block_rank = row_ids_and_ranks(-(-rows_per_user // qb))
        block_first = first_row[block_user] + block_rank * qb  # [Q]
        row = block_first[:, None] + np.arange(qb)  # [Q, QB] row in the user's query sequence
        valid_row = row < seq_len[block_user, None]
        key_end = np.where(valid_row, self.key_end(block_user[:, None], row), 0)  # [Q, QB]
        keys_seen = key_end.max(axis=1, initial=0)  # the keys the block's rows see at most
        is_history = row < self.n[block_user, None]
        q_rows = np.where(
            is_history,
            self.history_offsets[block_user, None] + row,
            self.n_hist + self.candidate_offsets[block_user, None] + row - self.n[block_user, None],
        )
        q_rows = np.where(valid_row, q_rows, self.num_rows)
        row_source = np.full(self.num_rows, q_rows.size, dtype=np.int64)
        row_source[q_rows[valid_row]] = np.flatnonzero(valid_row)

        pair_block, k_rank = row_ids_and_ranks(-(-keys_seen // kb))
        user = block_user[pair_block]
        pos = k_rank[:, None] * kb + np.arange(kb)  # [P, KB]
        valid_key = pos < (self.c + self.n)[user, None]
        # A padding slot reads the user's key 0 (a pair exists only if the user has keys): real data,
        # never an unwritten slot, so a masked score times its value is exactly 0.
        users = np.broadcast_to(user[:, None], pos.shape)
        k_rows = self.addressing.rows(users, np.where(valid_key, pos, 0), self.history_offsets)
        return BlockSchedule(
            block_users=block_user,
            block_first_row=block_first,
            block_rows=q_rows,
            block_key_end=key_end,
            block_query_positions=np.where(valid_row, self.query_position(block_user[:, None], row), 0),
            pair_blocks=pair_block,
            key_rows=k_rows,
            key_positions=np.where(valid_key, pos, NO_KEY),
            row_source=row_source,
        )
