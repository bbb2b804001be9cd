"""HSTUConfig: every hyper-parameter of the ranking model, and named presets."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from data.schema import TASKS
from kvcache.read_window import ReadWindow
from model.attention.relative_bias import MAX_POSITION_BUCKETS, MAX_TIME_BUCKETS

if TYPE_CHECKING:
    from data.dataset import InferenceDataset

NUM_ACTION_IDS = 256  # action_weights is an 8-bit mask
UNKNOWN_ACTION_ID = NUM_ACTION_IDS  # a candidate's action is not known yet: its own learned vector
MIN_HEAD_DIM = 16


@dataclass(frozen=True)
class HSTUConfig:
    # Transformer
    num_layers: int = 3
    hidden_dim: int = 512  # token embedding / residual stream width
    num_heads: int = 4
    head_dim: int = 128  # q, k, v and u all use num_heads x head_dim
    max_seq_len: int = 4096  # N: the attention normaliser and the most history tokens in a window
    # HSTU's relative attention bias (model/attention/relative_bias.py): per layer and head, a learned
    # offset per bucket of query-key distance in positions and in seconds; 0 buckets = no such bias.
    num_position_buckets: int = 0
    num_time_buckets: int = 0
    # A per-head offset in the attention when a key's video tag is the query's (needs num_video_tags).
    tag_match_bias: bool = False
    window_stride: int = 1024  # a window restart moves the window start by multiples of this (events)
    # Sliding-window attention (model/attention/base.py KeyWindow): each query sees its last
    # attention_window keys and the contextual prefix; 0 = every key of the window. A model trained on
    # crops of its last K events is served the same view when this is K (docs/model.md).
    attention_window: int = 0
    dropout: float = 0.0  # used in training only
    # Training only: the share of event and candidate tokens whose video-id row is left out of the sum, so
    # that the tag and the context must carry a video too (its id row is only learnt where it repeats).
    id_dropout: float = 0.0
    # Embeddings (all through one TorchRec EmbeddingCollection)
    video_hash_size: int = 1_000_003  # video ids are hashed (mod a prime) into this many rows
    # Rows of the video-tag embedding (model/video_tags.py: unknown + one per tag); 0 = no tag feature.
    num_video_tags: int = 0
    # Rows of the author and music embeddings (model/video_side_features.py: ids hashed into them, beside
    # a duration and an upload-type embedding); 0 = no side features.
    side_feature_hash_size: int = 0
    num_time_gap_buckets: int = 64
    position_table_size: int = 8192  # token positions are clamped to this table
    user_feature_cardinalities: tuple[int, ...] = ()  # one contextual prefix token per feature
    use_contextual_prefix: bool = True
    # Head
    num_tasks: int = len(TASKS)
    mlp_hidden_dim: int = 512
    # The candidate-only user-taste term (model/user_taste.py): user ids hashed (mod a prime) into
    # this many rows, 0 = no term; its user and video factors have user_factor_dim entries.
    user_hash_size: int = 0
    user_factor_dim: int = 16
    # The candidate-only counter term (model/counter_features.py): evidence buckets per counter
    # family (log2 of the count, capped at this many - 1); 0 = no term.
    counter_buckets: int = 0
    # Serving
    page_size: int = 32  # KV cache page size (tokens) suggested for this model

    def __post_init__(self) -> None:
        checks = {
            "num_layers must be >= 1": self.num_layers >= 1,
            "num_heads must be >= 1": self.num_heads >= 1,
            # The Triton attention kernel multiplies [rows, head_dim] tiles with tl.dot, which compiles
            # only for power-of-two widths of at least 16 (the sm90 compile refuses 8 and 96; the CPU
            # interpreter would accept them, so the check lives here, where every model starts).
            f"head_dim must be a power of two >= {MIN_HEAD_DIM} (the Triton attention kernel's tl.dot tiles), "
            f"got {self.head_dim}": self.head_dim >= MIN_HEAD_DIM and self.head_dim & (self.head_dim - 1) == 0,
            "max_seq_len must exceed the contextual prefix": self.max_seq_len > self.num_prefix_tokens,
            "window_stride must be in [1, max_seq_len - prefix]": 1
            <= self.window_stride
            <= self.max_seq_len - self.num_prefix_tokens,
            "attention_window must be >= 0": self.attention_window >= 0,
            "position_table_size must be >= 1": self.position_table_size >= 1,
            "num_time_gap_buckets must be >= 1": self.num_time_gap_buckets >= 1,
            "video_hash_size must be >= 1": self.video_hash_size >= 1,
            "num_video_tags must be >= 0": self.num_video_tags >= 0,
            "side_feature_hash_size must be 0 or >= 2": self.side_feature_hash_size == 0 or self.side_feature_hash_size >= 2,
            "tag_match_bias needs video tags (num_video_tags > 0)": not self.tag_match_bias or self.num_video_tags > 0,
            "user_hash_size must be >= 0": self.user_hash_size >= 0,
            "user_factor_dim must be >= 1": self.user_factor_dim >= 1,
            "counter_buckets must be >= 0": self.counter_buckets >= 0,
            f"num_position_buckets must be in [0, {MAX_POSITION_BUCKETS}]": 0 <= self.num_position_buckets
            <= MAX_POSITION_BUCKETS,
            f"num_time_buckets must be in [0, {MAX_TIME_BUCKETS}]": 0 <= self.num_time_buckets <= MAX_TIME_BUCKETS,
            "dropout must be in [0, 1)": 0.0 <= self.dropout < 1.0,
            "id_dropout must be in [0, 1)": 0.0 <= self.id_dropout < 1.0,
            "user feature cardinalities must be >= 1": all(c >= 1 for c in self.user_feature_cardinalities),
        }
        failed = [msg for msg, ok in checks.items() if not ok]
        if failed:
            raise ValueError("Invalid HSTUConfig: " + "; ".join(failed))

    @property
    def num_prefix_tokens(self) -> int:
        """C: contextual tokens (one per user feature) at the start of every window."""
        return len(self.user_feature_cardinalities) if self.use_contextual_prefix else 0

    @property
    def cache_read_window(self) -> ReadWindow | None:
        """The cached tokens the sliding attention window still reads (its last `attention_window` keys and
        the contextual prefix), for `KVCacheConfig.read_window`; None when every query sees every key."""
        window = self.attention_window
        return ReadWindow(size=window, sink=self.num_prefix_tokens) if window else None

    @property
    def attention_dim(self) -> int:
        return self.num_heads * self.head_dim

    def replace(self, **changes) -> HSTUConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["user_feature_cardinalities"] = list(self.user_feature_cardinalities)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> HSTUConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"Unknown HSTUConfig fields: {unknown}")
        d = dict(d)
        if "user_feature_cardinalities" in d:
            d["user_feature_cardinalities"] = tuple(d["user_feature_cardinalities"])
        return cls(**d)


# Every distance up to 4096 positions has a bucket of its own range (8 per doubling), and so has every
# distance in seconds up to the cap of ~194 days (4 per doubling).
_RELATIVE_BIAS = dict(num_position_buckets=81, num_time_buckets=MAX_TIME_BUCKETS)

_PRESETS: dict[str, HSTUConfig] = {
    # The published KuaiRand-1K HSTU shape: 3 layers, hidden 512, 4 heads x 128.
    "kuairand-1k": HSTUConfig(user_hash_size=10_007, counter_buckets=8, **_RELATIVE_BIAS),
    # Small enough to train in minutes on 2 CPU cores, large enough that compute dominates.
    "demo": HSTUConfig(
        hidden_dim=256, num_heads=4, head_dim=64, max_seq_len=2048, window_stride=512,
        video_hash_size=200_003, mlp_hidden_dim=256, position_table_size=4096, user_hash_size=10_007,
        counter_buckets=8, **_RELATIVE_BIAS,
    ),
    # Unit tests: tiny and fast.
    "tiny": HSTUConfig(
        num_layers=2, hidden_dim=32, num_heads=2, head_dim=16, max_seq_len=256, window_stride=64,
        video_hash_size=1009, num_time_gap_buckets=16, position_table_size=512,
        mlp_hidden_dim=32, page_size=4, user_hash_size=101, counter_buckets=8, **_RELATIVE_BIAS,
    ),
}

PRESET_NAMES = tuple(_PRESETS)


def preset(name: str, **overrides) -> HSTUConfig:
    """A named configuration, optionally with fields replaced (e.g. the dataset's feature vocab)."""
    if name not in _PRESETS:
        raise ValueError(f"Unknown preset {name!r}; choose one of {', '.join(PRESET_NAMES)}")
    return _PRESETS[name].replace(**overrides)


__all__ = ["NUM_ACTION_IDS", "PRESET_NAMES", "UNKNOWN_ACTION_ID", "HSTUConfig", "preset"]


def config_for_dataset(preset_name: str, dataset: InferenceDataset) -> HSTUConfig:
    """The preset with the dataset's user-feature vocabulary (the contextual prefix)."""
    return preset(preset_name, user_feature_cardinalities=tuple(dataset.user_feature_cardinalities))
