"""The disk tier's files: the layout record, page file names, the index file (the entry's commit
point), and durable writes. kvcache/storage/disk_tier.py's docstring draws the directory.

An index file (little-endian) is `HSTUKVI2`, start_pos i64, length i64, pages u32, tag bytes u32,
codec spec bytes u32, the tag, the spec, per page the write number naming its file (u64), the
page's crc32 (u32) and its size (u32), and last the crc32 of everything before.
"""
from __future__ import annotations

import contextlib
import json
import os
import struct
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..page_layout import PageLayout
from .base import HostEntry

FORMAT = "hstu-kvcache-disk"
FORMAT_VERSION = 3  # 2: pages carry their tokens' times; 3: pages encoded by a codec named per entry
MAGIC = b"HSTUKVI2"
HEADER = struct.Struct("<8sqqIII")  # magic, start_pos, length, pages, tag bytes, spec bytes
PAGE_RECORD = 16  # u64 write number + u32 crc32 + u32 size


class DiskEntry:
    __slots__ = ("crcs", "length", "nbytes", "seqs", "sizes", "spec", "start_pos", "tag")

    def __init__(self, start_pos: int, length: int, tag: bytes, spec: str, pages: PageRecords, nbytes: int):
        self.start_pos = start_pos
        self.length = length
        self.tag = tag
        self.spec = spec  # the codec that encoded the pages
        self.seqs = pages.seqs  # [pages] uint64: the write that wrote each page (names its file)
        self.crcs = pages.crcs  # [pages] uint32
        self.sizes = pages.sizes  # [pages] uint32: bytes of each page file
        self.nbytes = nbytes  # page files + index file

    @property
    def info(self) -> HostEntry:
        return HostEntry(self.start_pos, self.length, self.tag)

    def records(self, stop: int) -> PageRecords:
        return PageRecords(self.seqs[:stop], self.crcs[:stop], self.sizes[:stop])


class PageRecords(NamedTuple):
    seqs: np.ndarray  # uint64
    crcs: np.ndarray  # uint32
    sizes: np.ndarray  # uint32


def layout_record(layout: PageLayout) -> dict:
    return {
        "format": FORMAT, "version": FORMAT_VERSION,
        "num_layers": layout.num_layers, "num_heads": layout.num_heads, "head_dim": layout.head_dim,
        "page_size": layout.page_size, "dtype": str(layout.dtype).removeprefix("torch."),
        "page_nbytes": layout.page_nbytes,
    }


def check_layout(directory: Path, layout: PageLayout) -> None:
    """Record the layout in a new directory; refuse a directory written with another one."""
    path = directory / "layout.json"
    want = layout_record(layout)
    if not path.exists():
        if (directory / "users").exists():
            raise ValueError(f"{directory} holds KV pages but no layout.json; refusing to guess their layout.")
        atomic_write(path, json.dumps(want, indent=1).encode(), fsync=True)
        return
    try:
        have = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is unreadable ({exc}); is {directory} a KV cache directory?") from exc
    if have != want:
        raise ValueError(
            f"{directory} holds KV pages of another layout (another model geometry, page size or dtype): "
            f"it has {have}, this cache needs {want}. Use another directory (or delete this one)."
        )


def page_name(user_id: int, page: int, seq: int) -> str:
    return f"{user_id}_{page}_{seq}.kv"


def index_nbytes(tag: bytes, spec: bytes, num_pages: int) -> int:
    """Bytes of the index file of an entry of `num_pages` pages."""
    return HEADER.size + len(tag) + len(spec) + PAGE_RECORD * num_pages + 4


def encode_index(start_pos: int, length: int, tag: bytes, spec: bytes, pages: PageRecords) -> bytes:
    body = b"".join((
        HEADER.pack(MAGIC, start_pos, length, len(pages.seqs), len(tag), len(spec)), tag, spec,
        pages.seqs.astype("<u8").tobytes(), pages.crcs.astype("<u4").tobytes(), pages.sizes.astype("<u4").tobytes(),
    ))
    return body + struct.pack("<I", zlib.crc32(body))


def read_index(path: Path, layout: PageLayout) -> DiskEntry | None:
    """The entry an index file describes, or None if it is not a complete, consistent one."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < HEADER.size + 4 or zlib.crc32(data[:-4]) != struct.unpack("<I", data[-4:])[0]:
        return None
    magic, start_pos, length, n, tag_len, spec_len = HEADER.unpack_from(data)
    if (magic != MAGIC or start_pos < 0 or length <= 0 or n != layout.num_pages(length)
            or len(data) != HEADER.size + tag_len + spec_len + PAGE_RECORD * n + 4):
        return None
    off = HEADER.size + tag_len + spec_len
    tag = data[HEADER.size : HEADER.size + tag_len]
    try:
        spec = data[HEADER.size + tag_len : off].decode()
    except UnicodeDecodeError:
        return None
    seqs = np.frombuffer(data, dtype="<u8", count=n, offset=off).astype(np.uint64)
    crcs = np.frombuffer(data, dtype="<u4", count=n, offset=off + 8 * n).astype(np.uint32)
    sizes = np.frombuffer(data, dtype="<u4", count=n, offset=off + 12 * n).astype(np.uint32)
    return DiskEntry(start_pos, length, tag, spec, PageRecords(seqs, crcs, sizes), int(sizes.sum()) + len(data))


def read_exact(f, buf: np.ndarray) -> bool:
    view, got = memoryview(buf).cast("B"), 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            return False
        got += n
    return True


def write_file(path: Path, data, fsync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view, done = memoryview(data).cast("B"), 0
        while done < len(view):
            done += os.write(fd, view[done:])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, fsync: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write_file(tmp, data, fsync)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
