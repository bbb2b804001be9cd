"""Where a benchmark's results go: a JSON file (and stdout when asked), and its PNG figures."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_json(path: str | Path | None, doc: Any, *, echo: bool = False, indent: int = 2,
               default: Callable[[Any], Any] | None = None) -> None:
    """`doc` as JSON into `path` (its folders made; None: no file) and, with `echo`, on stdout."""
    text = json.dumps(doc, indent=indent, default=default)
    if echo:
        print(text)
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


def pyplot():
    """matplotlib's pyplot on the Agg backend (files, no display), imported only when a figure is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: str | Path, *, dpi: int) -> Path:
    """Lay the figure out, write it and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return Path(path)
