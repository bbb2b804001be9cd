"""The flags of the end-to-end replay (benchmark/serving/end2end.py) and the checks their values must pass.

Everything that can be judged from the command line alone is judged while parsing, before any
data is loaded or a model is built, and a bad value ends like any argparse error:
`usage: ...` then `<prog>: error: argument --flag: <problem>`, exit status 2.

- A flag's own check is its `type` (or `choices`) in `build_parser`: one row per flag.
- Checks between flags are the rows of `FLAG_RULES`.
- Checks that need the data (the device pool must hold the largest batch) are in the script,
  reported the same way through `refuse`.

A flag whose default depends on other flags defaults to None here and is filled in by
`parse_args` after the rules ran (so that a rule can tell "given" from "defaulted").
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from benchmark.cli import add_checkpoint, add_data_dir, add_device, add_dtype
from data.schema import DEFAULT_SPLIT_DATE, beijing_midnight_ms
from kvcache.codecs import DEFAULT_CODEC, codec_names, get_codec
from kvcache.config import REDIS_SCHEMES
from model.config import PRESET_NAMES
from model.train_params import RECIPES

DEFAULT_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}
DEFAULT_PRESET = "demo"
DEFAULT_TIER_CAPACITY = 8 << 30


# ---------------------------------------------------------------- value checks (argparse types)
def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def seed(text: str) -> int:
    """A torch seed: an integer in [0, 2^63)."""
    value = int_at_least(0)(text)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"must be < 2^63, got {value}")
    return value


def non_negative_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def yyyymmdd(text: str) -> int:
    """A calendar date written YYYYMMDD, kept as that integer."""
    if not re.fullmatch(r"\d{8}", text):
        raise argparse.ArgumentTypeError(f"expected a date as YYYYMMDD, got {text!r}")
    try:
        beijing_midnight_ms(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text} is not a calendar date (YYYYMMDD)") from None
    return int(text)


def device(text: str) -> str:
    """cpu, cuda or cuda:N, and only a CUDA device this machine has."""
    try:
        parsed = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda or cuda:N)") from None
    if parsed.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: only cpu and cuda devices are supported")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available on this machine")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def file_to_write(text: str) -> str:
    """A file path that is not a directory and whose missing parents can be created."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, expected a file path")
    _check_creatable(path.parent, text)
    return text


def directory_to_use(text: str) -> str:
    """A directory, or a path where one can be created."""
    _check_creatable(Path(text), text)
    return text


def kv_codec(text: str) -> str:
    """A codec spec of kvcache.codecs, made canonical."""
    try:
        return get_codec(text).spec
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def redis_url(text: str) -> str:
    if not text.startswith(REDIS_SCHEMES):
        raise argparse.ArgumentTypeError(f"{text!r} must start with one of {', '.join(REDIS_SCHEMES)}")
    return text


def _check_creatable(directory: Path, text: str) -> None:
    """`directory` exists as a directory, or its nearest existing ancestor is a directory."""
    for path in (directory, *directory.parents):
        if path.exists():
            if not path.is_dir():
                where = text if path == Path(text) else f"{text}: {path}"
                raise argparse.ArgumentTypeError(f"{where} exists and is not a directory")
            return


# ---------------------------------------------------------------- the flags
def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(p)
    add_checkpoint(p, help="model.train output directory (omit for a random-init model)")
    p.add_argument("--preset", choices=PRESET_NAMES, default=None,
                   help=f"model preset, only without --checkpoint (default {DEFAULT_PRESET})")
    p.add_argument("--recipe", choices=tuple(RECIPES), default=None,
                   help="only without --checkpoint: shape the random model as model.train --recipe does (tags, "
                        "tag match, window; `sequence` is what make demo trains) (default: the preset as is)")
    p.add_argument("--attention_window", type=int_at_least(0), default=None,
                   help="serve the model through this sliding attention window, 0 = the whole window "
                        "(default: the checkpoint's own)")
    p.add_argument("--from_date", type=yyyymmdd, default=DEFAULT_SPLIT_DATE,
                   help="YYYYMMDD: replay visits from this day (default %(default)s)")
    p.add_argument("--batch_size", type=int_at_least(1), default=8, help="visits per batch, >= 1 (default %(default)s)")
    p.add_argument("--max_requests", type=int_at_least(1), default=None, help="replay at most this many visits, >= 1")
    p.add_argument("--kv_pages", type=int_at_least(1), default=None,
                   help="device pages, at least the largest batch's (default: a quarter of the replayed "
                        "users' working set, at least a batch of the largest windows)")
    p.add_argument("--host_capacity", type=int_at_least(1), default=None,
                   help="host tier bytes, >= 1 (default: room for every replayed user)")
    p.add_argument("--page_size", type=int_at_least(1), default=None, help="tokens per page, >= 1 (default: the model's)")
    p.add_argument("--async_offload", action="store_true", help="offload users to the host tier on a background worker")
    p.add_argument("--kv_tier", choices=["memory", "disk", "redis"], default="memory",
                   help="tier below the in-memory host tier: none, a persistent directory, or a Redis server")
    p.add_argument("--kv_dir", type=directory_to_use, default=None,
                   help="directory of the persistent tier (with --kv_tier disk, which needs it)")
    p.add_argument("--redis_url", type=redis_url, default=None,
                   help="redis://host:port/db of the shared tier (with --kv_tier redis, which needs it)")
    p.add_argument("--tier_capacity", type=int_at_least(1), default=None,
                   help=f"bytes the disk or Redis tier may use (default {DEFAULT_TIER_CAPACITY})")
    p.add_argument("--kv_codec", type=kv_codec, default=DEFAULT_CODEC,
                   help=f"how host tiers store K/V pages: {', '.join(codec_names())} (kvcache/codecs/registry.py; "
                        "lossy ones, bf16, fp16, int8, mixed, change logits: give --tolerance) (default %(default)s)")
    p.add_argument("--keep_unread_kv", action="store_true",
                   help="offload the K/V a windowed model never reads again as they are, instead of as zeros "
                        "(kvcache/read_window.py; exact either way)")
    p.add_argument("--no_warmup", action="store_true",
                   help="start the cached pass cold instead of serving each user's last earlier visit first")
    p.add_argument("--no_compare", action="store_true", help="skip the full-recompute pass")
    p.add_argument("--no_cost_probe", action="store_true",
                   help="skip counting ops, syncs and GPU-busy time per batch (a short untimed replay per pass)")
    add_dtype(p, help="model and cache dtype (default %(default)s)")
    p.add_argument("--tolerance", type=non_negative_number, default=None,
                   help="max |logit diff|, a finite number >= 0 (default 1e-4 fp32, 0.1 bf16)")
    add_device(p, type=device, help="cpu, cuda or cuda:N (default %(default)s)")
    p.add_argument("--cuda_graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each batch bucket's CUDA graph (default: on with a CUDA device and the triton backend)")
    p.add_argument("--output", type=file_to_write, default="end2end.json", help="results JSON (default %(default)s)")
    p.add_argument("--plot", type=file_to_write, default=None, help="PNG path (default: --output with suffix .png)")
    p.add_argument("--seed", type=seed, default=0, help="seed of a random-init model, in [0, 2^63)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


class FlagRule(NamedTuple):
    """A condition between flags that parsed arguments must meet, and the error when they do not."""

    holds: Callable[[argparse.Namespace], bool]
    message: str


FLAG_RULES = (
    FlagRule(lambda a: a.kv_tier != "disk" or a.kv_dir is not None, "--kv_tier disk needs --kv_dir"),
    FlagRule(lambda a: a.kv_tier != "redis" or a.redis_url is not None, "--kv_tier redis needs --redis_url"),
    FlagRule(lambda a: a.kv_dir is None or a.kv_tier == "disk", "--kv_dir is only used with --kv_tier disk"),
    FlagRule(lambda a: a.redis_url is None or a.kv_tier == "redis", "--redis_url is only used with --kv_tier redis"),
    FlagRule(lambda a: a.tier_capacity is None or a.kv_tier != "memory",
             "--tier_capacity is only used with --kv_tier disk or redis"),
    FlagRule(lambda a: not a.cuda_graphs or torch.device(a.device).type == "cuda", "--cuda_graphs needs a CUDA --device"),
    FlagRule(lambda a: a.preset is None or a.checkpoint is None,
             "--preset is only used without --checkpoint (a checkpoint holds its model's configuration)"),
    FlagRule(lambda a: a.recipe is None or a.checkpoint is None,
             "--recipe is only used without --checkpoint (a checkpoint holds its model's configuration)"),
    FlagRule(lambda a: plot_path(a).resolve() != Path(a.output).resolve(),
             "--plot and --output name the same file (give --plot another path)"),
)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parsed and checked arguments, defaults filled in; argparse's SystemExit(2) on a bad one."""
    args = parser.parse_args(argv)
    for rule in FLAG_RULES:
        if not rule.holds(args):
            parser.error(rule.message)
    if args.preset is None:
        args.preset = DEFAULT_PRESET
    if args.tier_capacity is None:
        args.tier_capacity = DEFAULT_TIER_CAPACITY
    if args.tolerance is None:
        args.tolerance = DEFAULT_TOLERANCE[args.dtype]
    return args


def replay_defaults(**fields) -> argparse.Namespace:
    """The replay's arguments as `parse_args` fills them for a bare `--data_dir`, with `fields` set over
    them: for scripts that reuse the replay's `load_model` and `cache_config` (replay_setup.py) without its
    command line (kvcache/codec_report.py, kvcache/entropy.py), so a flag the replay gains has its default there too."""
    args = parse_args(build_parser(""), ["--data_dir", str(fields.get("data_dir", "."))])
    for name, value in fields.items():
        setattr(args, name, value)
    return args


def plot_path(args: argparse.Namespace) -> Path:
    return Path(args.plot) if args.plot else Path(args.output).with_suffix(".png")


def refuse(parser: argparse.ArgumentParser, message: str) -> int:
    """Report a refusal found after parsing exactly as argparse reports one; -> exit status 2."""
    parser.print_usage(sys.stderr)
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return 2
