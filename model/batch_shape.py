"""Row capacities of a batch on the device: exact for an eager forward, bucketed for CUDA graphs.

The layer input x has `history_rows` rows of history tokens (the real ones first, then padding),
then `candidate_rows` rows of candidates (the same), then one scratch row that padding entries
write to. A CUDA graph replays fixed shapes, so a batch runs in the graph of the smallest bucket
that holds it: every capacity rounded up to a power of two. Padding rows belong to no user: no
query block covers them, and their K/V are appended to the page pool's sink page.
"""
from __future__ import annotations

from dataclasses import dataclass

MIN_BUCKET_ROWS = 64


def _bucket(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


@dataclass(frozen=True)
class BatchShape:
    users: int
    history_rows: int
    candidate_rows: int

    @property
    def num_rows(self) -> int:
        return self.history_rows + self.candidate_rows

    @property
    def scratch_row(self) -> int:
        return self.num_rows

    @classmethod
    def exact(cls, users: int, history_rows: int, candidate_rows: int) -> BatchShape:
        return cls(users, history_rows, candidate_rows)

    @classmethod
    def bucket(cls, users: int, history_rows: int, candidate_rows: int) -> BatchShape:
        return cls(_bucket(users), _bucket(history_rows, MIN_BUCKET_ROWS), _bucket(candidate_rows, MIN_BUCKET_ROWS))

    def holds(self, other: BatchShape) -> bool:
        return (self.users >= other.users and self.history_rows >= other.history_rows
                and self.candidate_rows >= other.candidate_rows)
