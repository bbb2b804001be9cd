"""The command-line options of every script that trains (the trainer, the quality benchmark):
one set of options, read into TrainParams one way.

    p = argparse.ArgumentParser()
    add_recipe_arguments(p)                       # --recipe, --epochs, --learning_rate, ...
    args = parse_recipe_arguments(p, argv)        # the recipe's values as the defaults
    params = recipe_params(args, preset="demo", seed=0)
"""
from __future__ import annotations

import argparse

from model.metrics import SELECT_ON
from model.train_params import ID_STARTS, RECIPES, TrainParams


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = the whole window), got {value}")
    return value


def _float_or_none(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The options that shape a fresh model (TrainParams' model fields), for every script that trains;
    their defaults are TrainParams'."""
    d = TrainParams()
    p.add_argument("--position_table_size", type=int, default=d.position_table_size,
                   help="absolute position rows of a fresh model (1 = no absolute positions)")
    p.add_argument("--video_hash_size", type=int, default=d.video_hash_size,
                   help="video id rows of a fresh model (default: the preset's; 1 = no per-video rows)")
    p.add_argument("--user_hash_size", type=int, default=d.user_hash_size,
                   help="user id rows of the user-taste term of a fresh model (0 = no term)")
    p.add_argument("--attention_window", type=_non_negative_int, default=d.attention_window,
                   help="each query attends to its last N events and the prefix (default: the training crop, "
                        "--max_history_events; 0 = the whole window); a checkpoint loaded without training "
                        "is served through it instead of its own")
    p.add_argument("--video_tags", action=argparse.BooleanOptionalAction, default=d.video_tags,
                   help="embed each token's video tag (the dataset's video_tags.parquet; default: where it has one)")
    p.add_argument("--side_feature_hash_size", type=int, default=d.side_feature_hash_size,
                   help="rows the video authors and music ids hash into, where the dataset has side features "
                        "(0: no side features)")
    p.add_argument("--id_dropout", type=float, default=d.id_dropout,
                   help="the share of tokens whose video-id row is left out while training")
    p.add_argument("--id_start", choices=ID_STARTS, default=d.id_start,
                   help="how a fresh model's video-id rows start: from the training clicks' co-occurrence, or random")
    p.add_argument("--tag_embedding_std", type=_float_or_none, default=d.tag_embedding_std,
                   help="draw a fresh model's tag table at this std ('none': 0.02, as every table)")
    p.add_argument("--id_embedding_std", type=_float_or_none, default=d.id_embedding_std,
                   help="draw a fresh model's video-id table at this std ('none': 0.02, as every table)")
    p.add_argument("--tied_query_key_init", action=argparse.BooleanOptionalAction, default=d.tied_query_key_init,
                   help="start each layer's key projection as a copy of its query projection")
    p.add_argument("--tag_match_bias", action=argparse.BooleanOptionalAction, default=d.tag_match_bias,
                   help="a learned attention offset per head where a key's video tag is the query's (with tags)")
    p.add_argument("--tag_match_prior", type=float, default=d.tag_match_prior,
                   help="the tag-match offset a fresh model's heads start from (default: relative_bias.TAG_MATCH_PRIOR)")


def add_recipe_arguments(p: argparse.ArgumentParser) -> None:
    """How a model is trained (the TrainParams fields of `recipe_params`, but the batch size), for every
    script that trains: the trainer and the quality benchmark train with the same options."""
    d = TrainParams()
    p.add_argument("--recipe", choices=tuple(RECIPES), default="default",
                   help="a named set of the options below (model.train_params.RECIPES); options given explicitly win")
    p.add_argument("--epochs", type=int, default=d.epochs, help="at most (early stopping on the holdout, see --select_on)")
    p.add_argument("--patience", type=int, default=d.patience)
    p.add_argument("--warmup_steps", type=int, default=d.warmup_steps)
    p.add_argument("--max_history_events", type=int, default=d.max_history_events,
                   help="training crops each visit's window to its last N events")
    p.add_argument("--history_targets", type=int, default=d.history_targets,
                   help="score each visit's last N history events as training targets too (each sees the events before it)")
    p.add_argument("--dropout", type=float, default=d.dropout, help="dropout of the layers while training")
    p.add_argument("--learning_rate", type=float, default=d.learning_rate)
    p.add_argument("--embedding_learning_rate", type=float, default=d.embedding_learning_rate)
    p.add_argument("--id_learning_rate", type=float, default=d.id_learning_rate, help="the video-id rows' rate")
    p.add_argument("--video_bias_learning_rate", type=float, default=d.video_bias_learning_rate)
    p.add_argument("--taste_learning_rate", type=float, default=d.taste_learning_rate)
    p.add_argument("--taste_l2", type=float, default=d.taste_l2, help="L2 on the user-taste rows a batch reads")
    p.add_argument("--counter_learning_rate", type=float, default=d.counter_learning_rate)
    p.add_argument("--bias_learning_rate", type=float, default=d.bias_learning_rate,
                   help="the relative bias tables' rate (position, time, tag match; default: --learning_rate)")
    p.add_argument("--candidate_terms_delay_epochs", type=int, default=d.candidate_terms_delay_epochs,
                   help="epochs the candidate-only terms (video bias, user taste, counters) wait before they train")
    p.add_argument("--next_item_loss_weight", type=float, default=d.next_item_loss_weight,
                   help="weight of an auxiliary next-clicked-item loss on the history tokens (0: off)")
    p.add_argument("--select_on", choices=SELECT_ON, default=d.select_on,
                   help="the holdout score that picks the kept epoch")
    p.add_argument("--video_l2", type=float, default=d.video_l2, help="L2 on the video rows a batch reads")
    p.add_argument("--max_train_seconds", type=float, default=None)
    add_model_arguments(p)


def parse_recipe_arguments(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`p.parse_args(argv)` with the chosen `--recipe`'s values as the defaults of its options."""
    chosen = p.parse_known_args(argv)[0].recipe
    p.set_defaults(**RECIPES[chosen])
    return p.parse_args(argv)


def recipe_params(args: argparse.Namespace, **fields) -> TrainParams:
    """TrainParams from the options of `add_recipe_arguments`, with `fields` (preset, seed, ...) beside them."""
    recipe = argparse.ArgumentParser(add_help=False)
    add_recipe_arguments(recipe)
    names = set(vars(recipe.parse_args([]))) - {"recipe"}
    return TrainParams(**{name: getattr(args, name) for name in names}, **fields)
