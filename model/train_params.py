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

ID_STARTS = ("cooccurrence", "random")


@dataclass(frozen=True)
class TrainParams:
    """How `python -m model.train` trains, by default a model that reads its history from what the data
    gives: each token's video is its hashed id row plus its tag and side-feature rows, ids learn where they
    repeat and the shared features carry the rest, every history position of a crop is a target too, and a
    next-clicked-item loss over ids shapes the item rows (docs/model.md, "Training"; the rounds that chose
    these values: docs/notebook/)."""

    preset: str = "demo"
    split_date: int = DEFAULT_SPLIT_DATE
    holdout_fraction: float = 0.1
    # At most: the holdout keeps the best epoch, and the cosine decay spans these epochs. The attention
    # needs several epochs to leave its first plateau.
    epochs: int = 10
    patience: int = 3  # epochs without a better holdout score before stopping
    # What "better" means: "click_auc" (the ranking the model is for) or "loss" (the mean holdout BCE
    # over all tasks, which moves far less between epochs than the ranking does).
    select_on: str = "click_auc"
    batch_size: int = 16
    # The layers' rate: one at which the 256-wide layers find matching events rather than memorise.
    learning_rate: float = 2.5e-4
    embedding_learning_rate: float = 1e-2
    # The video-id rows' own rate: an event sits in the crop of every later visit that reaches back to
    # it, so a dense catalogue's id row is read thousands of times an epoch, and at the shared features'
    # rate it would memorise its training labels instead of what it shares with the videos around it.
    id_learning_rate: float = 1e-3
    # The per-video logit offsets: Adam moves a row by about this rate each time its video is seen. Kept
    # small: at a rate that lets a video seen a handful of times reach its log-odds, the rows memorise
    # those few labels on a sparse catalogue; a video's rate over everyone is the counter term's to read.
    video_bias_learning_rate: float = 1e-3
    # The user-taste tables (model/user_taste.py) and an L2 on the rows a batch's candidates read.
    taste_learning_rate: float = 0.02
    taste_l2: float = 0.1
    # The counter term (model/counter_features.py): a few hundred weights read by every batch, whose
    # targets are around a logit; at the layers' rate they would barely move in an epoch.
    counter_learning_rate: float = 0.05
    # Epochs the candidate-only terms (video_bias, user taste, counters) wait, at rate 0, before they
    # train, so that the sequence path learns first; 0: they train from the start.
    candidate_terms_delay_epochs: int = 0
    # Weight of the next-clicked-item loss on the history tokens (model/next_item_loss.py: each position
    # predicts the next clicked item among the batch's, over ids, tags and side features), beside the
    # candidates' BCE; it is what teaches a dense catalogue's id rows which videos go together. 0: off.
    next_item_loss_weight: float = 0.1
    # L2 on the per-video rows a batch reads (token video embeddings, video_bias); 0: none.
    video_l2: float = 0.0
    dropout: float = 0.1  # of a fresh model's layers, while training
    warmup_steps: int = 20  # linear warm-up, then cosine decay to 10% over the planned steps
    # Training crops each visit to its last events (None: whole window); a crop long enough to hold a
    # user's taste as well as the last clicks.
    max_history_events: int | None = 512
    # The sliding attention window of a fresh model (HSTUConfig.attention_window): None serves the crop
    # it was trained on (max_history_events; the whole window without a crop), 0 the whole window.
    attention_window: int | None = None
    # Each visit's last events scored as targets too, each seeing only the events before it
    # (InferenceDataset.make_batch(history_targets=)); 0: the visits' candidates only.
    history_targets: int = 32
    # The absolute position table of a fresh model (HSTUConfig.position_table_size, saved in the
    # checkpoint and read by serving): None keeps the preset's; 1 gives every token one position row,
    # which removes absolute positions and leaves order to the relative bias.
    position_table_size: int | None = 1
    # Id rows of a fresh model (HSTUConfig.video_hash_size, .user_hash_size); None keeps the preset's.
    # One video row leaves the model no per-video row (what ids add: the "no-ids" recipe).
    video_hash_size: int | None = None
    user_hash_size: int | None = 0
    # Embed each token's video tag (model/video_tags.py): None where the dataset has tags, True requires
    # them, False leaves them out.
    video_tags: bool | None = None
    # Rows the authors and music ids of a fresh model hash into, beside its duration and upload-type rows
    # (HSTUConfig.side_feature_hash_size), where the dataset has video side features; 0: none. Off by
    # default: at the shared tables' rate the hashed author and music rows memorise like per-video rows
    # (docs/notebook/2026-12-07-ids-and-side-features.md); they need the id rows' treatment first.
    side_feature_hash_size: int = 0
    # The share of tokens whose video-id row is left out while training (HSTUConfig.id_dropout): the tag
    # and side features must carry a video too, as they must for a video seen once.
    id_dropout: float = 0.2
    # How a fresh model's video-id rows start (ID_STARTS): "cooccurrence" from the training period's
    # clicked-together videos (model/item_cooccurrence.py), "random" at id_embedding_std alone.
    id_start: str = "cooccurrence"
    # A fresh model's start, so that its first attention matches what the history shares with the
    # candidate: the tag and id tables drawn large (None: the 0.02 of every table), which makes them most
    # of a token's normalised input, and each layer's key projection a copy of its query projection,
    # which makes q.k a similarity of the two tokens.
    tag_embedding_std: float | None = 0.5
    id_embedding_std: float | None = 0.5
    tied_query_key_init: bool = True
    # A fresh model's attention adds a learned offset per head and layer where a key's tag is the
    # query's (HSTUConfig.tag_match_bias, where the model has tags): the tag share of the history in one term.
    tag_match_bias: bool = True
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
        if self.id_start not in ID_STARTS:
            raise ValueError(f"id_start must be one of {', '.join(ID_STARTS)}, got {self.id_start!r}")
        if not 0.0 <= self.id_dropout < 1.0:
            raise ValueError(f"id_dropout must be in [0, 1), got {self.id_dropout}")
        if self.side_feature_hash_size < 0 or self.side_feature_hash_size == 1:
            raise ValueError(f"side_feature_hash_size must be 0 (none) or >= 2, got {self.side_feature_hash_size}")
        if self.bias_learning_rate is not None and not self.bias_learning_rate > 0:
            raise ValueError(f"bias_learning_rate must be > 0 (or None: the layers' rate), got {self.bias_learning_rate}")
        if self.tag_match_prior is not None and not self.tag_match_bias:
            raise ValueError("tag_match_prior is the start of the tag-match bias: it needs tag_match_bias")
        for name in ("tag_embedding_std", "id_embedding_std"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (or None: the tables' default), got {getattr(self, name)}")


# Named variants of the default (`--recipe NAME`; explicit options still win over the recipe's).
# "no-ids" reads videos through their tags and side features alone: the ablation that says what the id
# rows add (docs/model.md, "Training").
RECIPES: dict[str, dict[str, object]] = {
    "default": {},
    "no-ids": dict(video_hash_size=1, id_dropout=0.0, id_embedding_std=None),
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
