"""What a training run is given (TrainParams, the named recipes) and what it reports.

    params = TrainParams(preset="demo", epochs=2, seed=0)
    train_idx, holdout_idx = split_requests(dataset, params)   # the visits before the split date
    model, report = model.train.train(dataset, params)         # report: TrainReport, one EpochReport an epoch
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from data.dataset import InferenceDataset
from data.schema import DEFAULT_SPLIT_DATE, beijing_midnight_ms
from model.metrics import SELECT_ON


@dataclass(frozen=True)
class TrainParams:
    preset: str = "demo"
    split_date: int = DEFAULT_SPLIT_DATE
    holdout_fraction: float = 0.1
    # At most; the holdout keeps the best epoch. The cosine decay spans these epochs, so a short plan
    # lowers the rate while the model still generalises: on the demo-sized logs every run's best
    # holdout epoch was the first or second, and planning 2 instead of 8 gained +0.011 click AUC on
    # mixed data (item-level: the same).
    epochs: int = 2
    patience: int = 2  # epochs without a better holdout score before stopping
    # What "better" means: "click_auc" (the ranking the model is for) or "loss" (the mean holdout BCE
    # over all tasks). On the demo-sized logs consecutive epochs' losses differed by < 0.5% while
    # their click AUCs differed by ~0.01, and the loss kept the worse ranker as often as not.
    select_on: str = "click_auc"
    batch_size: int = 16
    learning_rate: float = 2e-3
    embedding_learning_rate: float = 1e-2
    # The per-video logit offsets: Adam moves a row by about the learning rate each time its video is
    # seen, so a video seen a handful of times needs a large rate to reach its log-odds.
    video_bias_learning_rate: float = 0.1
    # The user-taste tables (model/user_taste.py) and an L2 on the rows a batch's candidates read.
    taste_learning_rate: float = 0.02
    taste_l2: float = 0.1
    # The counter term (model/counter_features.py): a few hundred weights read by every batch, whose
    # targets are around a logit; at the layers' rate they would barely move in an epoch.
    counter_learning_rate: float = 0.05
    # Epochs the candidate-only terms (video_bias, user taste, counters) wait, at rate 0, before they
    # train, so that the sequence path learns first: +0.005 click AUC on static-taste data, -0.009 on
    # order and -0.012 on mixed data (docs/model.md, "A delayed start for the candidate-only terms").
    candidate_terms_delay_epochs: int = 0
    # Weight of the auxiliary next-clicked-item loss on the history tokens (model/next_item_loss.py),
    # beside the candidates' BCE; 0: off. At 0.01: +0.018 click AUC on static-taste data, -0.006 and
    # -0.016 on order, neutral on mixed (docs/model.md, "An auxiliary next-clicked-item loss").
    next_item_loss_weight: float = 0.0
    # L2 on the per-video rows a batch reads (token video embeddings, video_bias): a video seen once
    # or twice would otherwise memorise its training labels (the holdout loss rises from epoch 2).
    video_l2: float = 0.0
    # Dropout of a fresh model's layers: on the demo-sized logs the holdout loss is best after one or
    # two epochs; 0.3 scored +0.005 click AUC over 0.1 on mixed data and the same on item-level data.
    dropout: float = 0.3
    warmup_steps: int = 20  # linear warm-up, then cosine decay to 10% over the planned steps
    max_history_events: int | None = 128  # training crops each visit to its last events (None: whole window)
    # The sliding attention window of a fresh model (HSTUConfig.attention_window): None serves the crop
    # it was trained on (max_history_events; the whole window without a crop), 0 the whole window.
    attention_window: int | None = None
    # Each visit's last events scored as targets too, each seeing only the events before it
    # (InferenceDataset.make_batch(history_targets=)); 0: the visits' candidates only.
    history_targets: int = 0
    # The absolute position table of a fresh model (HSTUConfig.position_table_size, saved in the
    # checkpoint and read by serving): None keeps the preset's; 1 gives every token one position row,
    # which removes absolute positions and leaves order to the relative bias.
    position_table_size: int | None = None
    # Id rows of a fresh model (HSTUConfig.video_hash_size, .user_hash_size); None keeps the preset's.
    # One video row and no user rows leave the model nothing to memorise per id (docs/model.md).
    video_hash_size: int | None = None
    user_hash_size: int | None = None
    # Embed each token's video tag (model/video_tags.py; the dataset must have tags). Off by default: on
    # the demo-sized data it gained no AUC (docs/model.md, "Video tags") and cost ~8% of the cached path.
    video_tags: bool = False
    # A fresh model's start, so that its first attention matches the tags of the history: the tag
    # table drawn at this std (None: the 0.02 of every table), which makes the tag most of a token's
    # normalised input, and each layer's key projection a copy of its query projection, which makes
    # q.k a similarity of the two tokens. Both, in the sequence recipe: +0.017 to +0.030 click AUC on
    # sequential data, +0.034 to +0.039 on item-taste, +0.003 to +0.006 on mixed (seeds 0-2; docs/model.md,
    # "An attention that starts by matching tags").
    tag_embedding_std: float | None = None
    tied_query_key_init: bool = False
    # A fresh model's attention adds a learned offset per head and layer where a key's tag is the
    # query's (HSTUConfig.tag_match_bias; needs video_tags): the tag share of the history in one term.
    tag_match_bias: bool = False
    # The tag-match offset every head starts from (None: relative_bias.TAG_MATCH_PRIOR).
    tag_match_prior: float | None = None
    # The relative bias tables' own rate (position, time, tag match); None: the layers' learning_rate.
    bias_learning_rate: float | None = None
    max_train_requests: int | None = None
    max_train_seconds: float | None = None
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.select_on not in SELECT_ON:
            raise ValueError(f"select_on must be one of {', '.join(SELECT_ON)}, got {self.select_on!r}")
        if self.candidate_terms_delay_epochs < 0 or 0 < self.epochs <= self.candidate_terms_delay_epochs:
            raise ValueError(f"candidate_terms_delay_epochs must be in [0, epochs = {self.epochs}), "
                             f"got {self.candidate_terms_delay_epochs}")
        if not self.next_item_loss_weight >= 0:
            raise ValueError(f"next_item_loss_weight must be >= 0, got {self.next_item_loss_weight}")
        if self.tag_match_bias and not self.video_tags:
            raise ValueError("tag_match_bias needs video_tags: the match is between the tokens' video tags")
        if self.bias_learning_rate is not None and not self.bias_learning_rate > 0:
            raise ValueError(f"bias_learning_rate must be > 0 (or None: the layers' rate), got {self.bias_learning_rate}")
        if self.tag_match_prior is not None and not self.tag_match_bias:
            raise ValueError("tag_match_prior is the start of the tag-match bias: it needs tag_match_bias")
        if self.tag_embedding_std is not None and not (self.tag_embedding_std > 0 and self.video_tags):
            raise ValueError(f"tag_embedding_std must be > 0 and needs video_tags, got {self.tag_embedding_std} "
                             f"with video_tags={self.video_tags}")


# Named sets of TrainParams fields (`--recipe NAME`; explicit options still win over the recipe's).
# "sequence" trains the sequence path to read the history (docs/model.md, "Training long enough"): a
# rate the 256-wide layers can find matching events at, every history position of the crop a target,
# no absolute positions and no per-id rows to memorise, tags to generalise over, epochs enough for the
# attention to leave its plateau (the holdout picks the epoch), a start whose first attention
# matches tags, which leaves the plateau in two epochs instead of five (docs/model.md, "An attention
# that starts by matching tags"), the tag-match term in the attention, and crops (and a served
# window) of 512 events, where more of a user's taste shows (docs/model.md, "A tag-match term in the
# attention"; on data whose signal is the order of the last events the holdout prefers 128).
RECIPES: dict[str, dict[str, object]] = {
    "default": {},
    "sequence": dict(epochs=10, patience=3, learning_rate=2.5e-4, history_targets=32, position_table_size=1,
                     dropout=0.1, video_hash_size=1, user_hash_size=0, video_tags=True, tag_embedding_std=0.5,
                     tied_query_key_init=True, tag_match_bias=True, max_history_events=512),
}


@dataclass(frozen=True)
class EpochReport:
    epoch: int
    steps: int
    train_loss: float
    holdout_loss: float
    holdout_auc: dict[str, float | None]
    seconds: float


@dataclass(frozen=True)
class TrainReport:
    train_requests: int
    holdout_requests: int
    steps: int
    seconds: float
    final_loss: float
    holdout_auc: dict[str, float | None]  # of the kept (best) epoch
    best_epoch: int
    stopped_early: bool
    candidates_per_second: float  # training samples (scored candidates) per second of training steps
    requests_per_second: float
    epochs: list[EpochReport] = field(default_factory=list)


def trained_attention_window(params: TrainParams) -> int:
    """The attention window a fresh model is trained and served with: what a candidate saw in training
    (docs/model.md, "The attention window")."""
    if params.attention_window is not None:
        return params.attention_window
    return params.max_history_events or 0


def split_requests(dataset: InferenceDataset, params: TrainParams) -> tuple[np.ndarray, np.ndarray]:
    """-> (train, holdout) request indices: the visits before the split date, the last
    `holdout_fraction` of them (in time) held out."""
    period = dataset.request_indices(until_time_ms=beijing_midnight_ms(params.split_date))
    if len(period) < 2:
        raise ValueError(f"Only {len(period)} visits before {params.split_date}: nothing to train on")
    n_holdout = max(1, round(len(period) * params.holdout_fraction))
    train, holdout = period[:-n_holdout], period[-n_holdout:]
    if params.max_train_requests is not None:
        train = train[-params.max_train_requests:]  # the most recent ones: longest histories
    return train, holdout
