"""Token features of a batch, computed on the host: every sparse id the embedder looks up, and
the row each token takes in the layer input.

    event token     = E_video[hash(video)] + E_action[action bits] + E_gap[bucket(t_i - t_{i-1})]
                      + E_hour[hour(t_i)] + E_position[layout position]
                      (+ E_tag[tag row of the video] when the model has a tag table: model/video_tags.py)
                      (+ E_author + E_music + E_duration + E_upload_type of the video, when the model
                      has side features: model/video_side_features.py)
    candidate token = same, with the action replaced by the learned UNKNOWN_ACTION_ID vector,
                      t_i the request time and t_{i-1} the user's last event
    prefix token j  = E_user_feature_j[value_j]            (the contextual prefix)

All of them depend only on the token's own event (and the one before it), never on the
batch or on the current time, which is what keeps cached K/V valid.

Each row also has a stamp (`query_stamps`, the relative attention bias reads it): an event's own
timestamp, a candidate's request time, none (`NO_STAMP`) for a prefix token or a padding row; with
a tag-match bias (`config.tag_match_bias`), the video's tag row packed above the time
(model/attention/token_stamp.py).

Row layout of the layer input x [T, d]: first the history tokens of every user in batch order
(each user's prefix, if this visit opens its window, then its computed events), then the
candidates of every user in batch order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.batch import VisitBatch
from data.jagged import offsets, row_ids_and_ranks
from model.attention.token_stamp import NO_STAMP, token_stamps
from model.batch_shape import BatchShape
from model.config import UNKNOWN_ACTION_ID, HSTUConfig
from model.counter_features import counter_inputs
from model.token_layout import TokenLayout, TokenSpans
from model.video_side_features import SIDE_FEATURES, VideoSideFeatures
from model.video_tags import VideoTagTable

TOKEN_FEATURES = ("video_id", "action", "time_gap", "hour", "position")
VIDEO_TAG = "video_tag"
MS_PER_HOUR = 3_600_000
UTC_OFFSET_HOURS = 8  # KuaiRand timestamps are Beijing time
GAP_BUCKETS_PER_OCTAVE = 3  # time-gap buckets are log2-spaced, 3 per doubling of seconds


def token_feature_names(config: HSTUConfig) -> tuple[str, ...]:
    """The features summed into every event and candidate token of a model with this config."""
    return (TOKEN_FEATURES + ((VIDEO_TAG,) if config.num_video_tags else ())
            + (SIDE_FEATURES if config.side_feature_hash_size else ()))


def hour_of_day(timestamps_ms: np.ndarray) -> np.ndarray:
    return (np.floor_divide(timestamps_ms, MS_PER_HOUR) + UTC_OFFSET_HOURS) % 24


def time_gap_bucket(gap_ms: np.ndarray, num_buckets: int) -> np.ndarray:
    seconds = np.maximum(gap_ms, 0).astype(np.float64) / 1000.0
    bucket = np.floor(GAP_BUCKETS_PER_OCTAVE * np.log2(1.0 + seconds)).astype(np.int64)
    return np.minimum(bucket, num_buckets - 1)


@dataclass(frozen=True)
class TokenFeatures:
    """A batch's sparse ids and token rows (host int64). N events, M candidates, P users opening a window;
    in a bucketed shape the id lists are padded (id 0, row = the scratch row) to fixed lengths."""

    token_ids: dict[str, np.ndarray]  # token_feature_names -> [N + M (+ pad)] ids: events, then candidates
    token_rows: np.ndarray  # [N + M (+ pad)] row of each event / candidate token in x
    prefix_ids: np.ndarray  # [P (+ pad), C] user-feature ids of the users whose visit opens their window
    prefix_rows: np.ndarray  # [P (+ pad), C] rows of their prefix tokens in x
    candidate_video_ids: np.ndarray  # [shape.candidate_rows] hashed video id of each candidate row (0: padding)
    candidate_user_ids: np.ndarray  # [shape.candidate_rows] hashed user id of each candidate row (0: padding)
    candidate_counters: dict[str, np.ndarray]  # the counter term's arrays (model/counter_features.py), candidate rows
    query_stamps: np.ndarray  # [shape.num_rows + 1] stamp of each row of x; NO_STAMP for prefix and padding rows
    shape: BatchShape  # x has shape.num_rows rows (+ the scratch row)


def exact_shape(batch: VisitBatch, spans: TokenSpans) -> BatchShape:
    return BatchShape.exact(batch.batch_size, int(spans.history_lengths.sum()), len(batch.candidate_video_ids))


def token_features(
    config: HSTUConfig, layout: TokenLayout, batch: VisitBatch, spans: TokenSpans, shape: BatchShape | None = None,
    video_tags: VideoTagTable | None = None, side_features: VideoSideFeatures | None = None,
) -> TokenFeatures:
    n_cands = len(batch.candidate_video_ids)
    event_rows, event_ranks = row_ids_and_ranks(batch.history_lengths)
    cand_rows, _ = row_ids_and_ranks(batch.candidate_lengths)

    # Time of the event before each computed event; for a user's first carried event it is
    # batch.prev_timestamps_ms. [N]
    prev_times = np.roll(batch.timestamps_ms, 1)
    first = event_ranks == 0
    prev_times[first] = batch.prev_timestamps_ms[event_rows[first]]
    # Each candidate's history end, time and the time of the last event it sees. [M]
    history_starts = offsets(batch.history_lengths)  # [B + 1] flat index of each user's first carried event
    ends = batch.ends[cand_rows] if batch.candidate_history_ends is None else batch.candidate_history_ends
    times = batch.request_times_ms[cand_rows] if batch.candidate_times_ms is None else batch.candidate_times_ms
    last_seen = ends - 1 - batch.starts[cand_rows]  # rank of that event among the user's carried events
    carried = last_seen >= 0
    last_event = batch.prev_timestamps_ms[cand_rows].copy()
    last_event[carried] = batch.timestamps_ms[history_starts[cand_rows[carried]] + last_seen[carried]]
    ids = {
        "video_id": (np.remainder(batch.video_ids, config.video_hash_size),
                     np.remainder(batch.candidate_video_ids, config.video_hash_size)),
        "action": (batch.action_weights, np.full(n_cands, UNKNOWN_ACTION_ID, dtype=np.int64)),
        "time_gap": (time_gap_bucket(batch.timestamps_ms - prev_times, config.num_time_gap_buckets),
                     time_gap_bucket(times - last_event, config.num_time_gap_buckets)),
        "hour": (hour_of_day(batch.timestamps_ms), hour_of_day(times)),
        "position": (layout.position_ids(batch.starts[event_rows] + event_ranks), layout.position_ids(ends)),
    }
    if config.num_video_tags:
        if video_tags is None:
            raise ValueError("the model embeds video tags (num_video_tags > 0) but has no VideoTagTable")
        ids[VIDEO_TAG] = (video_tags.rows(batch.video_ids), video_tags.rows(batch.candidate_video_ids))
    if config.side_feature_hash_size:
        if side_features is None:
            raise ValueError("the model embeds video side features (side_feature_hash_size > 0) but has no "
                             "VideoSideFeatures")
        events, candidates = side_features.rows(batch.video_ids), side_features.rows(batch.candidate_video_ids)
        ids.update({name: (events[name], candidates[name]) for name in SIDE_FEATURES})
    exact = exact_shape(batch, spans)
    shape = shape or exact
    if not shape.holds(exact):
        raise ValueError(f"a batch of shape {exact} does not fit in {shape}")
    token_starts = offsets(spans.history_lengths)  # [B + 1] first history row of each user (prefix included)
    event_token_rows = token_starts[event_rows] + spans.prefix_lengths[event_rows] + event_ranks
    opening = np.flatnonzero(spans.prefix_lengths > 0)  # [P]
    num_prefix = layout.num_prefix
    token_ids = {name: np.concatenate(parts).astype(np.int64, copy=False) for name, parts in ids.items()}
    token_rows = np.concatenate([event_token_rows, shape.history_rows + np.arange(n_cands, dtype=np.int64)])
    prefix_ids = np.ascontiguousarray(batch.user_features[opening, :num_prefix], dtype=np.int64)
    prefix_rows = token_starts[opening, None] + np.arange(num_prefix, dtype=np.int64)
    candidate_video_ids = np.zeros(shape.candidate_rows, dtype=np.int64)
    candidate_video_ids[:n_cands] = ids["video_id"][1]
    candidate_user_ids = np.zeros(shape.candidate_rows, dtype=np.int64)
    candidate_user_ids[:n_cands] = np.remainder(batch.user_ids[cand_rows], max(config.user_hash_size, 1))
    candidate_counters = counter_inputs(batch.candidate_counters, shape.candidate_rows, config.counter_buckets)
    event_tags, candidate_tags = ids[VIDEO_TAG] if config.tag_match_bias else (None, None)
    query_stamps = np.full(shape.num_rows + 1, NO_STAMP, dtype=np.int64)
    query_stamps[event_token_rows] = token_stamps(batch.timestamps_ms, event_tags)
    query_stamps[shape.history_rows : shape.history_rows + n_cands] = token_stamps(times, candidate_tags)
    if shape != exact:  # fixed lengths: a bucket's token count bounds N + M, its user count P
        pad_tokens, pad_users = shape.num_rows - len(token_rows), shape.users - len(opening)
        token_ids = {name: np.pad(ids, (0, pad_tokens)) for name, ids in token_ids.items()}
        token_rows = np.pad(token_rows, (0, pad_tokens), constant_values=shape.scratch_row)
        prefix_ids = np.pad(prefix_ids, ((0, pad_users), (0, 0)))
        prefix_rows = np.pad(prefix_rows, ((0, pad_users), (0, 0)), constant_values=shape.scratch_row)
    return TokenFeatures(token_ids, token_rows, prefix_ids, prefix_rows, candidate_video_ids, candidate_user_ids,
                         candidate_counters, query_stamps, shape)
