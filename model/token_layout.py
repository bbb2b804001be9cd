"""The token layout: the one place that maps a user's events to token positions.

A user's history is served through an *attention window* that starts at event `w`
(0 until the history outgrows the model). Inside a window the tokens are

    cache position   w .. w+C-1        C+w .. C+E-1
    token            [prefix_0..C-1]   [event w .. event E-1]        then candidates (never cached)

so event i always sits at cache position C + i, and the C contextual-prefix tokens sit
immediately before the window's first event. For w = 0 this is the plain layout
"prefix at 0..C-1, event i at C+i". Positions are contiguous inside a window, which is
what the KV cache requires.

Position *embeddings* are absolute and forward: event i uses min(C + i, P - 1) for a
position table of size P; the prefix tokens use their own feature tables instead; all
candidates of a visit share min(C + E, P - 1). Nothing depends on the batch, the
query time or the history length, so a cached K/V never goes stale.

The window start is a pure function of the visit's history end E (see `window_start`),
so incremental serving and full recompute always see the same window.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from model.config import HSTUConfig


@dataclass(frozen=True)
class VisitPlan:
    """What a batch of visits must compute, given what the KV cache holds (numpy, [B])."""

    window_starts: np.ndarray  # event index w of each user's window
    starts: np.ndarray  # first event to compute (cached events end here)
    invalidate: np.ndarray  # bool: the cached data cannot be continued; drop it first


@dataclass(frozen=True)
class TokenSpans:
    """Where the tokens computed for each user of a batch go in the cache ([B] int64 numpy)."""

    prefix_lengths: np.ndarray  # C where this visit opens its window, else 0
    history_lengths: np.ndarray  # prefix + events computed in this visit
    start_pos: np.ndarray  # cache position of the first computed token
    expected_cached_lengths: np.ndarray  # tokens the cache must already hold before start_pos


class TokenLayout:
    def __init__(self, config: HSTUConfig):
        self.num_prefix = config.num_prefix_tokens
        self.max_window_events = config.max_seq_len - self.num_prefix
        self.window_stride = config.window_stride
        self.position_table_size = config.position_table_size

    # ---- windows --------------------------------------------------------------------
    def window_start(self, ends: np.ndarray) -> np.ndarray:
        """Event index where the window of a visit with history end E begins.

        0 while E fits; otherwise the smallest multiple of the stride that leaves at most
        `max_window_events` events. Moving in strides (not every event) is what lets a
        window be reused by many visits before it must be restarted.
        """
        ends = np.asarray(ends, dtype=np.int64)
        overflow = np.maximum(ends - self.max_window_events, 0)
        return -(-overflow // self.window_stride) * self.window_stride  # ceil to a stride multiple

    def window_tokens(self, ends: np.ndarray) -> np.ndarray:
        """Cache positions a visit with history end E occupies: its window's prefix + events."""
        ends = np.asarray(ends, dtype=np.int64)
        return self.num_prefix + ends - self.window_start(ends)

    def tokens_never_read_again(self, ends: np.ndarray, attention_window: int) -> np.ndarray:
        """[n] of each window's tokens at history end E, those no later query reads through a sliding
        attention window of `attention_window` events (0: every key, so none): the events more than that
        many back. The prefix is read by every query (docs/kvcache.md, "What a windowed model never reads
        again")."""
        if attention_window == 0:
            return np.zeros(len(np.asarray(ends)), dtype=np.int64)
        return np.maximum(self.window_tokens(ends) - self.num_prefix - attention_window, 0)

    def plan(self, ends: np.ndarray, cached_start_pos: np.ndarray, cached_lengths: np.ndarray) -> VisitPlan:
        """Which events each visit computes, given the cache's `(start, length)` in tokens.

        Cached data is continued only when it is exactly this window's prefix of tokens:
        it starts at the window start, holds the whole contextual prefix, and ends at or
        before the visit's history end. Anything else is dropped and recomputed.
        """
        ends = np.asarray(ends, dtype=np.int64)
        cached_start_pos = np.asarray(cached_start_pos, dtype=np.int64)
        cached_lengths = np.asarray(cached_lengths, dtype=np.int64)
        windows = self.window_start(ends)
        cached_event_end = cached_start_pos + cached_lengths - self.num_prefix
        usable = (
            (cached_lengths > 0)
            & (cached_start_pos == windows)
            & (cached_lengths >= self.num_prefix)
            & (cached_event_end <= ends)
        )
        starts = np.where(usable, cached_event_end, windows)
        return VisitPlan(windows, starts, invalidate=(cached_lengths > 0) & ~usable)

    def visit_spans(self, ends: np.ndarray, cached_start_pos: np.ndarray, cached_lengths: np.ndarray) -> TokenSpans:
        """The token spans of visits ending at `ends` given what the cache holds: `plan`, then `spans`
        (`expected_cached_lengths`: tokens reused; `history_lengths`: history tokens computed)."""
        plan = self.plan(ends, cached_start_pos, cached_lengths)
        return self.spans(plan.window_starts, plan.starts, ends - plan.starts)

    # ---- positions ------------------------------------------------------------------
    def spans(self, window_starts: np.ndarray, starts: np.ndarray, num_events: np.ndarray) -> TokenSpans:
        """Token spans for visits computing events [starts, starts + num_events)."""
        opens_window = starts == window_starts
        prefix = opens_window.astype(np.int64) * self.num_prefix
        start_pos = np.where(opens_window, window_starts, starts + self.num_prefix)
        return TokenSpans(
            prefix_lengths=prefix,
            history_lengths=prefix + num_events,
            start_pos=start_pos,
            expected_cached_lengths=start_pos - window_starts,
        )

    def position_ids(self, event_index: np.ndarray) -> np.ndarray:
        """Position-embedding id of event i (also used for candidates, with i = E)."""
        return np.minimum(event_index + self.num_prefix, self.position_table_size - 1)
