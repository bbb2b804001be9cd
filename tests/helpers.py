"""Shared test helpers (fixtures live in conftest.py). Test modules import from here only.

Sections: hand-made raw KuaiRand-1K files; small generated and preprocessed datasets;
in-memory user histories and `VisitBatch`es for model tests (independent of the data layer
on purpose, so a failure points at the model or the cache); Redis namespaces.
"""
from __future__ import annotations

import datetime as dt
import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data import schema
from data.batch import VisitBatch
from data.manifest import PreprocessParams
from data.preprocess import preprocess
from data.synthetic import generate
from data.synthetic_world import DEFAULT_SIGNAL, signal_config
from model.baselines import Interactions, Visits
from model.config import HSTUConfig, preset
from model.recommender import HSTURecommender
from model.video_tags import VideoTagTable

REPO_ROOT = Path(__file__).resolve().parents[1]


# ---- raw KuaiRand-1K files ------------------------------------------------------------
BEIJING = dt.timezone(dt.timedelta(hours=8))
T0 = int(dt.datetime(2022, 4, 10, 9, 0, tzinfo=BEIJING).timestamp() * 1000)  # a morning in the early log
MINUTE = 60_000


def log_row(user_id: int, video_id: int, time_ms: int, **values: int) -> dict[str, int]:
    """One log row; date/hourmin follow time_ms (computed with the stdlib, not the code under
    test), unspecified columns get plain defaults."""
    local = dt.datetime.fromtimestamp(time_ms / 1000, BEIJING)
    row = {column: 0 for column in schema.LOG_COLUMNS}
    row.update(
        user_id=user_id, video_id=video_id, time_ms=time_ms,
        date=int(local.strftime("%Y%m%d")), hourmin=local.hour * 100,
        play_time_ms=1_000, duration_ms=10_000,
    )  # fmt: skip
    row.update(values)
    return row


def write_csv(path: Path, header: list[str] | tuple[str, ...], rows: list[list[object]]) -> Path:
    lines = [",".join(header)] + [",".join(str(v) for v in row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_log(path: Path, rows: list[dict[str, int]], columns: tuple[str, ...] = schema.LOG_COLUMNS) -> Path:
    return write_csv(path, columns, [[row[c] for c in columns] for row in rows])


def feature_row(user_id: int, **values: object) -> dict[str, object]:
    """A user_features row with valid defaults for all 31 columns."""
    row: dict[str, object] = {c: 0 for c in schema.USER_FEATURE_COLUMNS}
    row.update(
        user_id=user_id, user_active_degree="full_active", follow_user_num_range='"(0,10]"',
        fans_user_num_range="0", friend_user_num_range='"[1,5)"', register_days_range="15-30",
    )  # fmt: skip
    row.update(values)
    return row


def write_user_features(path: Path, rows: list[dict[str, object]]) -> Path:
    return write_csv(path, schema.USER_FEATURE_COLUMNS, [[row[c] for c in schema.USER_FEATURE_COLUMNS] for row in rows])


def write_raw_dir(
    root: Path, early: list[dict[str, int]], late: list[dict[str, int]], features: list[dict[str, object]]
) -> Path:
    """A KuaiRand-1K/data directory with the two standard logs and user features."""
    data = root / "KuaiRand-1K" / "data"
    data.mkdir(parents=True)
    write_log(data / schema.LOG_STANDARD_EARLY, early)
    write_log(data / schema.LOG_STANDARD_LATE, late)
    write_user_features(data / schema.USER_FEATURES, features)
    return data


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file and directory under `root` (relative path -> bytes, None for a directory): to
    prove a directory unchanged, empty directories included."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


# ---- generated, preprocessed data -----------------------------------------------------
def build_processed(root: Path, scale: float = 0.002, seed: int = 3, num_candidates: int = 16,
                    signal: str = DEFAULT_SIGNAL) -> Path:
    """Generate raw files (`data.synthetic --signal signal`) into root/raw and preprocess them into
    root/processed."""
    generate(root / "raw", scale=scale, seed=seed, config=signal_config(signal), progress=False)
    preprocess(root / "raw", root / "processed", PreprocessParams(num_candidates=num_candidates), progress=False)
    return root / "processed"


# ---- model inputs ---------------------------------------------------------------------
NUM_TASKS = 8


@dataclass
class History:
    video_ids: np.ndarray
    action_weights: np.ndarray
    timestamps_ms: np.ndarray
    user_features: np.ndarray  # [F]


@dataclass
class Visit:
    user_id: int
    end: int  # history events [0, end) exist at this visit
    candidates: np.ndarray  # video ids
    window_start: int = 0
    start: int = 0  # first event carried in the batch


def tiny_config(**overrides) -> HSTUConfig:
    overrides.setdefault("user_feature_cardinalities", (3, 5, 4))
    return preset("tiny", **overrides)


def random_histories(rng: np.random.Generator, num_users: int, length: int | tuple[int, int],
                     config: HSTUConfig, first_user: int = 0) -> dict[int, History]:
    histories = {}
    for u in range(first_user, first_user + num_users):
        n = length if isinstance(length, int) else int(rng.integers(length[0], length[1] + 1))
        gaps = rng.choice([0, 1_000, 30_000, 600_000, 7_200_000], size=n)
        histories[u] = History(
            video_ids=rng.integers(0, 50_000, size=n),
            action_weights=rng.integers(0, 256, size=n),
            timestamps_ms=1_649_376_000_000 + np.cumsum(gaps),
            user_features=np.array([rng.integers(0, c) for c in config.user_feature_cardinalities] or [0]),
        )
    return histories


def random_candidates(rng: np.random.Generator, count: int) -> np.ndarray:
    return rng.integers(0, 50_000, size=count)


def make_batch(histories: dict[int, History], visits: list[Visit]) -> VisitBatch:
    def cat(parts, dtype=np.int64):
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)

    hists = [histories[v.user_id] for v in visits]
    prev = [h.timestamps_ms[v.start - 1] if v.start > 0 else h.timestamps_ms[min(v.start, len(h.timestamps_ms) - 1)]
            for v, h in zip(visits, hists)]
    request_times = [h.timestamps_ms[v.end - 1] + 60_000 for v, h in zip(visits, hists)]
    labels = [((v.candidates[:, None] >> np.arange(NUM_TASKS)) & 1).astype(np.float32) for v in visits]
    return VisitBatch(
        request_ids=np.arange(len(visits), dtype=np.int64),
        user_ids=np.array([v.user_id for v in visits], dtype=np.int64),
        request_times_ms=np.array(request_times, dtype=np.int64),
        window_starts=np.array([v.window_start for v in visits], dtype=np.int64),
        starts=np.array([v.start for v in visits], dtype=np.int64),
        history_lengths=np.array([v.end - v.start for v in visits], dtype=np.int64),
        prev_timestamps_ms=np.array(prev, dtype=np.int64),
        user_features=np.stack([h.user_features for h in hists]).astype(np.int64),
        video_ids=cat([h.video_ids[v.start:v.end] for v, h in zip(visits, hists)]),
        action_weights=cat([h.action_weights[v.start:v.end] for v, h in zip(visits, hists)]),
        timestamps_ms=cat([h.timestamps_ms[v.start:v.end] for v, h in zip(visits, hists)]),
        candidate_lengths=np.array([len(v.candidates) for v in visits], dtype=np.int64),
        candidate_video_ids=cat([v.candidates for v in visits]),
        labels=cat(labels, np.float32).reshape(-1, NUM_TASKS),
        candidate_counters=cat([plain_counters(histories, v.user_id, v.end, t, v.candidates)
                                for v, t in zip(visits, request_times)]).reshape(-1, 3, 3),
    )


def plain_action_counts(actions: np.ndarray) -> list[int]:
    """[shown, then the count of each of schema.COUNTED_TASKS] of some events' action_weights."""
    return [len(actions), *(int(np.sum(actions & (1 << schema.TASKS.index(t)) > 0)) for t in schema.COUNTED_TASKS)]


def plain_counters(histories: dict[int, History], user: int, end: int, request_time_ms: int,
                   candidates: np.ndarray) -> np.ndarray:
    """[m, 3, 3] the candidates' counting features (data/candidate_counters.py), counted plainly:
    (user, video, user x video) x (shown, clicks, long views)."""
    counts = plain_action_counts
    own = histories[user]
    videos = np.concatenate([h.video_ids for h in histories.values()])
    actions = np.concatenate([h.action_weights for h in histories.values()])
    times = np.concatenate([h.timestamps_ms for h in histories.values()])
    rows = [[counts(own.action_weights[:end]),
             counts(actions[(videos == c) & (times < request_time_ms)]),
             counts(own.action_weights[:end][own.video_ids[:end] == c])] for c in candidates]
    return np.array(rows, dtype=np.int64).reshape(-1, 3, 3)


def serve(model, kv_cache, histories: dict[int, History], visits: list[Visit], forward=None) -> torch.Tensor:
    """Serve visits as InferenceSession does (None: full recompute of every window), carrying only
    the events to compute; `forward(batch, kv)` replaces `model(batch, kv)` for cached visits.
    -> logits [M, num_tasks]"""
    from model.inference import serve_through_cache

    users = np.array([v.user_id for v in visits])
    ends = np.array([v.end for v in visits])

    def batch_for(starts, window_starts):
        return make_batch(histories, [Visit(v.user_id, v.end, v.candidates, int(w), int(s))
                                      for v, w, s in zip(visits, window_starts, starts)])

    if kv_cache is None:
        windows = model.layout.window_start(ends)
        with torch.inference_mode():
            return model(batch_for(windows, windows))
    return serve_through_cache(model, kv_cache, users, ends, batch_for, forward=forward).logits


def make_cache(config: HSTUConfig, num_pages: int = 256, page_size: int | None = None,
               host_capacity_bytes: int = 1 << 30, dtype: torch.dtype = torch.float32, **kwargs):
    """A cache for `config` that keeps every token (no read window: the parity tests compare against it)."""
    from kvcache import KVCacheManager
    from model.cache_config import kv_cache_config

    return KVCacheManager(kv_cache_config(
        config, num_pages=num_pages, page_size=page_size, keep_unread_kv=True, dtype=dtype,
        host_capacity_bytes=host_capacity_bytes, **kwargs,
    ))


def offline_logits(model, dataset, indices: np.ndarray) -> dict[int, torch.Tensor]:
    """Each visit's logits from the offline replay, one big cache (request index -> [candidates, tasks]):
    what a served answer must equal."""
    from model.inference import InferenceSession

    session = InferenceSession(model, dataset, kv_cache=make_cache(model.config, num_pages=1024))
    out = {}
    for batch in dataset.batches(indices, 4):
        result = session.serve(batch)
        offsets = np.concatenate([[0], np.cumsum(result.candidate_lengths)])
        for b, request in enumerate(result.request_ids.tolist()):
            out[request] = result.logits[offsets[b]:offsets[b + 1]]
    return out


def assert_logits_close(cached: torch.Tensor, full: torch.Tensor, rel: float = 1e-5) -> None:
    scale = max(1.0, float(full.abs().max()))
    diff = float((cached - full).abs().max()) if full.numel() else 0.0
    assert diff <= rel * scale, f"max |cached - full| = {diff:.3g} > {rel:g} x scale {scale:.3g}"


def reference_bucket(distance: int, subdivision: int, num_buckets: int) -> int:
    """model/attention/relative_bias.py's log-linear bucket, from its definition in integer arithmetic."""
    d = max(int(distance), 0)
    if d < 1 << subdivision:
        bucket = d
    else:
        e = d.bit_length() - 1
        bucket = (e - subdivision + 1) * (1 << subdivision) + (d >> (e - subdivision)) - (1 << subdivision)
    return min(bucket, num_buckets - 1)


def reference_bias(bias, query_position: int, key_position: int, query_stamp: int, key_stamp: int) -> torch.Tensor:
    """[H] HSTU's relative bias of one (query, key) pair, from the formula (float64); stamps unpacked
    from their definition (model/attention/token_stamp.py: tag row above 42 bits of ms, -1 for none)."""
    from model.attention.relative_bias import MS_PER_SECOND, NO_TIME, POSITION_SUBDIVISION, TIME_SUBDIVISION

    def unpack(stamp):
        return (NO_TIME, None) if stamp < 0 else (stamp % 2**42, stamp // 2**42)

    (query_time, query_tag), (key_time, key_tag) = unpack(query_stamp), unpack(key_stamp)
    out = torch.zeros(bias.position.shape[0], dtype=torch.float64)
    if bias.tag_match is not None and query_tag and query_tag == key_tag:
        out += bias.tag_match.double()
    if bias.num_position_buckets:
        out += bias.position[:, reference_bucket(query_position - key_position, POSITION_SUBDIVISION,
                                                 bias.num_position_buckets)].double()
    if bias.num_time_buckets:
        if query_time == NO_TIME or key_time == NO_TIME:
            row = bias.num_time_buckets
        else:
            row = reference_bucket((query_time - key_time) // MS_PER_SECOND, TIME_SUBDIVISION, bias.num_time_buckets)
        out += bias.time[:, row].double()
    return out


def dense_hstu_reference(q_hist, q_cand, k_cand, v_cand, k_window, v_window, num_cached, alpha, normalizer,
                         bias=None, window_stamps=None, candidate_stamps=None, key_window=None):
    """One user's HSTU attention straight from the math (docs/model.md, "The layer"), one query row at a time:
    history rows causal over the window, each candidate over the whole window and itself (no tag term);
    with `bias` (a RelativeAttentionBias), its relative bias by window position and `window_stamps` [T] /
    `candidate_stamps` [m];
    with `key_window` (a KeyWindow), only the window's keys of each query and its sink.
    -> (history outputs [n, H, D], candidate outputs [m, H, D])"""
    n, m, T = q_hist.shape[0], q_cand.shape[0], k_window.shape[0]
    keys, values, queries = torch.cat([k_window, k_cand]), torch.cat([v_window, v_cand]), torch.cat([q_hist, q_cand])
    outputs = []
    for i in range(n + m):
        visible = torch.zeros(T + m, dtype=torch.bool)
        key_end = num_cached + i + 1 if i < n else T
        for j in range(key_end):
            visible[j] = key_window is None or key_window.sees(j, key_end)
        if i >= n:
            visible[T + i - n] = True
        logits = alpha * torch.einsum("hd,khd->hk", queries[i], keys)  # [H, T + m]
        if bias is not None:
            position = num_cached + i if i < n else T
            stamp = int(window_stamps[num_cached + i]) if i < n else int(candidate_stamps[i - n])
            key_positions = list(range(T)) + [T] * m  # a candidate sits at the window's end
            key_stamps = [int(t) for t in window_stamps] + [int(t) for t in candidate_stamps]
            pair_bias = [reference_bias(bias, position, key_positions[j], stamp, key_stamps[j]) for j in range(T + m)]
            if i >= n and bias.tag_match is not None and stamp >= 2**42:  # its own key: no tag term
                pair_bias[T + i - n] = pair_bias[T + i - n] - bias.tag_match.double()
            logits = logits + torch.stack(pair_bias, 1).to(logits.dtype)
        a = torch.nn.functional.silu(logits) / normalizer
        outputs.append(torch.einsum("hk,khd->hd", a * visible, values))
    out = torch.stack(outputs) if outputs else queries.new_zeros(0, *queries.shape[1:])
    return out[:n], out[n:]


@dataclass
class AttentionCase:
    """Random q/k/v rows of a batch and, when paged, a shuffled page pool holding every user's window; each
    token's stamp (time and tag; a few window-opening tokens without one), and a random relative bias."""

    cached: list[int]
    new: list[int]
    cands: list[int]
    q: torch.Tensor  # [n_hist + M, H, D]
    k: torch.Tensor
    v: torch.Tensor
    windows: list[tuple[torch.Tensor, torch.Tensor]]  # each user's cached K, V
    addressing: object  # model.attention.KeyAddressing
    keys: torch.Tensor  # the pool's rows (paged) or k
    values: torch.Tensor
    window_stamps: list[torch.Tensor]  # each user's stamps of its whole window (cached, then new) [c + n] int64
    candidate_stamps: list[torch.Tensor]  # [m] int64 each
    query_stamps: torch.Tensor  # [n_hist + M + 1] int64: the rows' stamps (the last: padding query slots)
    key_stamps: torch.Tensor  # the pool's slots' stamps (paged) or query_stamps
    bias: object  # model.attention.RelativeAttentionBias with random tables
    alpha: float = 0.3
    normalizer: float = 64.0
    key_window: object = None  # model.attention.KeyWindow the reference applies

    def rows(self, b: int) -> tuple[slice, slice]:
        """User b's history rows and candidate rows of q/k/v."""
        n_hist, hist_off, cand_off = sum(self.new), np.cumsum([0, *self.new]), np.cumsum([0, *self.cands])
        return slice(hist_off[b], hist_off[b + 1]), slice(n_hist + cand_off[b], n_hist + cand_off[b + 1])

    def bias_inputs(self, device="cpu"):
        from model.attention import BiasInputs

        return BiasInputs(self.query_stamps.to(device), self.key_stamps.to(device))

    def reference(self, b: int, with_bias: bool):
        """(history outputs, candidate outputs) of user b from `dense_hstu_reference`, in float64."""
        h, c = self.rows(b)
        bias = (self.bias, self.window_stamps[b], self.candidate_stamps[b]) if with_bias else (None, None, None)
        return dense_hstu_reference(
            self.q[h].double(), self.q[c].double(), self.k[c].double(), self.v[c].double(),
            torch.cat([self.windows[b][0], self.k[h]]).double(), torch.cat([self.windows[b][1], self.v[h]]).double(),
            self.cached[b], self.alpha, self.normalizer, *bias, key_window=self.key_window,
        )


def paged_attention_case(rng, cached, new, cands, page_size, heads=2, head_dim=8, dtype=torch.float64,
                         position_buckets=81, time_buckets=92, tag_match=True) -> AttentionCase:
    """With `tag_match`, tokens carry tag rows 0-3 (0: unknown) and the bias a random tag-match table."""
    from model.attention import KeyAddressing, RelativeAttentionBias
    from model.attention.relative_bias import NO_TIME
    from model.attention.token_stamp import token_stamps

    n_hist, M = sum(new), sum(cands)
    generator = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    t = lambda rows: torch.randn(rows, heads, head_dim, generator=generator).to(dtype)
    q, k, v = t(n_hist + M), t(n_hist + M), t(n_hist + M)
    windows = [(t(c), t(c)) for c in cached]
    hist_off = np.concatenate([[0], np.cumsum(new)])
    # Times: gaps from a second to a month (every time bucket), the first token of a window without one.
    tags = lambda count: torch.from_numpy(token_stamps(np.zeros(count), rng.integers(0, 4, count))) if tag_match else 0
    window_times, candidate_times = [], []
    for c, n, m in zip(cached, new, cands):
        gaps = rng.choice([0, 999, 1_000, 45_000, 3_600_000, 86_400_000, 2_592_000_000], size=c + n)
        times = torch.from_numpy(1_650_000_000_000 + np.cumsum(gaps))
        times[:1] = NO_TIME
        last = int(times[-1]) if c + n and times[-1] != NO_TIME else 1_650_000_000_000
        window_times.append(torch.where(times < 0, NO_TIME, times | tags(c + n)))
        candidate_times.append(torch.full((m,), last + int(rng.integers(0, 10**7)), dtype=torch.int64) | tags(m))
    query_stamps = torch.cat([*(w[c:] for w, c in zip(window_times, cached)), *candidate_times,
                              torch.tensor([NO_TIME])]).to(torch.int64)
    bias = RelativeAttentionBias(heads, position_buckets, time_buckets, tag_match=tag_match)
    with torch.no_grad():
        bias.position.copy_(torch.randn(bias.position.shape, generator=generator))
        bias.time.copy_(torch.randn(bias.time.shape, generator=generator))
        if tag_match:
            bias.tag_match.copy_(torch.randn(heads, generator=generator))
    common = dict(window_stamps=window_times, candidate_stamps=candidate_times, query_stamps=query_stamps, bias=bias)
    if page_size == 0:
        assert not any(cached)
        return AttentionCase(cached, new, cands, q, k, v, windows, KeyAddressing(0), k, v, key_stamps=query_stamps,
                             **common)
    pages_needed = [-(-(c + n) // page_size) for c, n in zip(cached, new)]
    num_pages = sum(pages_needed) + 3
    order = rng.permutation(num_pages)[: sum(pages_needed)]  # non-contiguous, shuffled pages
    indptr = np.concatenate([[0], np.cumsum(pages_needed)]).astype(np.int64)
    pool_k = torch.full((num_pages * page_size, heads, head_dim), float("nan"), dtype=dtype)  # unused slots poison
    pool_v = pool_k.clone()
    pool_times = torch.full((num_pages * page_size,), -(2**62), dtype=torch.int64)  # unused slots: absurd times
    for b in range(len(cached)):
        window_k = torch.cat([windows[b][0], k[hist_off[b]:hist_off[b + 1]]])
        window_v = torch.cat([windows[b][1], v[hist_off[b]:hist_off[b + 1]]])
        for j in range(len(window_k)):
            slot = order[indptr[b] + j // page_size] * page_size + j % page_size
            pool_k[slot], pool_v[slot], pool_times[slot] = window_k[j], window_v[j], window_times[b][j]
    addressing = KeyAddressing(page_size, indptr, order.astype(np.int64))
    return AttentionCase(cached, new, cands, q, k, v, windows, addressing, pool_k, pool_v, key_stamps=pool_times,
                         **common)


def sensitive_model(config: HSTUConfig, seed: int = 0) -> HSTURecommender:
    """Random weights with large embeddings and relative-bias tables, so every input token, and where and
    when it sits, visibly moves the logits."""
    torch.manual_seed(seed)
    model = HSTURecommender(config).eval()
    with torch.no_grad():
        for table in model.embedder.collection.embeddings.values():
            table.weight.normal_(std=0.5)
        model.embedder.video_bias.weight.normal_(std=0.5)
        if model.counter_features is not None:
            for weight in model.counter_features.parameters():
                weight.normal_(std=0.3)
        for layer in model.layers:  # every position and time bucket visibly moves the scores
            if layer.relative_bias is not None:
                layer.relative_bias.position.normal_(std=1.0)
                layer.relative_bias.time.normal_(std=1.0)
                if layer.relative_bias.tag_match is not None:
                    layer.relative_bias.tag_match.normal_(std=1.0)
    return model


def returning_users(model: HSTURecommender, dataset, count: int = 60, keep_unread_kv: bool = True,
                    **cache_fields) -> tuple[torch.Tensor, int]:
    """Logits of the second half of a replay of `count` visits, served after every user was offloaded and
    evicted from the device (each returning user onloaded from the host tiers), and the host tiers'
    bytes at the end. `cache_fields`: KVCacheConfig fields (codec, tiers); `keep_unread_kv` off: the
    cache has the model's read window."""
    from kvcache import KVCacheManager
    from model.cache_config import kv_cache_config
    from model.inference import InferenceSession

    cache = KVCacheManager(kv_cache_config(
        model.config, num_pages=300, keep_unread_kv=keep_unread_kv, **{"host_capacity_bytes": 1 << 23, **cache_fields},
    ))
    session = InferenceSession(model, dataset, kv_cache=cache)
    indices = dataset.request_indices(max_requests=count)
    with cache:
        for batch in dataset.batches(indices[: count // 2], 4):
            session.serve(batch)
        cache.offload_kv_cache()
        cache.evict_kv_cache()
        results = [session.serve(b) for b in dataset.batches(indices[count // 2:], 4)]
        cache.offload_kv_cache()
        assert cache.stats().onloaded_bytes > 0
        used = cache.host_storage.bytes_used
    assert sum(r.tokens_reused for r in results) > 0
    return torch.cat([r.logits.flatten() for r in results]), used


# ---- host pages (kvcache.PageData) ------------------------------------------------------
def host_pages(layout, n: int, value: float | None = None, seed: int | None = None):
    """`n` host pages: every K/V entry `value` and token i of page p at time int(value) * 1000 + p * page_size + i,
    or (with `seed`) random bits in both (any bit pattern must survive a tier, NaNs included)."""
    from kvcache.page_data import PageData

    shape = (n, *layout.page_shape)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        kv_bits = torch.randint(0, 256, (n * layout.kv_nbytes,), dtype=torch.uint8, generator=g)
        times = torch.randint(-(2**62), 2**62, (n, layout.page_size), dtype=torch.int64, generator=g)
        return PageData(kv_bits.view(layout.dtype).view(shape), times)
    slots = torch.arange(n * layout.page_size, dtype=torch.int64).view(n, layout.page_size)
    return PageData(torch.full(shape, float(value), dtype=layout.dtype), int(value) * 1000 + slots)


def random_tag_table(rng: np.random.Generator, num_tags: int = 12) -> VideoTagTable:
    """Tags for a random half of the video ids random_candidates / random_histories draw from."""
    videos = rng.choice(50_000, size=25_000, replace=False)
    return VideoTagTable.from_pairs(videos, rng.integers(100, 100 + num_tags, size=len(videos)))


def tagged_model(seed: int, table: VideoTagTable, **overrides):
    cfg = tiny_config(num_video_tags=table.num_rows, **overrides)
    model = sensitive_model(cfg, seed)
    model.video_tags = table
    return model


def pages_equal(a, b) -> bool:
    """Bit-identical K/V and times (NaN bits included)."""
    def bits(t):
        return t.contiguous().view(torch.uint8)

    return (a.kv.shape == b.kv.shape and a.kv.dtype == b.kv.dtype and torch.equal(bits(a.kv), bits(b.kv))
            and torch.equal(a.times, b.times))


# ---- baseline inputs ------------------------------------------------------------------
def click_interactions(users, videos, clicks) -> Interactions:
    """Events with only the click task set (the other 7 labels 0)."""
    labels = np.zeros((len(users), NUM_TASKS), dtype=np.float32)
    labels[:, 0] = clicks
    return Interactions(np.asarray(users, np.int64), np.asarray(videos, np.int64), labels)


def block_taste_events(rng: np.random.Generator, n: int, users: int = 40, videos: int = 60) -> Interactions:
    """Random exposures; a user clicks a video of its own parity 80% of the time, another 20%."""
    u, v = rng.integers(0, users, n), rng.integers(0, videos, n)
    return click_interactions(u, v, rng.random(n) < np.where(u % 2 == v % 2, 0.8, 0.2))


def successor(videos: np.ndarray, num_videos: int) -> np.ndarray:
    """The planted transition: the video users act on right after `videos` (a permutation)."""
    return (np.asarray(videos) * 7 + 3) % num_videos


def transition_visits(rng: np.random.Generator, num_visits: int, num_videos: int = 30, history: int = 5,
                      candidates: int = 4, users: int = 200) -> Visits:
    """Visits of random users with random histories; half of each visit's candidates are the successor of
    its last history video, clicked 90% of the time, the others random videos clicked 10% of the time.
    Every video is a successor as often as any other, so nothing but the last event tells them apart."""
    history_videos = rng.integers(0, num_videos, (num_visits, history))
    follows = np.tile(np.arange(candidates) % 2 == 0, num_visits)  # [M]
    visit = np.repeat(np.arange(num_visits), candidates)
    candidate_videos = np.where(follows, successor(history_videos[visit, -1], num_videos),
                                rng.integers(0, num_videos, len(visit)))
    labels = np.zeros((len(visit), NUM_TASKS), dtype=np.float32)
    labels[:, 0] = rng.random(len(visit)) < np.where(candidate_videos == successor(history_videos[visit, -1], num_videos),
                                                     0.9, 0.1)
    return Visits(rng.integers(0, users, num_visits), history_videos, np.zeros_like(history_videos),
                  np.arange(num_visits + 1) * candidates, candidate_videos, labels)


# ---- cache geometry shared by a test and the subprocesses it starts ----------------------
# The tier tests' layout: 2 layers, 1 head, head_dim 2, 4 tokens a page, fp32 -> 128-byte pages.
TINY_LAYOUT_ARGS = dict(num_layers=2, num_heads=1, head_dim=2, page_size=4, dtype=torch.float32)
DISK_RESTART_CFG = dict(num_layers=2, num_heads=2, head_dim=4, page_size=4, num_pages=24, host_capacity_bytes=4096)


def subprocess_env() -> dict[str, str]:
    """Environment for a Python child process that imports `helpers`: the repository, then tests/, on
    its path (in that order, so that tests/kvcache never shadows the kvcache package)."""
    paths = [str(REPO_ROOT), str(REPO_ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


# ---- Redis ----------------------------------------------------------------------------
_NAMESPACES = itertools.count()


def unique_namespace(prefix: str = "test") -> str:
    """A namespace no other test uses (tests share the session server: namespaces, not flushes)."""
    return f"{prefix}-{next(_NAMESPACES)}-{time.time_ns()}"
