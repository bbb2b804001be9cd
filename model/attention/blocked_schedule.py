"""The blocked backend's schedule: (query block, key block) pairs, planned on the host (numpy).

Every user's query rows (model/attention/base.py) are cut into blocks of `query_block` rows and its
keys into blocks of `key_block`; a pair exists only if some query of the block sees some key of
the block, so masked-out blocks above the causal diagonal, and with a `KeyWindow` those before
every row's window (but the prefix's), are never visited. A plan has a schedule
for all query rows and one for candidates only (the last layer needs no history outputs).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.jagged import row_ids_and_ranks
from model.attention.base import AttentionBatch

QUERY_BLOCKS = (32, 64, 128, 256)  # the blocked path picks one per schedule (`query_block_for`)
KEY_BLOCK = 512
# What a small query block costs beyond its padded work: more, smaller matmuls and pairs. A block
# of qb rows is charged as qb + SMALL_BLOCK_COST rows.
SMALL_BLOCK_COST = 16
NO_KEY = np.iinfo(np.int64).max  # key position of a padding slot: above every query's key_end


@dataclass(frozen=True)
class BlockSchedule:
    """Q query blocks of `query_block` rows and P (query block, key block) pairs ([..] int64).

    Every query row of the schedule lies in exactly one query block; `row_source` finds it there.
    """

    block_users: np.ndarray  # [Q] the user of each query block
    block_first_row: np.ndarray  # [Q] its first row in the user's query sequence [history | candidates]
    block_rows: np.ndarray  # [Q, query_block] row of q, or T (a padding row) past the block's end
    block_key_end: np.ndarray  # [Q, query_block] keys j < key_end are seen (0 for padding)
    block_key_start: np.ndarray  # [Q, query_block] ... and j >= key_start, or j < the window's sink (0 without one)
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


class BlockScheduler:
    """Builds the `BlockSchedule`s of one batch with key blocks of `key_block` keys."""

    def __init__(self, batch: AttentionBatch, key_block: int) -> None:
        self.n, self.m, self.c = batch.history_lengths, batch.candidate_lengths, batch.cached_lengths
        self.kb = key_block
        self.candidate_key_ends = batch.candidate_key_ends
        self.key_window = batch.key_window
        self.history_offsets, self.candidate_offsets = batch.history_offsets, batch.candidate_offsets
        self.addressing = batch.addressing
        self.n_hist = batch.shape.history_rows  # candidate rows start here
        self.num_rows = batch.shape.num_rows

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
        window, sink = self.key_window, self.key_window.sink if self.key_window else 0
        key_start = np.maximum(key_end - window.size, 0) if window else np.zeros_like(key_end)
        # Key blocks visited: the sink's (unless the window reaches them), then first_block .. the last seen.
        end_block = -(-keys_seen // kb)
        first_block = np.minimum(np.where(valid_row, key_start, NO_KEY).min(axis=1) // kb, end_block)
        sink_blocks = np.minimum(-(-sink // kb), first_block)
        is_history = row < self.n[block_user, None]
        q_rows = np.where(
            is_history,
            self.history_offsets[block_user, None] + row,
            self.n_hist + self.candidate_offsets[block_user, None] + row - self.n[block_user, None],
        )
        q_rows = np.where(valid_row, q_rows, self.num_rows)
        row_source = np.full(self.num_rows, q_rows.size, dtype=np.int64)
        row_source[q_rows[valid_row]] = np.flatnonzero(valid_row)

        pair_block, k_rank = row_ids_and_ranks(sink_blocks + end_block - first_block)
        user = block_user[pair_block]
        skipped = first_block[pair_block] - sink_blocks[pair_block]  # blocks between the sink and the window
        key_block = np.where(k_rank < sink_blocks[pair_block], k_rank, k_rank + skipped)
        pos = key_block[:, None] * kb + np.arange(kb)  # [P, KB]
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
            block_key_start=np.where(valid_row, key_start, 0),
            block_query_positions=np.where(valid_row, self.query_position(block_user[:, None], row), 0),
            pair_blocks=pair_block,
            key_rows=k_rows,
            key_positions=np.where(valid_key, pos, NO_KEY),
            row_source=row_source,
        )
