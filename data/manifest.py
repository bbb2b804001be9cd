"""The preprocessed output's manifest: what was produced, from what, and how.

Written by `data.preprocess`, read back by `data.InferenceDataset`; the JSON layout is
the dataclasses below field by field, so the two sides cannot drift apart.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from data import schema


@dataclass(frozen=True)
class PreprocessParams:
    """Inputs to preprocessing that shape the output (recorded in the manifest)."""

    dataset_name: str = schema.DATASET_NAME
    session_gap_minutes: float = 30.0  # a visit ends after this much inactivity
    num_candidates: int = 64  # max candidates per request (fewer if the visit is shorter)

    def validate(self) -> None:
        if self.dataset_name != schema.DATASET_NAME:
            raise ValueError(
                f"unsupported dataset_name {self.dataset_name!r}: only {schema.DATASET_NAME!r} is supported"
            )
        if not (math.isfinite(self.session_gap_minutes) and self.session_gap_minutes >= 0):
            raise ValueError(f"session_gap_minutes must be a finite number >= 0, got {self.session_gap_minutes}")
        if self.num_candidates < 1:
            raise ValueError(f"num_candidates must be >= 1, got {self.num_candidates}")

    @property
    def session_gap_ms(self) -> int:
        return round(self.session_gap_minutes * 60_000)


@dataclass(frozen=True)
class Counts:
    """Row/user/visit bookkeeping. Per-file dicts are keyed by file name in file order."""

    rows_read: dict[str, int]
    duplicate_rows_dropped: dict[str, int]  # exact duplicate rows, the first copy is kept
    users_without_events_in_file: dict[str, int]  # known users (any file) absent from this log; kept
    rows_nonpositive_duration: int  # duration_ms <= 0; kept (their labels are as logged)
    rows_long_view_mismatch: int  # duration_ms > 0 rows breaking the long_view rule; kept
    users_without_features: int  # users with events but no user_features row; kept, features = 0
    feature_users_without_events: int  # user_features rows with no events; not in the output
    users: int  # users with at least one event = rows of sequences.parquet
    events: int  # after deduplication
    visits: int
    requests: int  # visits - users: the first visit of a user has no history, hence no request
    users_without_requests: int  # single-visit users; their events are never requested


@dataclass(frozen=True)
class FeatureVocab:
    """One encoded user feature: id i >= 1 stands for raw value values[i - 1]; 0 = missing."""

    name: str
    values: tuple[str | int, ...]

    @property
    def cardinality(self) -> int:
        return len(self.values) + 1


@dataclass(frozen=True)
class Manifest:
    schema_version: int
    params: PreprocessParams
    tasks: tuple[str, ...]
    counts: Counts
    num_video_ids: int  # max video_id + 1 (embedding table size)
    user_features: tuple[FeatureVocab, ...]
    input_files: dict[str, int]  # file name -> size in bytes

    @property
    def dataset_name(self) -> str:
        return self.params.dataset_name

    @property
    def user_feature_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.user_features)

    @property
    def user_feature_cardinalities(self) -> tuple[int, ...]:
        return tuple(f.cardinality for f in self.user_features)

    def to_json(self) -> str:
        body = asdict(self)
        body["user_feature_cardinalities"] = list(self.user_feature_cardinalities)  # for readers
        return json.dumps(body, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "manifest") -> Manifest:
        body = json.loads(text)
        version = body.get("schema_version")
        if version != schema.SCHEMA_VERSION:
            raise ValueError(
                f"{source}: schema_version {version!r} is not the supported {schema.SCHEMA_VERSION}; "
                "re-run preprocessor_inference.py"
            )
        try:
            return cls(
                schema_version=version,
                params=PreprocessParams(**body["params"]),
                tasks=tuple(body["tasks"]),
                counts=Counts(**body["counts"]),
                num_video_ids=int(body["num_video_ids"]),
                user_features=tuple(FeatureVocab(f["name"], tuple(f["values"])) for f in body["user_features"]),
                input_files=dict(body["input_files"]),
            )
        except (KeyError, TypeError) as err:
            raise ValueError(f"{source}: malformed manifest ({err!r})") from err

    @classmethod
    def read(cls, path: Path | str) -> Manifest:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: manifest not found (not a preprocessed output directory?)")
        return cls.from_json(path.read_text(), source=str(path))
