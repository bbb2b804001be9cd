"""VideoSideFeatures: each video's author, music, duration and upload type, as embedding rows.

A video id is learnt only where it repeats; what a video shares with others carries over where it
does not. Besides the tag (model/video_tags.py), KuaiRand's basic video features give its author (a
creator uploads videos of a kind), its music, its duration and how it was uploaded. Each becomes an
embedding row summed into every event and candidate token of the video:

    author, music   1 + id mod (hash_rows - 1)      ids are hashed, as the video ids are
    duration        1 + min(2 log2(1 + seconds), DURATION_ROWS - 2), half-octave buckets
    upload_type     1 + its rank among the catalogue's upload types (mod UPLOAD_TYPE_ROWS - 1)

Row 0 of each is "unknown": an empty cell, or a video the snapshot does not hold. Like the tag table,
this is the model's snapshot of the catalogue (saved in the checkpoint, part of the model fingerprint,
looked up on the host when a batch is planned), so stored histories and live events carry video ids only.

    >>> table = VideoSideFeatures.from_columns(np.array([5, 9]), {"author_id": np.array([7, -1]),
    ...     "music_id": np.array([3, 3]), "video_duration": np.array([30_000.0, np.nan]),
    ...     "upload_type": np.array(["Web", "ShortImport"], dtype=object)}, hash_rows=11)
    >>> table.rows(np.array([9, 5, 4]))["author"].tolist()     # 9 has no author, 4 is not in the table
    [0, 8, 0]
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from data import schema

SIDE_FEATURES = ("author", "music", "duration", "upload_type")
DURATION_ROWS = 24
UPLOAD_TYPE_ROWS = 16
_HASHED = {"author": "author_id", "music": "music_id"}


def side_feature_sizes(hash_rows: int) -> dict[str, int]:
    """Rows of each side feature's embedding, for a model whose author and music ids hash into `hash_rows`."""
    return {"author": hash_rows, "music": hash_rows, "duration": DURATION_ROWS, "upload_type": UPLOAD_TYPE_ROWS}


@dataclass(frozen=True, eq=False)
class VideoSideFeatures:
    video_ids: np.ndarray  # [V] int64, ascending, distinct
    feature_rows: np.ndarray  # [V, len(SIDE_FEATURES)] int64: each video's row of each side feature
    hash_rows: int  # rows of the author and music embeddings

    def __post_init__(self):
        sizes = np.array(list(side_feature_sizes(self.hash_rows).values()))
        if self.feature_rows.shape != (len(self.video_ids), len(SIDE_FEATURES)):
            raise ValueError(f"VideoSideFeatures: feature_rows has shape {self.feature_rows.shape}, expected "
                             f"({len(self.video_ids)}, {len(SIDE_FEATURES)})")
        if len(self.video_ids) and (np.diff(self.video_ids) <= 0).any():
            raise ValueError("VideoSideFeatures: video_ids must be ascending and distinct")
        if self.feature_rows.size and ((self.feature_rows < 0) | (self.feature_rows >= sizes)).any():
            raise ValueError(f"VideoSideFeatures: rows must be in [0, {sizes.tolist()}) per feature")

    @classmethod
    def from_columns(cls, video_ids: np.ndarray, columns: dict[str, np.ndarray], hash_rows: int) -> VideoSideFeatures:
        """Videos and their raw side columns (schema.VIDEO_SIDE_COLUMNS, any subset; a missing column or a
        negative id / NaN duration / None type is unknown) -> the table."""
        if hash_rows < 2:
            raise ValueError(f"hash_rows must be >= 2 (row 0 is unknown), got {hash_rows}")
        video_ids = np.asarray(video_ids, np.int64)
        order = np.argsort(video_ids, kind="stable")
        rows = np.zeros((len(video_ids), len(SIDE_FEATURES)), np.int64)
        for j, name in enumerate(SIDE_FEATURES):
            if name in _HASHED and _HASHED[name] in columns:
                ids = np.asarray(columns[_HASHED[name]], np.float64)
                known = np.isfinite(ids) & (ids >= 0)
                rows[known, j] = 1 + np.remainder(ids[known].astype(np.int64), hash_rows - 1)
            elif name == "duration" and "video_duration" in columns:
                seconds = np.asarray(columns["video_duration"], np.float64) / 1000.0
                known = np.isfinite(seconds) & (seconds >= 0)
                rows[known, j] = 1 + np.minimum(np.floor(2 * np.log2(1 + seconds[known])), DURATION_ROWS - 2)
            elif name == "upload_type" and "upload_type" in columns:
                types = np.asarray(columns["upload_type"], dtype=object)
                known = np.array([isinstance(t, str) and t != "" for t in types], dtype=bool)
                _, rank = np.unique(types[known].astype(str), return_inverse=True)
                rows[known, j] = 1 + np.remainder(rank, UPLOAD_TYPE_ROWS - 1)
        if len(video_ids) > 1 and (np.diff(video_ids[order]) == 0).any():
            raise ValueError("VideoSideFeatures: a video is listed twice")
        return cls(video_ids[order], rows[order], hash_rows)

    @classmethod
    def from_dataset_dir(cls, directory: str | Path, hash_rows: int) -> VideoSideFeatures | None:
        """The side features of a preprocessed output (None when its source had none)."""
        path = Path(directory) / schema.VIDEO_SIDE_FEATURES_FILE
        if not path.is_file():
            return None
        table = pq.read_table(path)
        if "video_id" not in table.column_names:
            raise ValueError(f"{path}: missing column 'video_id'")
        columns = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names
                   if name in schema.VIDEO_SIDE_COLUMNS}
        return cls.from_columns(table.column("video_id").to_numpy(), columns, hash_rows)

    def rows(self, video_ids: np.ndarray) -> dict[str, np.ndarray]:
        """[n] video ids -> each side feature's [n] rows (0 for a video the table does not hold)."""
        video_ids = np.asarray(video_ids, np.int64)
        if not len(self.video_ids):
            return {name: np.zeros(video_ids.shape, np.int64) for name in SIDE_FEATURES}
        at = np.minimum(np.searchsorted(self.video_ids, video_ids), len(self.video_ids) - 1)
        held = self.video_ids[at] == video_ids
        found = np.where(held[:, None], self.feature_rows[at], 0)
        return {name: found[:, j] for j, name in enumerate(SIDE_FEATURES)}

    def digest(self) -> str:
        """A hex digest of the whole table (what cached K/V depend on)."""
        h = hashlib.sha256()
        for array in (self.video_ids, self.feature_rows, np.array([self.hash_rows])):
            h.update(np.ascontiguousarray(array, np.int64).tobytes())
            h.update(b"|")
        return h.hexdigest()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The table as tensors (what a checkpoint stores)."""
        return {"video_ids": torch.from_numpy(np.ascontiguousarray(self.video_ids)),
                "feature_rows": torch.from_numpy(np.ascontiguousarray(self.feature_rows)),
                "hash_rows": torch.tensor(self.hash_rows)}

    @classmethod
    def from_tensors(cls, stored: dict) -> VideoSideFeatures:
        try:
            return cls(np.asarray(stored["video_ids"].numpy(), np.int64),
                       np.asarray(stored["feature_rows"].numpy(), np.int64), int(stored["hash_rows"]))
        except (KeyError, AttributeError, TypeError) as err:
            raise ValueError(f"not a video side-feature table: {err!r}") from err
