"""HSTU's relative attention bias: a learned offset per head for how far apart, in position and in
time, a query and a key are.

    A_ij = SiLU(α q_i·k_j + rab_p[h, bucket_p(i - j)] + rab_t[h, bucket_t(t_i - t_j)]
                + [tag_i == tag_j] rab_tag[h]) / N

`i - j` is the distance between window positions (a history row's own position, or the window's
length for a candidate, so the newest event is 1 away from every candidate). `t_i - t_j` is in
whole seconds between the tokens' timestamps (a history event's own; a candidate's is the
request's). Contextual-prefix tokens have no time (`NO_TIME`): any pair involving one reads the
time table's last row.

The tag-match term (`tag_match=True`, a model with video tags) adds a learned offset per head when
a key's video carries the query's tag (a known one). With SiLU's pointwise weights and the 1/N
normaliser, a head that raises it sums the values of the window's same-tag events: the tag share
of the history, the signal a category-affinity model reads (docs/model.md, "A tag-match term").
Times and tags reach the bias packed in one int64 per token (model/attention/token_stamp.py), the
word the page pool keeps per slot, so a cached key's tag is read from the cache like its time.
A candidate's attention to itself carries no tag term.

The time table starts at zero. The position table starts from a recency prior (`recency_prior`):
head h favours keys closer than a horizon of 4^(h+1) events and discounts older ones, log-linearly
in distance, so that the heads begin as windows of different lengths. Without it, training has to
discover recency from a flat start, and the candidate-only terms, which need no history, win the
early optimisation (docs/model.md, "Learning order").

Buckets are log-linear, like the exponent and the leading mantissa bits of a float: distances
below 2^s each get their own bucket, then every doubling is cut into 2^s buckets (s = 3 for
positions: the last 16 events are told apart exactly; s = 2 for seconds). They are computed
from the bits of the float32 nearest to the distance, which integer-to-float conversion rounds
the same way (IEEE round-to-nearest-even) in torch, numpy and Triton, so the bucket of a pair is
identical on every backend and in any split of a history into visits: a cached key's bias is
computed from its stored position and time exactly as it was when the key was new.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from model.attention.token_stamp import NO_STAMP, stamp_tag_match, stamp_times

POSITION_SUBDIVISION = 3  # 8 buckets per doubling of the distance in positions, exact below 16
TIME_SUBDIVISION = 2  # 4 buckets per doubling of the distance in seconds
NO_TIME = NO_STAMP  # the time of a token that has none (a contextual-prefix token)
MS_PER_SECOND = 1000
EXACT_FLOAT_LIMIT = (1 << 24) - 1  # distances are capped here before the float conversion: exact in float32
RECENCY_PRIOR_LOGITS = 2.0  # the prior's bias at distance 0; it falls through 0 at the head's horizon
TAG_MATCH_PRIOR = 2 * RECENCY_PRIOR_LOGITS  # where every head's tag-match offset starts: a same-tag event outweighs recency


def max_buckets(subdivision: int) -> int:
    """Buckets up to the capped distance (2^24 - 1, ~194 days of seconds): more would never be used."""
    return (25 - subdivision) << subdivision


MAX_POSITION_BUCKETS = max_buckets(POSITION_SUBDIVISION)  # 176
MAX_TIME_BUCKETS = max_buckets(TIME_SUBDIVISION)  # 92


def log_bucket(distance: Tensor, subdivision: int, num_buckets: int) -> Tensor:
    """Bucket of each integer distance >= 0 (int64 in, int64 out, in [0, num_buckets)).

    d < 2^s: d itself; else (e - s + 1) 2^s + (the s bits after the leading one), e = floor(log2 d).
    """
    d = distance.clamp(0, EXACT_FLOAT_LIMIT)
    mantissa_bits = d.to(torch.int32).to(torch.float32).view(torch.int32) >> (23 - subdivision)
    logarithmic = mantissa_bits.to(torch.int64) - ((126 + subdivision) << subdivision)
    return torch.where(d < (1 << subdivision), d, logarithmic).clamp_(max=num_buckets - 1)


def time_bucket(query_stamps: Tensor, key_stamps: Tensor, num_buckets: int) -> Tensor:
    """Bucket of the seconds between broadcastable int64 query and key stamps' times (ms); `num_buckets`
    (the table's extra last row) where either has no time."""
    query_times, key_times = stamp_times(query_stamps), stamp_times(key_stamps)
    seconds = torch.div((query_times - key_times).clamp_(min=0), MS_PER_SECOND, rounding_mode="floor")
    bucket = log_bucket(seconds, TIME_SUBDIVISION, num_buckets)
    return torch.where((query_times < 0) | (key_times < 0), num_buckets, bucket)


def bucket_start(subdivision: int, num_buckets: int) -> Tensor:
    """[num_buckets] int64: the smallest distance in each bucket of `log_bucket`."""
    exact = torch.arange(1 << subdivision)
    steps = torch.arange(1 << subdivision)
    exponents = torch.arange(subdivision, 24)
    # Bucket boundaries past the exact range are 2^e (1 + m / 2^s): integers for e >= s.
    starts = ((steps[None, :] + (1 << subdivision)) << (exponents[:, None] - subdivision)).flatten()
    return torch.cat([exact, starts])[:num_buckets]


def recency_prior(num_heads: int, num_buckets: int) -> Tensor:
    """[H, P]: RECENCY_PRIOR_LOGITS x (1 - log(1 + d) / log(1 + 4^(h+1))) at each bucket's smallest
    distance d: positive inside head h's horizon, negative beyond it."""
    distance = bucket_start(POSITION_SUBDIVISION, num_buckets).double()
    horizon = 4.0 ** torch.arange(1, num_heads + 1, dtype=torch.float64)
    prior = 1 - torch.log1p(distance)[None, :] / torch.log1p(horizon)[:, None]
    return (RECENCY_PRIOR_LOGITS * prior).float()


_DISTANCE_BUCKETS: dict[tuple[int, torch.device], Tensor] = {}


def _distance_buckets(num_buckets: int, device: torch.device) -> Tensor:
    """[d_last + 1] int32: `log_bucket` of every position distance up to the last bucket's start d_last
    (every longer distance shares its bucket), built once per device."""
    key = (num_buckets, torch.device(device))
    if key not in _DISTANCE_BUCKETS:
        last = int(bucket_start(POSITION_SUBDIVISION, num_buckets)[-1])
        buckets = log_bucket(torch.arange(last + 1), POSITION_SUBDIVISION, num_buckets)
        _DISTANCE_BUCKETS[key] = buckets.to(device=device, dtype=torch.int32)
    return _DISTANCE_BUCKETS[key]


def _time_bucket_int32(query_stamps: Tensor, key_stamps: Tensor, num_buckets: int) -> Tensor:
    """`time_bucket` as int32: the seconds are capped before they are narrowed, as `log_bucket` caps them."""
    query_times, key_times = stamp_times(query_stamps), stamp_times(key_stamps)
    seconds = torch.div((query_times - key_times).clamp_(min=0), MS_PER_SECOND, rounding_mode="floor")
    seconds = seconds.clamp_(max=EXACT_FLOAT_LIMIT).to(torch.int32)
    exact = 1 << TIME_SUBDIVISION
    bits = seconds.to(torch.float32).view(torch.int32) >> (23 - TIME_SUBDIVISION)
    bucket = torch.where(seconds < exact, seconds, bits - ((126 + TIME_SUBDIVISION) << TIME_SUBDIVISION))
    bucket = bucket.clamp_(max=num_buckets - 1)
    return torch.where((query_times < 0) | (key_times < 0), num_buckets, bucket)


@dataclass
class BiasInputs:
    """The stamps (time and tag, model/attention/token_stamp.py) a batch's relative bias reads on the
    device, shared by every layer of one forward."""

    query_stamps: Tensor  # [T + 1] int64: each row's stamp (row T: what padding query slots read)
    key_stamps: Tensor  # [R] int64: the stamp of every key row (the page pool's slots, or the batch's rows)
    pair_index_cache: dict = field(default_factory=dict)  # the blocked path's bucket indices, per chunk


class RelativeAttentionBias(nn.Module):
    """One layer's tables: `position [H, P]` over distance buckets, `time [H, T + 1]` over seconds buckets
    (the last row: no time), and with `tag_match`, `tag_match [H]`. Either bucketed table may be
    absent (0 buckets)."""

    def __init__(self, num_heads: int, num_position_buckets: int, num_time_buckets: int, tag_match: bool = False,
                 device: torch.device | None = None) -> None:
        super().__init__()
        if not (0 <= num_position_buckets <= MAX_POSITION_BUCKETS and 0 <= num_time_buckets <= MAX_TIME_BUCKETS):
            raise ValueError(f"need 0 <= num_position_buckets <= {MAX_POSITION_BUCKETS} and 0 <= num_time_buckets <= "
                             f"{MAX_TIME_BUCKETS}, got {num_position_buckets} and {num_time_buckets}")
        self.num_position_buckets, self.num_time_buckets = num_position_buckets, num_time_buckets
        position = recency_prior(num_heads, num_position_buckets) if num_position_buckets else torch.zeros(num_heads, 1)
        self.position = nn.Parameter(position.to(device), requires_grad=num_position_buckets > 0)
        self.time = nn.Parameter(torch.zeros(num_heads, num_time_buckets + 1, device=device),
                                 requires_grad=num_time_buckets > 0)
        self.tag_match = nn.Parameter(torch.full((num_heads,), TAG_MATCH_PRIOR, device=device)) if tag_match else None

    @property
    def num_time_rows(self) -> int:
        return self.num_time_buckets + 1

    @property
    def num_distance_rows(self) -> int:
        """Rows of the pair table for one tag outcome: (position bucket, time bucket) pairs."""
        return self.position.shape[1] * self.num_time_rows

    def pair_index(self, query_positions: Tensor, key_positions: Tensor, query_stamps: Tensor, key_stamps: Tensor
                   ) -> Tensor:
        """Broadcastable int64 positions and stamps -> int32 rows of `pair_table()` (tag match x position
        bucket x time bucket).

        The same buckets as `log_bucket` and `time_bucket`, computed for speed (this runs over every
        pair a forward attends): positions through a table of every distance's bucket, and both in
        int32 wherever the values fit (tested equal to the definitions).
        """
        device = query_positions.device
        index = torch.zeros((), dtype=torch.int32, device=device)
        if self.num_position_buckets:
            buckets = _distance_buckets(self.num_position_buckets, device)
            distance = query_positions.to(torch.int32) - key_positions.to(torch.int32)
            distance = distance.clamp_(0, len(buckets) - 1)
            index = buckets.index_select(0, distance.reshape(-1)).view(distance.shape) * self.num_time_rows
        if self.num_time_buckets:
            index = index + _time_bucket_int32(query_stamps, key_stamps, self.num_time_buckets)
        if self.tag_match is not None:
            index = index + stamp_tag_match(query_stamps, key_stamps).to(torch.int32) * self.num_distance_rows
        return index

    def pair_table(self) -> Tensor:
        """[P * (T + 1), H], or [2 P (T + 1), H] with the tag match (its rows second): the bias of every
        row `pair_index` gives, per head."""
        table = (self.position[:, :, None] + self.time[:, None, :]).flatten(1)  # [H, P (T + 1)]
        if self.tag_match is not None:
            table = torch.cat([table, table + self.tag_match[:, None]], 1)
        return table.t()

    def self_bias(self) -> Tensor:
        """[H]: the bias of a token with itself (distance 0, 0 seconds, no tag term)."""
        return self.position[:, 0] + self.time[:, 0]
