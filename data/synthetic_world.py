"""The synthetic world: users, videos, clusters, tastes, and the actions they lead to.

The planted signal has up to three parts, all in logit ("affinity") units:
    taste       log(K * taste[user, cluster(video)]): each user prefers a few of K video clusters
    quality     a per-video offset: some videos are liked by everyone more than others
    propensity  a per-user offset: some users act on everything more than others
`SIGNALS` names the mixes the generator offers: "item" (taste + quality: which videos a user
likes, nothing a model can read off the user's own click rate), "user" (taste + propensity,
dominated by the propensity), "mixed" (all three, the default) and "sequential" (a broad, half-weight
taste, and what the user clicked lately: `SequentialRules`, which makes the order of events matter).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from data import schema

T0 = schema.beijing_midnight_ms(schema.EARLY_DATES[0])  # 2022-04-08 00:00 +08:00
T_LATE = schema.beijing_midnight_ms(schema.LATE_DATES[0])
T_END = schema.beijing_midnight_ms(schema.LATE_DATES[1]) + schema.DAY_MS  # exclusive
NUM_DAYS = (T_END - T0) // schema.DAY_MS  # 31
LATE_DAY = (T_LATE - T0) // schema.DAY_MS  # 14


@dataclass(frozen=True)
class SequentialRules:
    """How a user's recent events move what the user is shown and clicks next
    (data/synthetic_sequence.py; docs/data.md says why these rules). Two traces per user over the
    clusters, each halving every `*_half_life_events` events and every `*_half_life_hours` hours:
        interest  clicks: one on cluster c counts 1 for c and `successor_share` for c's successor
        fatigue   exposures: every video shown counts 1 for its cluster
    A cluster's recent share is its interest over the total, smoothed by `interest_prior_clicks`
    clicks spread evenly. The feed draws `feed_follows_interest` of the exposures from the recent
    shares, and an event of cluster c gets, in affinity units,
        interest_weight * log(K * recent share of c) - fatigue_weight * fatigue[c].
    Zero weights (the default) leave the events independent of their order."""

    interest_weight: float = 0.0
    interest_half_life_events: float = 24.0
    interest_half_life_hours: float = 48.0
    interest_prior_clicks: float = 2.0
    successor_share: float = 1.0
    feed_follows_interest: float = 0.0
    fatigue_weight: float = 0.0
    fatigue_half_life_events: float = 3.0
    fatigue_half_life_hours: float = 0.25
    calibration_events: int = 512  # per user: the prefix the click intercept is calibrated on

    def __post_init__(self):
        for name in ("interest_weight", "successor_share", "fatigue_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"SequentialRules.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.feed_follows_interest <= 1:
            raise ValueError(f"SequentialRules.feed_follows_interest must be in [0, 1], got {self.feed_follows_interest}")
        for name in ("interest_half_life_events", "interest_half_life_hours", "interest_prior_clicks",
                     "fatigue_half_life_events", "fatigue_half_life_hours", "calibration_events"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SequentialRules.{name} must be > 0, got {getattr(self, name)}")

    @property
    def active(self) -> bool:
        return self.interest_weight > 0 or self.fatigue_weight > 0 or self.feed_follows_interest > 0


@dataclass(frozen=True)
class SyntheticConfig:
    """Statistics of the generated data; sizes are those of scale 1.0 (the real dataset).
    Rates marked unverified in KUAIRAND_1K.md are plain defaults here."""

    num_users: int = 1000
    standard_rows: int = 11_713_045  # both standard logs, duplicates included
    random_rows: int = 43_028
    num_videos: int = 4_371_900
    # A catalogue of this many videos at any scale (a "dense" catalogue: each video is seen many times),
    # instead of num_videos x scale (the real catalogue's long tail: most videos are seen once or twice).
    catalogue_videos: int | None = None
    # activity
    events_per_user_sigma: float = 0.87  # lognormal: mean/median ~1.46 as in the real logs
    late_joiner_fraction: float = 0.017  # users absent from the early log (983 of 1000 present)
    session_mean_events: float = 32.0
    screen_mean_items: float = 2.5  # items shown together share one time_ms
    screen_gap_mean_s: float = 15.0
    duplicate_fraction: float = 0.008  # exact copies written right after the original row
    swap_fraction: float = 0.002  # adjacent same-user rows written in swapped order
    nonpositive_duration_fraction: float = 0.08
    long_view_rule_break_fraction: float = 0.005  # of rows with duration_ms > 0
    # items and the planted signal
    num_clusters: int = 64
    taste_concentration: float = 0.3  # Dirichlet alpha over clusters; small = peaked tastes
    taste_exposure: float = 0.7  # share of exposures drawn from the user's taste
    popularity_exponent: float = 2.0  # within-cluster rank = size * u**exponent (heavy head)
    signal_strength: float = 0.8  # logit slope in log(num_clusters * taste)
    taste_weight: float = 1.0  # scales the cluster-taste part of the affinity
    # The `tag` of the basic video features: a cluster is a content category, and a video's primary
    # tag names its cluster's category for this share of the videos (the rest carry a random one:
    # labels are noisy, and a taste group need not be one category); some videos list a second tag.
    tag_fidelity: float = 0.8
    second_tag_share: float = 0.3
    # Coarse tags: one category names this many clusters (a platform's top-level category spans several
    # taste groups), so a tag narrows a video down to them but not to one.
    clusters_per_tag: int = 1
    # Authors: each uploads videos of one cluster for this share of its videos (creators specialise),
    # the rest of any cluster; a cluster has catalogue / (num_clusters x videos_per_author) authors.
    author_fidelity: float = 0.8
    videos_per_author: float = 20.0
    # per-user action logit offset (some users click far more than others): a user-level signal
    user_propensity_std: float = 1.0
    item_quality_std: float = 0.8  # per-video action logit offset: an item-level signal
    # standard-log positive rates, in schema.TASKS order
    rates: tuple[float, ...] = (0.378, 0.0156, 0.0010, 0.0030, 0.0020, 0.0005, 0.262, 0.0179)
    long_view_click_share: float = 0.993  # of long views that also have a click
    random_click_rate: float = 0.174
    random_long_view_rate: float = 0.084
    tab_shares: tuple[tuple[int, float], ...] = ((1, .659), (0, .206), (4, .076), (2, .034), (6, .016))
    # the remaining share of tabs is spread evenly over the other tab values 0..14
    sequence: SequentialRules = field(default_factory=SequentialRules)  # off unless its weights are set


# The signal mixes: SyntheticConfig fields each one sets.
SIGNALS: dict[str, dict[str, object]] = {
    "item": {"user_propensity_std": 0.0, "item_quality_std": 0.8},
    "user": {"user_propensity_std": 1.0, "item_quality_std": 0.0},
    "mixed": {"user_propensity_std": 1.0, "item_quality_std": 0.8},
    # Broad long-term tastes (a uniform Dirichlet) at half weight; what a user is into right now comes
    # from recent clicks (docs/data.md, "Sequential signal").
    "sequential": {
        "user_propensity_std": 0.0, "item_quality_std": 0.0, "taste_concentration": 1.0, "taste_weight": 0.5,
        "sequence": SequentialRules(interest_weight=1.0, feed_follows_interest=0.5, fatigue_weight=0.3),
    },
}
DEFAULT_SIGNAL = "mixed"


def signal_config(signal: str, **overrides) -> SyntheticConfig:
    """The SyntheticConfig of a named signal mix (`SIGNALS`), with other fields replaced."""
    if signal not in SIGNALS:
        raise ValueError(f"unknown signal {signal!r}; choose one of {', '.join(SIGNALS)}")
    return SyntheticConfig(**{**SIGNALS[signal], **overrides})


@dataclass(frozen=True)
class World:
    num_users: int
    num_videos: int
    events_per_user: np.ndarray  # [U] target events (before duplicates)
    first_day: np.ndarray  # [U] 0, or the first late day for late joiners
    taste: np.ndarray  # [U, K]
    cluster_share: np.ndarray  # [K] global exposure share of each cluster
    cluster_offset: np.ndarray  # [K + 1] videos of cluster c have rank index [off[c], off[c+1])
    video_of_index: np.ndarray  # [V] cluster-major index -> video_id (a random permutation)
    video_cluster: np.ndarray  # [V] video_id -> cluster
    video_duration_ms: np.ndarray  # [V] intrinsic duration by video_id
    propensity: np.ndarray  # [U] user's action offset, in affinity units (0 without a user-level signal)
    quality: np.ndarray  # [V] video's action offset by video_id, in affinity units (0 without one)
    taste_weight: float = 1.0  # SyntheticConfig.taste_weight

    @classmethod
    def draw(cls, rng: np.random.Generator, scale: float, cfg: SyntheticConfig) -> World:
        num_users = max(2, round(cfg.num_users * scale**0.5))
        num_videos = cfg.catalogue_videos or max(cfg.num_clusters, round(cfg.num_videos * scale))
        weight = rng.lognormal(0.0, cfg.events_per_user_sigma, num_users)
        events = cfg.standard_rows * scale / (1 + cfg.duplicate_fraction) * weight / weight.sum()
        events = np.maximum(np.round(events), 4).astype(np.int64)
        late = rng.random(num_users) < cfg.late_joiner_fraction
        taste = rng.dirichlet(np.full(cfg.num_clusters, cfg.taste_concentration), num_users)
        cluster_share = rng.dirichlet(np.full(cfg.num_clusters, 2.0))
        sizes = np.full(cfg.num_clusters, num_videos // cfg.num_clusters)
        sizes[: num_videos % cfg.num_clusters] += 1
        offset = np.concatenate(([0], np.cumsum(sizes)))
        video_of_index = rng.permutation(num_videos)
        video_cluster = np.empty(num_videos, dtype=np.int64)
        video_cluster[video_of_index] = np.repeat(np.arange(cfg.num_clusters), sizes)
        duration = np.clip(rng.lognormal(np.log(25_000), 0.8, num_videos), 3_000, 600_000).astype(np.int64)
        propensity = rng.normal(0.0, cfg.user_propensity_std / cfg.signal_strength, num_users)
        quality = rng.normal(0.0, cfg.item_quality_std / cfg.signal_strength, num_videos)
        return cls(
            num_users, num_videos, events, np.where(late, LATE_DAY, 0), taste, cluster_share, offset,
            video_of_index, video_cluster, duration, propensity, quality, cfg.taste_weight,
        )

    def affinity(self, user: np.ndarray, video: np.ndarray) -> np.ndarray:
        """[N] log(K * taste of the user for the video's cluster), clipped, plus the video's quality
        and the user's propensity: 0 = an average user, indifferent to the cluster, average video."""
        return self.taste_affinity(user, video) + self.quality[video] + self.propensity[user]

    def taste_affinity(self, user: np.ndarray, video: np.ndarray) -> np.ndarray:
        """[N] the cluster-taste part of `affinity` alone."""
        return self.taste_weight * _taste_logit(self.taste[user, self.video_cluster[video]], self.taste.shape[1])

    def cluster_taste_affinity(self) -> np.ndarray:
        """[U, K] `taste_affinity` of every user for a video of every cluster."""
        return self.taste_weight * _taste_logit(self.taste, self.taste.shape[1])

    def cluster_exposure_probability(self, taste_exposure: float) -> np.ndarray:
        """[U, K] the chance that `sample_videos` draws a user's next video from each cluster."""
        return taste_exposure * self.taste + (1 - taste_exposure) * self.cluster_share / self.cluster_share.sum()

    def sample_videos(
        self, rng: np.random.Generator, user: np.ndarray, taste_exposure: float, exponent: float
    ) -> np.ndarray:
        """[N] users -> [N] video ids: cluster from the user's taste (or the global mix), then a
        heavy-headed rank inside the cluster."""
        n, (num_users, k) = len(user), self.taste.shape
        from_taste = rng.random(n) < taste_exposure
        # Inverse-CDF over each user's taste row at once: row u's CDF is shifted by u, so one
        # searchsorted over the flattened matrix serves every user.
        cdf = np.cumsum(self.taste, axis=1)
        cdf /= cdf[:, -1:]
        shifted = (cdf + np.arange(num_users)[:, None]).ravel()
        cluster = np.searchsorted(shifted, user + rng.random(n) * (1 - 1e-12), side="right") - user * k
        global_cdf = np.cumsum(self.cluster_share)
        global_pick = np.searchsorted(global_cdf / global_cdf[-1], rng.random(n) * (1 - 1e-12), side="right")
        cluster = np.where(from_taste, np.minimum(cluster, k - 1), global_pick)
        return self.video_in_cluster(cluster, rng.random(n), exponent)

    def video_in_cluster(self, cluster: np.ndarray, uniform: np.ndarray, exponent: float) -> np.ndarray:
        """[N] clusters, [N] uniforms in [0, 1) -> [N] video ids: rank size * uniform**exponent inside
        the cluster, so its first-ranked videos are shown most (a heavy head)."""
        size = np.diff(self.cluster_offset)[cluster]
        rank = np.minimum((size * uniform**exponent).astype(np.int64), size - 1)
        return self.video_of_index[self.cluster_offset[cluster] + rank]



def _taste_logit(taste: np.ndarray, num_clusters: int) -> np.ndarray:
    """log(K x taste), clipped: 0 for a user indifferent to the cluster."""
    return np.clip(np.log(num_clusters * taste + 1e-12), -4.0, 3.0)


def draw_actions(
    rng: np.random.Generator, z: np.ndarray, rates: tuple[float, ...], cfg: SyntheticConfig
) -> dict[str, np.ndarray]:
    """[N] affinities -> the 8 action flags. Click, and given a click long_view, like, follow,
    comment, forward and profile_enter, rise with affinity; hate falls with it. Intercepts
    are calibrated so each overall rate matches `rates`."""
    slope = cfg.signal_strength
    click_rate = dict(zip(schema.TASKS, rates))["click"]
    click = rng.random(len(z)) < sigmoid(intercept(z, slope, click_rate) + slope * z)
    return draw_actions_given_clicks(rng, z, click, rates, cfg)


def draw_actions_given_clicks(
    rng: np.random.Generator, z: np.ndarray, click: np.ndarray, rates: tuple[float, ...], cfg: SyntheticConfig
) -> dict[str, np.ndarray]:
    """`draw_actions` once the clicks are drawn: the other 7 flags, from the same affinities."""
    rate = dict(zip(schema.TASKS, rates))
    slope = cfg.signal_strength
    clicked = z[click]
    out = {"click": click}
    lv_click = rate["long_view"] * cfg.long_view_click_share / rate["click"]
    lv_other = rate["long_view"] * (1 - cfg.long_view_click_share) / (1 - rate["click"])
    p_lv = np.full(len(z), lv_other)
    p_lv[click] = sigmoid(intercept(clicked, slope, lv_click) + slope * clicked)
    out["long_view"] = rng.random(len(z)) < p_lv
    for task in ("like", "follow", "comment", "forward", "profile_enter"):
        p = np.zeros(len(z))
        p[click] = sigmoid(intercept(clicked, slope / 2, rate[task] / rate["click"]) + slope / 2 * clicked)
        out[task] = rng.random(len(z)) < p
    out["hate"] = rng.random(len(z)) < sigmoid(intercept(z, -slope / 2, rate["hate"]) - slope / 2 * z)
    return {column: out[task].astype(np.int64) for task, column in zip(schema.TASKS, schema.ACTION_COLUMNS)}



def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def intercept(z: np.ndarray, slope: float, target: float) -> float:
    """b with mean(sigmoid(b + slope * z)) == target (bisection on a fixed subsample)."""
    if len(z) == 0:
        return 0.0
    sample = z[:: max(1, len(z) // 200_000)]
    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sigmoid(mid + slope * sample).mean() < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
