"""python -m history.set_retention: give a history store a retention rule (history/retention.py) and fold
what lies beyond it now.

    python -m history.set_retention --store sqlite:///var/lib/hstu/history.sqlite --keep_events 4096 \
        --window_events 2049

Its own module: the rule is the store's (history/sqlite_store.py reads history/retention.py), and this
command opens a store by its URL (history/registry.py).
"""
from __future__ import annotations

import argparse
import sys

from history.registry import open_history_store
from history.retention import Retention


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Give a history store a retention rule and fold what lies beyond it now.")
    p.add_argument("--store", required=True, help="history store URL (sqlite:///path)")
    p.add_argument("--keep_events", type=int, required=True, help="N: each user's last N events are kept whole")
    p.add_argument("--window_events", type=int, required=True,
                   help="kept events a visit needs: >= the model's max_seq_len - prefix + 1 (nodes check it at start)")
    args = p.parse_args(argv)
    try:
        retention = Retention(args.keep_events, args.window_events)
    except ValueError as err:
        p.error(str(err))
    with open_history_store(args.store) as store:
        folded = store.set_retention(retention)
        print(f"{store.description}: keeps each user's last {retention.keep_events} events; {folded} folded now, "
              f"{store.num_events()} kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
