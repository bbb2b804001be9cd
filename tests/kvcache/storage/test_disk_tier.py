"""DiskHostStorage: round trips, restarts (in process and in a new process), kill -9 mid-write,
corruption and the byte bound."""
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import DISK_RESTART_CFG as CFG
from helpers import TINY_LAYOUT_ARGS, host_pages, pages_equal, subprocess_env
from kvcache import DiskHostStorage, HostEntry, KVCacheConfig, KVCacheManager, PageLayout
from kvcache.page_data import concat_pages
from kvcache.testing import append_batch, expected_kv, new_token_kv, serve, token_kv

HERE = Path(__file__).resolve().parent
LAYOUT = PageLayout(**TINY_LAYOUT_ARGS)
PAGE = LAYOUT.page_nbytes  # 128 bytes


def _pages(n, seed, layout=LAYOUT):
    return host_pages(layout, n, seed=seed)


def _fill(pages):
    return lambda dst: dst.copy_(pages)


def _open(path, capacity=1 << 20, layout=LAYOUT):
    s = DiskHostStorage(path, capacity, fsync=False)
    s.bind(layout)
    return s


def _files(path):
    return sorted(p.name for p in Path(path, "users").rglob("*") if p.is_file())


@pytest.mark.parametrize("page_size, dtype", [(1, torch.float32), (4, torch.bfloat16), (16, torch.float32)])
def test_round_trip_incremental_and_after_restart(tmp_path, page_size, dtype):
    layout = PageLayout(num_layers=2, num_heads=2, head_dim=4, page_size=page_size, dtype=dtype)
    s = _open(tmp_path, layout=layout)
    held = _pages(0, 0, layout)
    length = 0
    for visit, new in enumerate([3, 1, page_size, 2 * page_size + 1, 5]):
        first = length // page_size  # the rewritten partial page, then the new ones
        length += new
        pages = _pages(layout.num_pages(length) - first, visit, layout)
        assert s.write(7, 10, length, first, _fill(pages), tag=f"v{visit}".encode()).stored
        held = concat_pages([held[:first], pages])
        hp = s.read(7)
        assert hp.entry == HostEntry(10, length, f"v{visit}".encode())
        assert pages_equal(hp.pages, held)  # bit-identical
    files = _files(tmp_path)
    assert len([f for f in files if f.endswith(".kv")]) == layout.num_pages(length)  # superseded pages are gone
    s.close()
    again = _open(tmp_path, layout=layout)
    assert again.recovery.users == 1 and again.recovery.dropped == 0
    assert again.info(7) == HostEntry(10, length, b"v4") and again.bytes_used == s.bytes_used
    assert pages_equal(again.read(7).pages, held)


def test_rewrite_from_page_zero_gap_refusal_and_failed_fill(tmp_path):
    s = _open(tmp_path)
    s.write(1, 0, 8, 0, _fill(_pages(2, 1)))
    s.write(1, 5, 3, 0, _fill(_pages(1, 2)), tag=b"new window")
    hp = s.read(1)
    assert hp.entry == (5, 3, b"new window") and pages_equal(hp.pages, _pages(1, 2))
    with pytest.raises(ValueError, match="gap"):
        s.write(1, 5, 12, 2, _fill(_pages(1, 3)))
    with pytest.raises(ValueError):
        s.write(1, 5, 0, 0, _fill(_pages(0, 3)))

    def broken(dst):
        raise RuntimeError("device copy failed")

    with pytest.raises(RuntimeError, match="device copy failed"):
        s.write(1, 5, 8, 0, broken)
    assert s.info(1) is None and s.bytes_used == 0 and _files(tmp_path) == []


def test_layout_is_checked_and_the_directory_locked(tmp_path):
    s = _open(tmp_path)
    with pytest.raises(RuntimeError, match="in use"):
        _open(tmp_path)
    s.close()
    other = PageLayout(num_layers=2, num_heads=1, head_dim=2, page_size=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="another layout"):
        _open(tmp_path, layout=other)
    _open(tmp_path).close()  # the refused bind released the lock


def test_corruption_is_detected_dropped_and_counted(tmp_path):
    s = _open(tmp_path)
    for u in (1, 2, 3):
        s.write(u, 0, 12, 0, _fill(_pages(3, u)))
    page_file = next(p for p in Path(tmp_path, "users").rglob("2_1_*.kv"))
    data = bytearray(page_file.read_bytes())
    data[17] ^= 0x40
    page_file.write_bytes(bytes(data))
    assert s.read(2) is None and s.corrupt_reads == 1 and s.info(2) is None
    assert s.counters() == {"corrupt_reads": 1}
    Path(next(Path(tmp_path, "users").rglob("3_0_*.kv"))).unlink()  # a missing page
    assert s.read(3) is None and s.corrupt_reads == 2
    assert pages_equal(s.read(1).pages, _pages(3, 1))
    s.close()
    # Damage found at start: a short page file, a corrupted index, leftovers of an interrupted write.
    s = _open(tmp_path)
    s.write(4, 0, 8, 0, _fill(_pages(2, 4)))
    s.write(5, 0, 8, 0, _fill(_pages(2, 5)))
    s.close()
    shard = lambda u: Path(tmp_path, "users", f"{u:02x}")
    short = next(shard(1).glob("1_2_*.kv"))
    short.write_bytes(short.read_bytes()[:-1])
    index = shard(4) / "4.idx"
    index.write_bytes(index.read_bytes()[:-2] + b"xx")
    (shard(5) / "5_2_99.kv").write_bytes(b"half a page")
    (shard(5) / "5.idx.tmp").write_bytes(b"half an index")
    s = _open(tmp_path)
    assert s.recovery.dropped == 2 and s.recovery.removed_files >= 2 + 2 + 2  # pages of 1 and 4, the leftovers
    assert [u for u in (1, 2, 3, 4, 5) if s.info(u)] == [5]
    assert pages_equal(s.read(5).pages, _pages(2, 5))
    assert s.bytes_used == sum(p.stat().st_size for p in Path(tmp_path, "users").rglob("*") if p.is_file())


def test_bytes_stay_within_capacity_with_a_working_set_many_times_larger(tmp_path):
    capacity = 40 * PAGE
    s = _open(tmp_path, capacity)
    rng = random.Random(0)
    lengths = {}
    for step in range(300):
        u = rng.randrange(50)
        length = lengths.get(u, 0)
        if length and s.info(u) is not None and s.info(u).length == length:
            first, length = length // 4, length + rng.randint(1, 9)
        else:
            first, length = 0, rng.randint(1, 30)
        result = s.write(u, 0, length, first, _fill(_pages(LAYOUT.num_pages(length) - first, step)),
                         protect=[rng.randrange(50)])
        lengths[u] = length if result.stored else 0
        assert s.bytes_used <= capacity
        assert all(s.info(v) is None for v, _ in result.evicted)
    on_disk = sum(p.stat().st_size for p in Path(tmp_path, "users").rglob("*") if p.is_file())
    assert on_disk == s.bytes_used <= capacity and s.num_users < 50
    recent = list(s._users)[-1]
    s.close()
    smaller = _open(tmp_path, capacity // 2)  # a restart with a smaller budget evicts down to it
    assert smaller.bytes_used <= capacity // 2 and smaller.recovery.evicted > 0
    assert smaller.info(recent) is not None  # the LRU order survived (index mtimes)
    assert sum(p.stat().st_size for p in Path(tmp_path, "users").rglob("*") if p.is_file()) == smaller.bytes_used


# ---------------------------------------------------------------------- across processes

RELOAD = """
import sys, torch
from kvcache import KVCacheConfig, KVCacheManager
from kvcache.testing import expected_kv, expected_times, serve
cfg = KVCacheConfig(**{cfg!r}, persistent_dir=sys.argv[1])
with KVCacheManager(cfg) as mgr:
    users = list(range(6))
    start, length = mgr.get_user_kvdata_info(users)
    assert start.tolist() == [3 * u for u in users] and length.tolist() == [5 + 3 * u for u in users], (start, length)
    assert mgr.get_user_tags(users) == [f"user {{u}}".encode() for u in users]
    meta = mgr.prepare_kv_cache(users, start + length, [0] * 6)   # onload from disk
    mgr.commit(meta)
    assert mgr.stats().onloaded_bytes > 0
    for u in users:
        assert torch.equal(mgr.read_times(u), expected_times(u, 3 * u, 5 + 3 * u)), u
        for layer in range(cfg.num_layers):
            k, v = mgr.read_kv(u, layer)
            ek, ev = expected_kv(cfg.page_layout, u, 3 * u, 5 + 3 * u, layer)
            assert torch.equal(k, ek) and torch.equal(v, ev), u
print("reloaded")
"""


def test_a_new_process_reloads_what_a_closed_manager_offloaded(tmp_path):
    cfg = KVCacheConfig(**CFG, persistent_dir=str(tmp_path))
    with KVCacheManager(cfg) as mgr:
        for u in range(6):  # two visits each: the second offload is incremental
            serve(mgr, [u], [3 * u], [2])
            mgr.offload_kv_cache([u])
            meta = mgr.prepare_kv_cache([u], [3 * u + 2], [3 + 3 * u], tags=[f"user {u}".encode()])
            append_batch(mgr, meta, new_token_kv(cfg.page_layout, meta, [3 * u + 2],
                                                 lambda v, p: token_kv(cfg.page_layout, v, p)))
            mgr.commit(meta)
            mgr.offload_kv_cache([u])
        assert mgr.host_storage.tiers[0].num_users < 6  # the in-memory tier is too small to hold them all
    proc = subprocess.run([sys.executable, "-c", RELOAD.format(cfg=CFG), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "reloaded" in proc.stdout, proc.stderr


def _check_consistent(path, layout):
    """Every entry on disk is complete and equals the K/V its tag names (user, salt)."""
    s = DiskHostStorage(path, 1 << 30, fsync=False)
    s.bind(layout)
    try:
        users = list(s._users)
        for u in users:
            hp = s.read(u)
            assert hp is not None, u
            salt = int(hp.tag.decode())
            kv = hp.pages.kv.permute(2, 1, 0, 3, 4, 5).reshape(2, layout.num_layers, -1, layout.num_heads, layout.head_dim)
            expected = token_kv(layout, u, torch.arange(hp.start_pos, hp.start_pos + hp.length), salt)
            assert torch.equal(kv[:, :, : hp.length], expected), (u, hp.entry)
        assert s.corrupt_reads == 0
        return len(users), s.recovery
    finally:
        s.close()


def _crash_writer(directory, *args):
    return subprocess.Popen([sys.executable, str(HERE / "crash_writer.py"), str(directory), *map(str, args)],
                            env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_kill_9_during_offloads_leaves_only_complete_entries(tmp_path):
    cfg = KVCacheConfig(**CFG, persistent_dir=str(tmp_path))
    rng = random.Random(1)
    for _ in range(2):  # killed from outside at a random moment of a long series of offloads
        child = _crash_writer(tmp_path)
        try:
            assert child.stdout.readline().strip() == "ready", child.stderr.read()
            time.sleep(rng.uniform(0.2, 0.6))
            assert child.poll() is None, child.stderr.read()
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        users, _ = _check_consistent(tmp_path, cfg.page_layout)
        assert users > 0
    child = _crash_writer(tmp_path, 40)  # kills itself with its 40th index half-written
    _, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, err
    users, report = _check_consistent(tmp_path, cfg.page_layout)
    assert users > 0 and report.removed_files > 0  # the temporary index and the new, unreferenced pages
    # Serving goes on from the recovered directory.
    with KVCacheManager(cfg) as mgr:
        start, length = mgr.get_user_kvdata_info([0])
        salt = int(mgr.get_user_tags([0])[0].decode() or 0)
        values = lambda u, pos: token_kv(cfg.page_layout, u, pos, salt)
        meta = serve(mgr, [0], [int(start + length)], [3], values)
        assert meta.cached_lengths.item() == length.item()
        k, _ = mgr.read_kv(0, 1)
        ek, _ = expected_kv(cfg.page_layout, 0, int(start), int(length) + 3, 1, salt)
        assert torch.equal(k, ek)
