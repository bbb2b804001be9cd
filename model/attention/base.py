"""The attention backend contract: what the model asks of any HSTU attention implementation.

A forward's attention is planned once per batch on the host and run by every layer:

    batch = AttentionBatch.of(n, m, c, addressing, shape)    # where every query and key is
    plan = backend.plan(batch)                               # the backend's schedule (numpy)
    arrays = host_inputs(plan)                               # -> the batch's one upload
    attention = BatchAttention.from_device(plan, uploaded)   # the plan and its device arrays
    out = attend(q, k, v, keys, values, attention, ...)      # per layer: [T, H, D]

The model only builds `AttentionBatch`es and calls `attend`: how a backend tiles, splits or pads
its work stays behind `AttentionBackend` (model/attention/blocked_backend.py, the torch path;
model/attention/triton_backend.py, the Triton kernel), and `model/attention/registry.py` picks one
by name and device.

Rows of the layer's q/k/v [T, H, D]: first the new history rows of every user (user b has n_b
at `history_offsets[b]`), then the candidate rows (m_b at `shape.history_rows + candidate_offsets[b]`).
User b's keys are positions 0 .. L_b - 1 of its window, L_b = c_b + n_b: c_b cached tokens and
its new history tokens, read either from the paged KV cache (after the new ones were appended)
or, with nothing cached, straight from its history rows of k/v (contiguous).

Query i of user b's query sequence [history rows | candidates] sees keys j < key_end: history row
i sees j <= c_b + i (causal); every candidate sees the whole window, j < L_b, plus itself (never
another candidate). A training batch whose targets are drawn from the history gives each candidate
its own key end instead (`candidate_key_ends`: the target's own window position, so it sees only
the events before it); a backend that cannot honour them says so (`supports_candidate_key_ends`).
With a `KeyWindow` (sliding-window attention) a query with key end e sees only keys
e - size <= j < e, and always the window's first `sink` keys (the contextual prefix).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from data.jagged import offsets
from model.attention.relative_bias import BiasInputs, RelativeAttentionBias
from model.batch_shape import BatchShape

ARRAY_PREFIX = "attention."  # the plan's arrays in the batch's upload


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
class KeyWindow:
    """Sliding-window attention: a query with key end e sees keys e - size <= j < e, and keys j < sink.

    Every key's output depends only on keys at most `size` before it, so K/V appended by an earlier
    visit stay exact: the cache serves a windowed model as it serves any other. A model trained on
    crops of its last `size` events is served the same view of a long history (docs/model.md).

    >>> window = KeyWindow(size=3, sink=1)
    >>> [j for j in range(8) if window.sees(j, key_end=8)]
    [0, 5, 6, 7]
    """

    size: int  # keys before the query's key end it sees (its own included, for a history query)
    sink: int = 0  # the window's first keys, seen by every query (the contextual prefix)

    def __post_init__(self) -> None:
        if self.size < 1 or self.sink < 0:
            raise ValueError(f"a KeyWindow needs size >= 1 and sink >= 0, got size={self.size}, sink={self.sink}")

    def sees(self, key: int, key_end: int) -> bool:
        """Whether a query with this key end sees key position `key` (the causal end included)."""
        return key < key_end and (key >= key_end - self.size or key < self.sink)


@dataclass(frozen=True)
class AttentionBatch:
    """What every backend is told about a batch: each user's query and key extents, where its keys
    live, and the row capacities of the batch's tensors."""

    history_lengths: np.ndarray  # [B] int64 n_b: new history rows (queries and keys)
    candidate_lengths: np.ndarray  # [B] int64 m_b
    cached_lengths: np.ndarray  # [B] int64 c_b: keys already in the cache
    addressing: KeyAddressing
    shape: BatchShape  # candidate rows start at shape.history_rows
    # The shape is a CUDA graph bucket: the plan's arrays must have lengths that fit every batch of
    # the bucket (windows up to the model's max_seq_len), so that one capture replays them all.
    bucketed: bool = False
    candidate_key_ends: np.ndarray | None = None  # [M] int64, window positions; None: each window's length
    key_window: KeyWindow | None = None  # None: every query sees all keys up to its key end

    @classmethod
    def of(cls, history_lengths, candidate_lengths, cached_lengths, addressing: KeyAddressing,
           shape: BatchShape | None = None, bucketed: bool = False, candidate_key_ends=None,
           key_window: KeyWindow | None = None) -> AttentionBatch:
        """Lengths as int64 arrays; `shape` defaults to the exact one; key ends are checked against the windows."""
        n, m, c = (np.asarray(a, dtype=np.int64) for a in (history_lengths, candidate_lengths, cached_lengths))
        shape = shape or BatchShape.exact(len(n), int(n.sum()), int(m.sum()))
        if candidate_key_ends is not None:
            candidate_key_ends = np.asarray(candidate_key_ends, dtype=np.int64)
            window = np.repeat(c + n, m)
            if len(candidate_key_ends) != len(window) or np.any((candidate_key_ends < 0) | (candidate_key_ends > window)):
                raise ValueError(f"candidate_key_ends must hold one key end in [0, window length] per candidate "
                                 f"({len(window)})")
        return cls(n, m, c, addressing, shape, bucketed, candidate_key_ends, key_window)

    @cached_property
    def history_offsets(self) -> np.ndarray:  # [B + 1]
        return offsets(self.history_lengths)

    @cached_property
    def candidate_offsets(self) -> np.ndarray:  # [B + 1]
        return offsets(self.candidate_lengths)

    @property
    def num_users(self) -> int:
        return len(self.history_lengths)

    @property
    def is_exact(self) -> bool:
        """The shape has no padding rows or users."""
        return self.shape == BatchShape.exact(self.num_users, int(self.history_offsets[-1]),
                                              int(self.candidate_offsets[-1]))


@dataclass(frozen=True)
class AttentionPlan:
    """A backend's schedule for one batch (host side). Each backend extends it with its own fields."""

    batch: AttentionBatch
    backend: AttentionBackend = field(repr=False)  # the backend that made the plan, and runs it

    @property
    def num_history_rows(self) -> int:
        return self.batch.shape.history_rows


@dataclass(frozen=True, order=True)
class KernelVariant:
    """What picks a compiled attention kernel: a backend compiles (at most) one per distinct value, and
    the shapes of a batch are never part of it (tests/model/test_kernel_variants.py holds Triton to that).
    A node warms every variant it can meet before it reports ready (model/warm_up.py)."""

    backend: str
    dtype: str  # the queries' (the model's compute dtype)
    key_dtype: str  # the keys' (the KV cache's dtype when paged)
    head_dim: int
    page_size: int  # 0: contiguous keys (no cache)

    def as_dict(self) -> dict[str, object]:
        return {"backend": self.backend, "dtype": self.dtype, "key_dtype": self.key_dtype,
                "head_dim": self.head_dim, "page_size": self.page_size}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class AttentionBackend(ABC):
    """One implementation of batched HSTU attention."""

    name: str
    supports_candidate_key_ends: bool  # honours AttentionBatch.candidate_key_ends (training batches)
    # `attend` on a bucketed plan launches fixed-size work sized only by the plan's shapes and reads
    # nothing back from the device, so a CUDA graph can capture it once and replay it for the bucket.
    captures_in_graphs: bool

    @abstractmethod
    def plan(self, batch: AttentionBatch) -> AttentionPlan:
        """Schedule a batch on the host (numpy only, no device work)."""

    @abstractmethod
    def host_inputs(self, plan: AttentionPlan) -> dict[str, np.ndarray]:
        """The plan's arrays every layer reads on the device, by name (without ARRAY_PREFIX)."""

    @abstractmethod
    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, plan: AttentionPlan,
        arrays: Mapping[str, Tensor], candidates_only: bool, alpha: float, normalizer: float,
        bias: RelativeAttentionBias | None, bias_inputs: BiasInputs | None,
    ) -> Tensor:
        """q/k/v [T, H, D] (the batch's rows), keys/values [R, H, D] (rows `addressing` indexes) ->
        [T, H, D] in q's dtype: SiLU(α q·k + rab) / N times V over each query's visible keys. Rows
        the plan does not cover (padding; history rows when `candidates_only`) are 0."""

    def variant(self, plan: AttentionPlan, q: Tensor, keys: Tensor) -> KernelVariant:
        """The compiled variant `attend` runs for this plan and these tensors. A backend whose kernels
        specialise on more than this must override it (and widen what the node warms up)."""
        return KernelVariant(self.name, _dtype_name(q.dtype), _dtype_name(keys.dtype), q.shape[-1],
                             plan.batch.addressing.page_size)

    def check(self, batch: AttentionBatch) -> None:
        """Refuse a batch this backend cannot compute."""
        if batch.candidate_key_ends is not None and not self.supports_candidate_key_ends:
            raise ValueError(f"per-candidate key ends (history targets, a training batch) need a backend that "
                             f"supports them; {self.name!r} does not")


def host_inputs(plan: AttentionPlan) -> dict[str, np.ndarray]:
    """The plan's arrays, named for the batch's one upload."""
    return {ARRAY_PREFIX + name: a for name, a in plan.backend.host_inputs(plan).items()}


@dataclass(frozen=True)
class BatchAttention:
    """A plan and its arrays on the device: what every layer of a forward attends with."""

    plan: AttentionPlan
    arrays: dict[str, Tensor]  # the plan's host_inputs on the device, without ARRAY_PREFIX

    @classmethod
    def from_device(cls, plan: AttentionPlan, device_inputs: Mapping[str, Tensor]) -> BatchAttention:
        n = len(ARRAY_PREFIX)
        return cls(plan, {name[n:]: t for name, t in device_inputs.items() if name.startswith(ARRAY_PREFIX)})

    @property
    def backend(self) -> AttentionBackend:
        return self.plan.backend


def attend(
    q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, attention: BatchAttention,
    candidates_only: bool, alpha: float, normalizer: float,
    bias: RelativeAttentionBias | None = None, bias_inputs: BiasInputs | None = None,
) -> Tensor:
    """[T, H, D] attention outputs through the plan's backend (`AttentionBackend.attend`); with `bias`,
    the layer's relative bias over the positions in the plan and the times in `bias_inputs`."""
    if bias is not None and bias_inputs is None:
        raise ValueError("a relative bias needs the batch's BiasInputs")
    if _variant_logs:  # a warm-up (or a test) is recording the variants forwards meet; empty when serving
        met = attention.backend.variant(attention.plan, q, keys)
        for log in _variant_logs:
            log.add(met)
    return attention.backend.attend(q, k, v, keys, values, attention.plan, attention.arrays, candidates_only,
                                    alpha, normalizer, bias, bias_inputs)


_variant_logs: list[set[KernelVariant]] = []


@contextmanager
def recording_variants() -> Iterator[set[KernelVariant]]:
    """The kernel variants every `attend` meets inside the block (forwards run eagerly: a CUDA graph
    replay calls no `attend`), collected into the yielded set."""
    log: set[KernelVariant] = set()
    _variant_logs.append(log)
    try:
        yield log
    finally:
        _variant_logs.remove(log)
