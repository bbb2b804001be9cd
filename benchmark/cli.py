"""The command-line pieces the benchmarks share, so that a flag means the same in every script.

Each script builds its own parser and adds these; its own flags stay beside them.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

import torch

# The dtypes the model and its cache serve in.
DTYPES: Mapping[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# float16 is sized (the KV study's bytes table) but not served.
SIZED_DTYPES: Mapping[str, torch.dtype] = {**DTYPES, "float16": torch.float16}

DATA_DIR_HELP = "preprocessor_inference.py output directory"


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_device(p: argparse.ArgumentParser, *, type: Callable[[str], str] = str, help: str | None = None) -> None:
    """--device, CUDA where this machine has it."""
    p.add_argument("--device", type=type, default=default_device(), help=help)


def refuse_missing_cuda(p: argparse.ArgumentParser, device: str) -> None:
    """argparse's error (exit 2) when --device asks for CUDA and this machine has none."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available on this machine")


def add_dtype(p: argparse.ArgumentParser, *, dtypes: Mapping[str, torch.dtype] = DTYPES,
              help: str | None = None) -> None:
    """--dtype, one of `dtypes`' names, float32 by default."""
    p.add_argument("--dtype", choices=sorted(dtypes), default="float32", help=help)


def add_data_dir(p: argparse.ArgumentParser, *, help: str = DATA_DIR_HELP) -> None:
    p.add_argument("--data_dir", required=True, help=help)


def add_checkpoint(p: argparse.ArgumentParser, *, required: bool = False,
                   help: str = "model.train output directory") -> None:
    p.add_argument("--checkpoint", required=required, default=None, help=help)


def add_seed(p: argparse.ArgumentParser, *, help: str | None = None) -> None:
    p.add_argument("--seed", type=int, default=0, help=help)


def add_output(p: argparse.ArgumentParser, default: str | None = None, *, help: str = "JSON results") -> None:
    """--output, the JSON file `report.write_json` writes (None: none is written)."""
    p.add_argument("--output", default=default, help=help)
