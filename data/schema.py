"""KuaiRand-1K in one place: file names, headers, dtypes, action bits, user features.

Every other module (loader, generator, preprocessor, dataset, tests) asks this file, so
the raw format and the preprocessed format are each defined exactly once.
The facts follow the dataset's published description (KuaiRand, Gao et al., CIKM 2022).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DATASET_NAME = "kuairand-1k"

# ---------------------------------------------------------------- raw files
LOG_STANDARD_EARLY = "log_standard_4_08_to_4_21_1k.csv"
LOG_STANDARD_LATE = "log_standard_4_22_to_5_08_1k.csv"
LOG_RANDOM = "log_random_4_22_to_5_08_1k.csv"
USER_FEATURES = "user_features_1k.csv"
VIDEO_FEATURES_BASIC = "video_features_basic_1k.csv"
VIDEO_FEATURES_STATISTIC = "video_features_statistic_1k.csv"

RAW_FILES = (
    LOG_STANDARD_EARLY,
    LOG_STANDARD_LATE,
    LOG_RANDOM,
    USER_FEATURES,
    VIDEO_FEATURES_BASIC,
    VIDEO_FEATURES_STATISTIC,
)
# The preprocessor reads these, and the video tags of VIDEO_FEATURES_BASIC when the file is there;
# the random log is not part of the users' organic histories.
STANDARD_LOGS = (LOG_STANDARD_EARLY, LOG_STANDARD_LATE)  # file order = tie-break order

# All three logs share this header; every column is int64.
LOG_COLUMNS = (
    "user_id", "video_id", "date", "hourmin", "time_ms",
    "is_click", "is_like", "is_follow", "is_comment", "is_forward", "is_hate",
    "long_view", "play_time_ms", "duration_ms", "profile_stay_time",
    "comment_stay_time", "is_profile_enter", "is_rand", "tab",
)  # fmt: skip
LOG_DTYPE = np.dtype(np.int64)  # of every log column
LOG_ID_COLUMNS = ("user_id", "video_id")  # must be >= 0

# The pipeline reads `video_id`, `tag` and the VIDEO_SIDE_COLUMNS of the basic video features.
# These headers are the generator's representative choice (plausible, not verified against the
# real files); `tag` holds the video's category ids, comma-separated, the primary one first.
VIDEO_BASIC_COLUMNS = (
    "video_id", "author_id", "video_type", "upload_dt", "upload_type", "visible_status",
    "video_duration", "server_width", "server_height", "music_id", "music_type", "tag",
)  # fmt: skip
# The side features the model embeds beside the tag (model/video_catalogue.py), and their types: the
# preprocessor keeps those the basic video features have (`VIDEO_SIDE_FEATURES_FILE`).
VIDEO_SIDE_COLUMNS = {"author_id": "int64", "music_id": "int64", "video_duration": "float64", "upload_type": "string"}
VIDEO_STATISTIC_COLUMNS = (
    "video_id", "counts", "show_cnt", "show_user_num", "play_cnt", "play_user_num",
    "play_duration", "complete_play_cnt", "valid_play_cnt", "long_time_play_cnt",
    "like_cnt", "comment_cnt", "follow_cnt", "share_cnt", "collect_cnt",
)  # fmt: skip

# ---------------------------------------------------------------- dates (UTC+8)
BEIJING_UTC_OFFSET_MS = 8 * 3600 * 1000
DAY_MS = 24 * 3600 * 1000
EARLY_DATES = (20220408, 20220421)  # inclusive, the early standard log
LATE_DATES = (20220422, 20220508)  # inclusive, the late standard log and the random log
DEFAULT_SPLIT_DATE = LATE_DATES[0]  # models train on the early log and are evaluated on the late one
LONG_VIEW_CAP_MS = 18_000  # long_view threshold: min(duration_ms, 18 s)
# Accepted time_ms, [first, last]: 2000-01-01 00:00 UTC up to (not including) 2100-01-01 00:00 UTC.
# KuaiRand-1K is April-May 2022; the window is generous, and keeps every difference of two
# times (visit gaps, sort keys) far from int64 overflow.
TIME_MS_RANGE = (946_684_800_000, 4_102_444_800_000 - 1)
TIME_MS_RANGE_TEXT = "2000-01-01 .. 2100-01-01 (UTC, end excluded)"


def beijing_date_hourmin(time_ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N] epoch ms -> ([N] YYYYMMDD, [N] hour*100), Beijing time, as the log files store them."""
    local_ms = np.asarray(time_ms, dtype=np.int64) + BEIJING_UTC_OFFSET_MS
    day = (local_ms // DAY_MS).astype("datetime64[D]")
    month = day.astype("datetime64[M]")
    year = month.astype("datetime64[Y]").astype(np.int64) + 1970
    month_of_year = month.astype(np.int64) % 12 + 1
    day_of_month = (day - month).astype(np.int64) + 1
    date = year * 10_000 + month_of_year * 100 + day_of_month
    hourmin = (local_ms % DAY_MS) // 3_600_000 * 100
    return date, hourmin


def beijing_midnight_ms(date: int) -> int:
    """YYYYMMDD -> epoch ms of 00:00 Beijing time on that day."""
    day = np.datetime64(f"{date // 10000:04d}-{date // 100 % 100:02d}-{date % 100:02d}", "D")
    return int(day.astype("datetime64[ms]").astype(np.int64)) - BEIJING_UTC_OFFSET_MS


# ---------------------------------------------------------------- actions / tasks
# Task t is bit t of action_weights; ACTION_COLUMNS[t] is the log column holding it.
TASKS = ("click", "like", "follow", "comment", "forward", "hate", "long_view", "profile_enter")
CLICK_BIT = 1 << TASKS.index("click")  # the click bit of action_weights
ACTION_COLUMNS = (
    "is_click", "is_like", "is_follow", "is_comment",
    "is_forward", "is_hate", "long_view", "is_profile_enter",
)  # fmt: skip
NUM_TASKS = len(TASKS)


def action_weights(flags: dict[str, np.ndarray]) -> np.ndarray:
    """Per-row 0/1 action columns -> [N] int64 action_weights = sum_t flag_t << t."""
    out = np.zeros(len(flags[ACTION_COLUMNS[0]]), dtype=np.uint8)  # 8 bits fit; widen once
    for bit, column in enumerate(ACTION_COLUMNS):
        out |= np.asarray(flags[column]).astype(np.uint8) << np.uint8(bit)
    return out.astype(np.int64)


def action_labels(weights: np.ndarray) -> np.ndarray:
    """[N] action_weights -> [N, NUM_TASKS] float32 0/1 labels (column t = bit t)."""
    bits = np.arange(NUM_TASKS, dtype=np.int64)
    return ((np.asarray(weights, dtype=np.int64)[:, None] >> bits) & 1).astype(np.float32)


# The actions the serving counters count besides exposures (data/candidate_counters.py).
COUNTED_TASKS = ("click", "long_view")


def counted_prefix_sums(weights: np.ndarray) -> np.ndarray:
    """[N] action_weights -> [N + 1, len(COUNTED_TASKS)] int32: row i counts each counted action
    among the first i events (so events [a, b) hold row b - row a)."""
    bits = np.array([1 << TASKS.index(t) for t in COUNTED_TASKS], dtype=np.int64)
    positives = (np.asarray(weights, dtype=np.int64)[:, None] & bits) > 0
    out = np.zeros((len(positives) + 1, len(COUNTED_TASKS)), dtype=np.int32)
    np.cumsum(positives, axis=0, dtype=np.int32, out=out[1:])
    return out


# ---------------------------------------------------------------- user features
# The full 31-column header of user_features_1k.csv.
USER_FEATURE_COLUMNS = (
    "user_id", "user_active_degree", "is_lowactive_period", "is_live_streamer",
    "is_video_author", "follow_user_num", "follow_user_num_range", "fans_user_num",
    "fans_user_num_range", "friend_user_num", "friend_user_num_range", "register_days",
    "register_days_range", *(f"onehot_feat{i}" for i in range(18)),
)  # fmt: skip

FOLLOW_RANGES = ("0", "(0,10]", "(10,50]", "(50,100]", "(100,150]", "(150,250]", "(250,500]", "500+")
FANS_RANGES = ("0", "[1,10)", "[10,100)", "[100,1k)", "[1k,5k)", "[5k,1w)", "[1w,10w)", "[10w,100w)")
FRIEND_RANGES = ("0", "[1,5)", "[5,30)", "[30,60)", "[60,120)", "[120,250)", "250+")
REGISTER_DAYS_RANGES = ("15-30", "31-60", "61-90", "91-180", "181-365", "366-730", "730+")
ACTIVE_DEGREES = ("full_active", "high_active", "middle_active", "low_active")
ACTIVE_DEGREE_UNKNOWN = "UNKNOWN"
IS_LIVE_STREAMER_UNKNOWN = -124
ONEHOT_WITH_MISSING = ("onehot_feat4", *(f"onehot_feat{i}" for i in range(12, 18)))


@dataclass(frozen=True)
class UserFeature:
    """One contextual feature: a user-features column encoded as a small int id.

    Id 0 means missing/unknown (an empty cell or one of `unknown`). Text columns
    (`labels` given) number the known labels 1.. in declared order, then any other
    label found in the file in sorted order; integer columns number their distinct
    observed values 1.. in ascending order. The resulting vocabulary is recorded in
    the manifest, so the ids are reproducible and explainable.
    """

    column: str
    labels: tuple[str, ...] | None = None  # text column when given, integer codes otherwise
    unknown: tuple[str | int, ...] = ()  # raw values that mean "unknown" (-> id 0)

    @property
    def is_text(self) -> bool:
        return self.labels is not None


# Categorical / range / binary / one-hot columns, in the order of the encoded features.
# Raw counts (follow_user_num, fans_user_num, friend_user_num, register_days) are
# represented by their *_range column.
CONTEXT_FEATURES = (
    UserFeature("user_active_degree", ACTIVE_DEGREES, unknown=(ACTIVE_DEGREE_UNKNOWN,)),
    UserFeature("is_lowactive_period"),
    UserFeature("is_live_streamer", unknown=(IS_LIVE_STREAMER_UNKNOWN,)),
    UserFeature("is_video_author"),
    UserFeature("follow_user_num_range", FOLLOW_RANGES),
    UserFeature("fans_user_num_range", FANS_RANGES),
    UserFeature("friend_user_num_range", FRIEND_RANGES),
    UserFeature("register_days_range", REGISTER_DAYS_RANGES),
    *(UserFeature(f"onehot_feat{i}") for i in range(18)),
)
CONTEXT_FEATURE_NAMES = tuple(f.column for f in CONTEXT_FEATURES)

# ---------------------------------------------------------------- preprocessed output
SCHEMA_VERSION = 1
SEQUENCES_FILE = "sequences.parquet"
REQUESTS_FILE = "requests.parquet"
MANIFEST_FILE = "manifest.json"
VIDEO_TAGS_FILE = "video_tags.parquet"  # video_id, tag (int64): written when the raw video features exist
# video_id and the VIDEO_SIDE_COLUMNS the raw video features have: written when they have any
VIDEO_SIDE_FEATURES_FILE = "video_side_features.parquet"
OUTPUT_FILES = (SEQUENCES_FILE, REQUESTS_FILE, MANIFEST_FILE)  # every output has these
OPTIONAL_OUTPUT_FILES = (VIDEO_TAGS_FILE, VIDEO_SIDE_FEATURES_FILE)
WRITTEN_FILES = OUTPUT_FILES + OPTIONAL_OUTPUT_FILES  # everything an output directory may hold
SEQUENCE_LIST_COLUMNS = ("video_ids", "action_weights", "timestamps")  # list<int64>, per user
REQUEST_COLUMNS = ("request_id", "user_id", "time_ms", "start", "end", "num_candidates")  # int64
