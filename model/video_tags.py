"""VideoTagTable: each video's primary tag, the model's snapshot of the video catalogue.

A video id is seen a few times before it is scored (2.7 times on average before the split of the
demo data), so what the embedding of an id learns does not carry to other videos. A tag is a
category that thousands of videos share: embedding it beside the id gives every token, history
and candidate alike, something the layers can generalise over, which is what a rule over "what
kind of video the user clicked lately" needs.

The table belongs to the model, not to the batch: it is built from the training data's tags
(`schema.VIDEO_TAGS_FILE`), saved in the checkpoint, and looked up on the host while a batch is
planned, so live events and stored histories carry video ids only. A video the snapshot does not
know (new since it was taken) reads tag row 0, as every untagged video does. The K/V of a cached
token depend on its tag, so the table's digest is part of the model fingerprint (model/checkpoint.py).

    >>> table = VideoTagTable.from_pairs(np.array([10, 7, 3]), np.array([28, 5, 28]))
    >>> table.num_rows                    # rows of the tag embedding: unknown + 2 distinct tags
    3
    >>> table.rows(np.array([3, 7, 10, 99]))
    array([2, 1, 2, 0])
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from data import schema

UNKNOWN_TAG_ROW = 0


@dataclass(frozen=True, eq=False)
class VideoTagTable:
    video_ids: np.ndarray  # [V] int64, ascending, distinct
    tag_rows: np.ndarray  # [V] int64 in [1, num_rows): the video's tag as an embedding row
    tags: np.ndarray  # [num_rows - 1] int64: the raw tag id of rows 1.. (ascending)

    def __post_init__(self):
        if self.video_ids.shape != self.tag_rows.shape or self.video_ids.ndim != 1:
            raise ValueError(f"VideoTagTable: video_ids {self.video_ids.shape} and tag_rows "
                             f"{self.tag_rows.shape} must be two equal-length vectors")
        if len(self.video_ids) and (np.diff(self.video_ids) <= 0).any():
            raise ValueError("VideoTagTable: video_ids must be ascending and distinct")
        if len(self.tag_rows) and (self.tag_rows.min() < 1 or self.tag_rows.max() >= self.num_rows):
            raise ValueError(f"VideoTagTable: tag rows must be in [1, {self.num_rows})")

    @classmethod
    def from_pairs(cls, video_ids: np.ndarray, tags: np.ndarray) -> VideoTagTable:
        """Videos and their raw tag ids (any order, each video once) -> the table."""
        video_ids, tags = np.asarray(video_ids, np.int64), np.asarray(tags, np.int64)
        order = np.argsort(video_ids, kind="stable")
        video_ids, tags = video_ids[order], tags[order]
        repeated = video_ids[1:][video_ids[1:] == video_ids[:-1]]
        if len(repeated):
            raise ValueError(f"VideoTagTable: video {int(repeated[0])} has more than one tag")
        distinct, rows = np.unique(tags, return_inverse=True)
        return cls(video_ids, rows.astype(np.int64) + 1, distinct)

    @classmethod
    def from_dataset_dir(cls, directory: str | Path) -> VideoTagTable | None:
        """The tags of a preprocessed output (None when it has none: its source had no video features)."""
        path = Path(directory) / schema.VIDEO_TAGS_FILE
        if not path.is_file():
            return None
        table = pq.read_table(path)
        missing = {"video_id", "tag"} - set(table.column_names)
        if missing:
            raise ValueError(f"{path}: missing column {sorted(missing)[0]!r}")
        return cls.from_pairs(table.column("video_id").to_numpy(), table.column("tag").to_numpy())

    @property
    def num_rows(self) -> int:
        """Rows of the tag embedding: UNKNOWN_TAG_ROW and one per distinct tag."""
        return len(self.tags) + 1

    def rows(self, video_ids: np.ndarray) -> np.ndarray:
        """[n] video ids -> [n] tag rows (UNKNOWN_TAG_ROW for a video the table does not hold)."""
        video_ids = np.asarray(video_ids, np.int64)
        if not len(self.video_ids):
            return np.zeros(video_ids.shape, np.int64)
        at = np.minimum(np.searchsorted(self.video_ids, video_ids), len(self.video_ids) - 1)
        return np.where(self.video_ids[at] == video_ids, self.tag_rows[at], UNKNOWN_TAG_ROW)

    def digest(self) -> str:
        """A hex digest of the whole table (what cached K/V depend on)."""
        h = hashlib.sha256()
        for array in (self.video_ids, self.tag_rows, self.tags):
            h.update(np.ascontiguousarray(array, np.int64).tobytes())
            h.update(b"|")
        return h.hexdigest()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The table as tensors (what a checkpoint stores)."""
        return {name: torch.from_numpy(np.ascontiguousarray(getattr(self, name), np.int64))
                for name in ("video_ids", "tag_rows", "tags")}

    @classmethod
    def from_tensors(cls, stored: dict) -> VideoTagTable:
        try:
            return cls(*(np.asarray(stored[name].numpy(), np.int64) for name in ("video_ids", "tag_rows", "tags")))
        except (KeyError, AttributeError, TypeError) as err:
            raise ValueError(f"not a video tag table: {err!r}") from err
