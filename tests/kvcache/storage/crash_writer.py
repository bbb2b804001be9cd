"""Child process of the kill -9 test (test_disk_tier.py): serves and offloads users forever.

Each user's data is `token_kv(user, position, salt)` and its tag is the salt, so the parent can
check every entry it finds on disk. The writer resumes from what the directory holds (it is
restarted after each kill), sometimes restarts a user's window with a new salt (a rewrite from
page 0), and prints "ready" after its first offload. `crash_writer.py DIR N` kills itself
in the middle of its N-th index commit instead of waiting for the parent's SIGKILL.
"""
import os
import random
import signal
import sys

from helpers import DISK_RESTART_CFG as CFG
from kvcache import KVCacheConfig, KVCacheManager
from kvcache.storage import disk_tier
from kvcache.testing import append_batch, new_token_kv, token_kv

WARMUP_USER = 1000  # never one of the test's users (0-11); rolled back, so nothing of it is written


def die_in_commit(after: int) -> None:
    """SIGKILL this process in the middle of the `after`-th index commit: the new pages are on disk,
    the new index half-written to its temporary file, the old index still in place."""
    calls = [0]
    atomic_write = disk_tier.atomic_write

    def dying(path, data, fsync):
        calls[0] += 1
        if calls[0] == after:
            with open(path.with_name(path.name + ".tmp"), "wb") as f:
                f.write(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        atomic_write(path, data, fsync)

    disk_tier.atomic_write = dying  # the name disk_tier.py calls


def main(directory: str) -> None:
    cfg = KVCacheConfig(**CFG, persistent_dir=directory)
    layout = cfg.page_layout
    rng = random.Random()
    with KVCacheManager(cfg) as mgr:
        meta = mgr.prepare_kv_cache([WARMUP_USER], [0], [1])  # warm up torch's op dispatch (seconds, once)
        append_batch(mgr, meta, new_token_kv(layout, meta, [0], lambda u, p: token_kv(layout, u, p)))
        mgr.rollback(meta)
        ready = False
        while True:
            users = rng.sample(range(12), 3)
            start, length = (t.tolist() for t in mgr.get_user_kvdata_info(users))
            salts = [int(t.decode() or 0) for t in mgr.get_user_tags(users)]
            for i, u in enumerate(users):
                if length[i] > 20 or (length[i] and rng.random() < 0.15):  # the window moves on: rewritten from page 0
                    mgr.invalidate_kv_cache([u])
                    start[i], length[i], salts[i] = start[i] + length[i], 0, salts[i] + 1
            begins = [s + n for s, n in zip(start, length)]
            news = [rng.randint(1, 12) for _ in users]
            meta = mgr.prepare_kv_cache(users, begins, news, tags=[str(s).encode() for s in salts])
            by_user = dict(zip(users, salts))
            values = new_token_kv(layout, meta, begins, lambda u, p, by_user=by_user: token_kv(layout, u, p, by_user[u]))
            append_batch(mgr, meta, values)
            mgr.commit(meta)
            mgr.offload_kv_cache(users)
            if not ready:  # the directory holds something from now on
                print("ready", flush=True)
                ready = True


if __name__ == "__main__":
    if len(sys.argv) > 2:
        die_in_commit(int(sys.argv[2]))
    main(sys.argv[1])
