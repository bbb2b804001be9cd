"""Child process of the kill tests (test_preprocess_output.py): preprocess RAW into OUT and SIGKILL
itself at one step of writing the output, as a crash or `kill -9` would.

    kill_preprocess.py RAW OUT NUM_CANDIDATES WHEN:CALL:N

WHEN is before or after, CALL one of write_table (a Parquet file of the new output), rename
(a directory rename of the swap) or unlink (a file removal); the kill comes at its N-th call.
"""
import os
import signal
import sys
from pathlib import Path

import pyarrow.parquet as pq

from data.manifest import PreprocessParams
from data.preprocess import preprocess

HOOKS = {"write_table": (pq, "write_table"), "rename": (os, "rename"), "unlink": (os, "unlink")}


def die_at(when: str, call: str, n: int) -> None:
    owner, name = HOOKS[call]
    original = getattr(owner, name)
    calls = [0]

    def dying(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(*args, **kwargs)
        if calls[0] == n and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(owner, name, dying)


if __name__ == "__main__":
    raw, out, num_candidates, step = sys.argv[1:]
    when, call, n = step.split(":")
    die_at(when, call, int(n))
    preprocess(Path(raw), Path(out), PreprocessParams(num_candidates=int(num_candidates)), progress=False)
    sys.exit("the kill step was never reached")
