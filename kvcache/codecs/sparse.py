"""SparseCodec: keep the most important tokens of each offloaded page, drop the K/V of the rest.

H2O keeps a softmax model's "heavy hitters". HSTU's attention is pointwise (`silu(q.k + bias) v`,
divided by a constant), so a cached token j adds `silu(q.k_j + b) v_j` to every later query's output
and nothing else: a token whose V is zero is *exactly* a removed key. That is how this codec drops
one. It stores, per page, every token's time (exact), the kept tokens' slots and their K/V (through a
value codec: raw, bf16, fp16, int8); decoding scatters the kept K/V back to their slots and zeroes
the others. So the cache's model is untouched: a sparsified user's window keeps its length, every
kept token its position and time (the relative bias stays right), the manager's length and version
guards see the same entry, and the next visit appends after it as before. Device pages stay dense
(a hole costs its slot on the device and its share of attention work): what shrinks is what the
host tiers store and move.

Which tokens: per page, the `keep`% (rounded up) with the highest score, where `score` is
- `vnorm`: the token's |V| summed over layers and heads (its contribution is silu(.) * v_j),
- `knorm`: the same of |K|, `kvnorm`: of |K| * |V|,
- `stride`: evenly spaced slots (a score-free baseline).
A per-page quota keeps pages independently decodable and every page of the history represented.
Dropping tokens from an unnormalised sum shrinks every later output (softmax would renormalise);
`merge=g` folds a page's dropped tokens into g more stored tokens (`SparseCodec.stored_tokens`).
The last `recent` pages of each write, which hold the user's newest tokens (and its partial last
page, which the next incremental write rewrites), are kept whole.

A row: kept-token count m (int64), the page's times [page_size] int64, the kept slots [m] int16
(padded to 8 bytes), then the kept K/V as `values` encodes a page of m tokens.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..page_data import PageData, empty_pages
from ..page_layout import TIME_NBYTES, PageLayout
from .base import EncodedPages, KVCodec
from .values import ValueCodec, aligned

SCORES = ("vnorm", "knorm", "kvnorm", "stride")
_HEADER = 8  # the kept-token count, int64
_MAX_PAGE_SIZE = (1 << 15) - 1  # slots are int16


def token_scores(kv: Tensor, score: str) -> Tensor:
    """[k, L, 2, S, H, D] pages -> [k, S] float32 importance of each token slot (higher: kept first)."""
    if score == "stride":
        raise ValueError("stride keeps evenly spaced slots: it has no score")
    norms = torch.linalg.vector_norm(kv.float(), dim=-1)  # [k, L, 2, S, H]
    k_norm, v_norm = norms[:, :, 0], norms[:, :, 1]
    per_head = {"vnorm": v_norm, "knorm": k_norm, "kvnorm": k_norm * v_norm}[score]
    return torch.nan_to_num(per_head.sum(dim=(1, 3)), nan=0.0, posinf=torch.finfo(torch.float32).max)


def kept_slots(kv: Tensor, score: str, m: int) -> Tensor:
    """[k, m] int64 slots each page keeps (sorted), m <= page_size."""
    k, page_size = kv.shape[0], kv.shape[3]
    if m >= page_size:
        return torch.arange(page_size).expand(k, page_size)
    if score == "stride":
        slots = torch.linspace(0, page_size - 1, m).round().long()  # distinct for m <= page_size
        return slots.expand(k, m)
    return token_scores(kv, score).topk(m, dim=1).indices.sort(dim=1).values


@dataclass(frozen=True)
class SparseParams:
    """What a `sparse` spec names (`codecs/registry.py` parses it)."""

    keep_percent: int = 50  # of each page's tokens, rounded up
    merge: int = 1  # runs the dropped tokens are folded into (0: dropped outright)
    recent_pages: int = 1  # the last pages of each write, stored whole
    score: str = "vnorm"
    values: str = "raw"  # the value codec of the stored tokens

    def __post_init__(self) -> None:
        if not 1 <= self.keep_percent <= 100 or self.merge < 0 or self.recent_pages < 0 or self.score not in SCORES:
            raise ValueError(f"Bad sparse codec parameters: {self}.")
        if self.merge and not self.recent_pages and self.keep_percent < 100:
            # A write's last page is the user's partial one: its unused slots hold what the device page held
            # before (another user's tokens), which a merge would fold into a token of this user.
            raise ValueError("A sparse codec that merges must keep the last page of each write whole (recent >= 1).")

    @property
    def spec(self) -> str:
        return (f"sparse:keep={self.keep_percent},merge={self.merge},recent={self.recent_pages},"
                f"score={self.score},values={self.values}")


class SparseCodec(KVCodec):
    def __init__(self, params: SparseParams, values: ValueCodec) -> None:
        self.params = params
        self.values = values  # the value codec `params.values` names

    @property
    def spec(self) -> str:
        return self.params.spec

    def kept_per_page(self, layout: PageLayout) -> int:
        return max(1, math.ceil(layout.page_size * self.params.keep_percent / 100))

    def _fields(self, layout: PageLayout, m: int) -> tuple[PageLayout, int, int]:
        """(the layout of a page of m tokens, where the values start, the row width) for m kept tokens."""
        if layout.page_size > _MAX_PAGE_SIZE:
            raise ValueError(f"Codec {self.spec!r} stores token slots as int16: page_size must be <= {_MAX_PAGE_SIZE}.")
        sub = dataclasses.replace(layout, page_size=m)
        values_at = _HEADER + layout.page_size * TIME_NBYTES + aligned(2 * m)
        return sub, values_at, values_at + self.values.width(sub, layout.num_layers)

    def _plan(self, layout: PageLayout, k: int) -> list[tuple[slice, int]]:
        """(pages, tokens kept) of each run of pages encoded alike: the sparse pages, then the recent ones."""
        dense_from = max(0, k - self.params.recent_pages)
        m = self.kept_per_page(layout)
        runs = [(slice(0, dense_from), m), (slice(dense_from, k), layout.page_size)]
        return [(pages, kept) for pages, kept in runs if pages.stop > pages.start]

    def _stored(self, page_size: int, m: int) -> int:
        """Tokens a page keeping its top m stores: the merged tokens too."""
        return m + min(self.params.merge, page_size - m)

    def stored_tokens(self, kv: Tensor, m: int) -> tuple[Tensor, Tensor]:
        """What pages kv [k, L, 2, S, H, D] keeping their top m store: slots [k, n] and K/V [k, L, 2, n, H, D].

        With `merge` = g, the dropped tokens, in slot order, are split into g runs of nearly equal
        size, each folded into one token at its middle slot: K the run's mean, V its sum, so the
        attention mass they carried stays (silu(q.mean k + b) * sum v to first order) instead of
        vanishing from HSTU's unnormalised sum."""
        slots = kept_slots(kv, self.params.score, m)
        tokens = _gather_tokens(kv, slots)
        k, page_size = kv.shape[0], kv.shape[3]
        d = page_size - m
        groups = self._stored(page_size, m) - m
        if not groups:
            return slots, tokens
        dropped = torch.ones(k, page_size, dtype=torch.bool).scatter_(1, slots, False)  # [k, S]
        order = torch.where(dropped, torch.arange(page_size), page_size).sort(dim=1).values[:, :d]  # [k, d]
        member = F.one_hot(torch.arange(d) * groups // d, groups).float()  # [d, g]: run of each dropped rank
        counts = member.sum(dim=0)  # [g]
        middle = (counts.cumsum(0) - counts + (counts - 1).div(2, rounding_mode="floor")).long()  # [g] ranks
        sums = torch.einsum("klcdhe,dg->klcghe", _gather_tokens(kv, order).float(), member)  # [k, L, 2, g, H, D]
        merged = torch.stack([sums[:, :, 0] / counts[:, None, None], sums[:, :, 1]], dim=2).to(kv.dtype)
        return torch.cat([slots, order[:, middle]], dim=1), torch.cat([tokens, merged], dim=3)

    def encode(self, layout: PageLayout, pages: PageData) -> EncodedPages:
        k = pages.num_pages
        runs = self._plan(layout, k)
        width = {m: self._fields(layout, self._stored(layout.page_size, m))[2] for _, m in runs}
        widths = np.concatenate([np.full(p.stop - p.start, width[m], dtype=np.int64) for p, m in runs]
                                or [np.zeros(0, dtype=np.int64)])
        offsets = np.zeros(k + 1, dtype=np.int64)
        np.cumsum(widths, out=offsets[1:])
        with torch.inference_mode(False):  # tiers keep these bytes past the caller's inference mode
            data = torch.empty(int(offsets[-1]), dtype=torch.uint8)
        for run, m in runs:
            slots, tokens = self.stored_tokens(pages.kv[run], m)
            n = slots.shape[1]
            sub, values_at, width = self._fields(layout, n)
            rows = data[offsets[run.start] : offsets[run.stop]].view(run.stop - run.start, width)
            rows[:, :_HEADER].view(torch.int64).fill_(n)
            rows[:, _HEADER : _HEADER + layout.page_size * TIME_NBYTES].view(torch.int64).copy_(pages.times[run])
            slots_at = _HEADER + layout.page_size * TIME_NBYTES
            rows[:, slots_at : slots_at + 2 * n].view(torch.int16).copy_(slots)
            self.values.encode_into(sub, tokens, rows[:, values_at:])
        return EncodedPages(self.spec, data, offsets)

    def decode(self, layout: PageLayout, encoded: EncodedPages) -> PageData:
        self.check_spec(encoded)
        k = encoded.num_pages
        starts = torch.from_numpy(encoded.offsets[:-1])
        header = encoded.data[starts[:, None] + torch.arange(_HEADER)].view(torch.int64).view(k).numpy() if k else []
        out = empty_pages(layout, k)
        out.kv.zero_()
        bounds = [0, *(np.flatnonzero(np.diff(header)) + 1).tolist(), k] if k else [0]
        for first, stop in itertools.pairwise(bounds):  # runs of pages keeping as many tokens: one view each
            m = int(header[first])
            if not 1 <= m <= layout.page_size:
                raise ValueError(f"Pages of {self.spec!r} cannot keep {m} of {layout.page_size} tokens.")
            sub, values_at, width = self._fields(layout, m)
            if not (encoded.sizes()[first:stop] == width).all():
                raise ValueError(f"Pages of {self.spec!r} keeping {m} tokens must be {width} bytes each.")
            rows = encoded.data[encoded.offsets[first] : encoded.offsets[stop]].view(stop - first, width)
            times_at = _HEADER + layout.page_size * TIME_NBYTES
            out.times[first:stop] = rows[:, _HEADER:times_at].view(torch.int64)
            slots = rows[:, times_at : times_at + 2 * m].view(torch.int16).long()
            if not bool(((slots >= 0) & (slots < layout.page_size)).all()):
                raise ValueError(f"Pages of {self.spec!r} name token slots outside the page.")
            kept = self.values.decode(sub, rows[:, values_at:], layout.num_layers)  # [n, L, 2, m, H, D]
            out.kv[first:stop].scatter_(3, _slot_index(slots, kept.shape), kept)
        return out

    def max_abs_error(self, layout: PageLayout, pages: PageData) -> Tensor:
        """|x - what is stored in x's slot| (a dropped token decodes as 0, a merged one as the merge), plus
        the value codec's bound on the stored tokens."""
        x = pages.kv.float()
        bound = torch.zeros_like(x)
        for run, m in self._plan(layout, pages.num_pages):
            slots, tokens = self.stored_tokens(pages.kv[run], m)
            index = _slot_index(slots, tokens.shape)
            sub = dataclasses.replace(layout, page_size=slots.shape[1])
            bound[run] = (x[run] - torch.zeros_like(x[run]).scatter_(3, index, tokens.float())).abs()
            bound[run].scatter_add_(3, index, self.values.max_abs_error(sub, tokens))
        return bound


def _slot_index(slots: Tensor, shape: torch.Size) -> Tensor:
    """[k, m] slots -> an index over dim 3 of a [k, L, 2, m, H, D] tensor."""
    return slots[:, None, None, :, None, None].expand(shape)


def _gather_tokens(kv: Tensor, slots: Tensor) -> Tensor:
    """kv [k, L, 2, S, H, D], slots [k, m] -> [k, L, 2, m, H, D]: the kept tokens' K/V."""
    k, layers, _, _, heads, dim = kv.shape
    return kv.gather(3, _slot_index(slots, torch.Size((k, layers, 2, slots.shape[1], heads, dim))))
