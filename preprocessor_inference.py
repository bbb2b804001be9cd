"""Preprocess raw KuaiRand-1K into sequences + requests for inference replay.

    python preprocessor_inference.py --dataset_name kuairand-1k \\
        --data_dir KuaiRand-1K/data --output_dir artifacts/kuairand-1k

A thin CLI over `data.preprocess.preprocess`: it parses arguments, prints a summary,
and turns input errors into a one-line message and exit status 1.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data.manifest import PreprocessParams
from data.preprocess import preprocess

_DEFAULTS = PreprocessParams()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset_name", required=True, help="only 'kuairand-1k' is supported")
    parser.add_argument("--data_dir", required=True, type=Path, help="KuaiRand-1K/data (or the KuaiRand-1K folder)")
    parser.add_argument("--output_dir", required=True, type=Path,
                        help="written atomically: created, or replacing a previous output (its files only); "
                             "must not be, hold or lie inside the input directory")
    parser.add_argument("--session_gap_minutes", type=float, default=_DEFAULTS.session_gap_minutes,
                        help="inactivity that ends a visit (default %(default)s)")
    parser.add_argument("--num_candidates", type=int, default=_DEFAULTS.num_candidates,
                        help="max candidates per request (default %(default)s)")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)

    params = PreprocessParams(
        dataset_name=args.dataset_name,
        session_gap_minutes=args.session_gap_minutes,
        num_candidates=args.num_candidates,
    )
    try:
        manifest = preprocess(args.data_dir, args.output_dir, params, progress=not args.no_progress)
    except (ValueError, OSError) as err:  # RawDataError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 1
    c = manifest.counts
    print(
        f"wrote {args.output_dir}: {c.users} users, {c.events} events, {c.visits} visits, "
        f"{c.requests} requests; dropped {sum(c.duplicate_rows_dropped.values())} duplicate rows"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
