"""A batch of logged events, columnar and checked: what a history store appends.

    events = EventBatch.from_records([
        {"user_id": 7, "video_id": 1234, "time_ms": 1650000000000, "is_click": 1, "long_view": 1},
        {"user_id": 7, "video_id": 99, "time_ms": 1650000004000},
    ])
    events.user_id          # [N] int64
    events.key_columns      # [N, len(EVENT_KEY_COLUMNS)] int64: the event's identity

A record carries the KuaiRand log fields (data/schema.py LOG_COLUMNS). `user_id`, `video_id` and
`time_ms` are required; the action flags and the other log fields default to 0, `date` and `hourmin`
to what `time_ms` says (Beijing time, as the logs store them). The identity of an event is the
preprocessor's (data/event_rules.py), so an event sent twice, or sent live after it was in a log, is
stored once. Every refusal is an `EventError` naming the event's index, the field and the value.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from data import schema
from data.event_rules import EVENT_KEY_COLUMNS

if TYPE_CHECKING:  # the router parses events too, and need not load pyarrow
    import pyarrow as pa

MAX_ID = 2**63 - 1
REQUIRED_FIELDS = ("user_id", "video_id", "time_ms")
DERIVED_FIELDS = ("date", "hourmin")  # from time_ms when absent
OPTIONAL_FIELDS = tuple(c for c in schema.LOG_COLUMNS if c not in REQUIRED_FIELDS and c not in DERIVED_FIELDS)
FIELDS = (*REQUIRED_FIELDS, *DERIVED_FIELDS, *OPTIONAL_FIELDS)
_COLUMN = {name: i for i, name in enumerate(EVENT_KEY_COLUMNS)}


class EventError(ValueError):
    """An event refused: `field`, the event's `index` in its batch (None: the batch) and a message."""

    def __init__(self, message: str, field: str | None = None, index: int | None = None) -> None:
        super().__init__(message)
        self.field, self.index = field, index


@dataclass(frozen=True)
class EventBatch:
    key_columns: np.ndarray  # [N, len(EVENT_KEY_COLUMNS)] int64, columns in EVENT_KEY_COLUMNS order

    def __post_init__(self) -> None:
        if self.key_columns.ndim != 2 or self.key_columns.shape[1] != len(EVENT_KEY_COLUMNS):
            raise ValueError(f"key_columns must be [N, {len(EVENT_KEY_COLUMNS)}], got {self.key_columns.shape}")

    def __len__(self) -> int:
        return len(self.key_columns)

    def column(self, name: str) -> np.ndarray:
        return self.key_columns[:, _COLUMN[name]]

    @property
    def user_id(self) -> np.ndarray:
        return self.column("user_id")

    @property
    def video_id(self) -> np.ndarray:
        return self.column("video_id")

    @property
    def time_ms(self) -> np.ndarray:
        return self.column("time_ms")

    @property
    def action_weights(self) -> np.ndarray:
        return self.column("action_weights")

    def take(self, rows: np.ndarray | slice) -> EventBatch:
        return EventBatch(self.key_columns[rows])

    @classmethod
    def empty(cls) -> EventBatch:
        return cls(np.zeros((0, len(EVENT_KEY_COLUMNS)), dtype=np.int64))

    @classmethod
    def concat(cls, batches: Sequence[EventBatch]) -> EventBatch:
        return cls(np.concatenate([b.key_columns for b in batches])) if batches else cls.empty()

    # ------------------------------------------------------------ builders
    @classmethod
    def from_columns(cls, columns: Mapping[str, np.ndarray], max_time_ms: int | None = None) -> EventBatch:
        """Columns named as in the logs (FIELDS); checked like `from_records`."""
        unknown = sorted(set(columns) - set(FIELDS))
        if unknown:
            raise EventError(f"unknown event field(s) {unknown}; an event has {list(FIELDS)}", field=unknown[0])
        missing = [f for f in REQUIRED_FIELDS if f not in columns]
        if missing:
            raise EventError(f"missing event field(s) {missing}", field=missing[0])
        n = len(columns["user_id"])
        values = {}
        for name, column in columns.items():
            array = np.asarray(column)
            if array.shape != (n,):
                raise EventError(f"field {name!r} has shape {array.shape}, the batch has {n} events", field=name)
            if n and array.dtype.kind not in "iub":
                raise EventError(f"field {name!r} must hold integers, got {array.dtype}", field=name)
            values[name] = array.astype(np.int64)
        _check(values, max_time_ms)
        time = values["time_ms"]
        date, hourmin = schema.beijing_date_hourmin(time)
        values.setdefault("date", date)
        values.setdefault("hourmin", hourmin)
        flags = {c: values.get(c, np.zeros(n, np.int64)) for c in schema.ACTION_COLUMNS}
        values["action_weights"] = schema.action_weights(flags)
        key = np.stack([values.get(c, np.zeros(n, np.int64)) for c in EVENT_KEY_COLUMNS], axis=1)
        return cls(np.ascontiguousarray(key, dtype=np.int64))

    @classmethod
    def from_records(cls, records: Sequence[Mapping[str, object]], max_time_ms: int | None = None) -> EventBatch:
        """JSON-like records (one dict per event). Refuses non-integers (bools included) by index."""
        if not isinstance(records, Sequence) or isinstance(records, (str, bytes)):
            raise EventError(f"events must be a list of objects, got {type(records).__name__}")
        if not records:
            return cls.empty()
        for i, record in enumerate(records):
            if not isinstance(record, Mapping):
                raise EventError(f"events[{i}] must be an object, got {type(record).__name__}", index=i)
        names = set().union(*records)
        for name in sorted(names - set(FIELDS)):
            i = next(i for i, r in enumerate(records) if name in r)
            raise EventError(f"events[{i}]: unknown field {name!r}; an event has {list(FIELDS)}", field=name, index=i)
        for name in (*REQUIRED_FIELDS, *(n for n in DERIVED_FIELDS if n in names)):
            for i, record in enumerate(records):
                if name not in record:
                    problem = "missing field" if name in REQUIRED_FIELDS else "no field, although other events of the batch have"
                    raise EventError(f"events[{i}]: {problem} {name!r}", field=name, index=i)
        columns = {}
        for name in names:
            values = [r.get(name, 0) for r in records]
            if not all(type(v) is int for v in values):  # bool, float, str... (type(True) is bool, not int)
                i = next(i for i, v in enumerate(values) if type(v) is not int)
                raise EventError(f"events[{i}].{name} must be an int64 integer, got {_show(values[i])}", field=name, index=i)
            try:
                columns[name] = np.array(values, dtype=np.int64)
            except OverflowError:
                i = next(i for i, v in enumerate(values) if not -MAX_ID - 1 <= v <= MAX_ID)
                raise EventError(f"events[{i}].{name} must be an int64 integer, got {_show(values[i])}",
                                 field=name, index=i) from None
        return cls.from_columns(columns, max_time_ms)

    @classmethod
    def from_log_table(cls, table: pa.Table) -> EventBatch:
        """Rows of a KuaiRand log as `data.raw.read_log` returns them (already checked), in row order."""
        return cls.from_columns({c: table.column(c).to_numpy() for c in schema.LOG_COLUMNS})

    def to_records(self) -> list[dict[str, int]]:
        """JSON-ready dicts, the inverse of `from_records` (the action flags spelled out)."""
        out = []
        bits = [(c, 1 << t) for t, c in enumerate(schema.ACTION_COLUMNS)]
        for row in self.key_columns.tolist():
            record = {c: v for c, v in zip(EVENT_KEY_COLUMNS, row) if c != "action_weights"}
            weights = row[_COLUMN["action_weights"]]
            record.update({c: int(weights & bit > 0) for c, bit in bits})
            out.append(record)
        return out


def _check(values: dict[str, np.ndarray], max_time_ms: int | None) -> None:
    def refuse(name: str, bad: np.ndarray, problem: str) -> None:
        i = int(np.flatnonzero(bad)[0])
        raise EventError(f"events[{i}].{name} {problem}, got {int(values[name][i])}", field=name, index=i)

    for name in schema.LOG_ID_COLUMNS:
        bad = values[name] < 0
        if bad.any():
            refuse(name, bad, "must be a non-negative id")
    low, high = schema.TIME_MS_RANGE
    time = values["time_ms"]
    bad = (time < low) | (time > high)
    if bad.any():
        refuse("time_ms", bad, f"must be epoch milliseconds in {schema.TIME_MS_RANGE_TEXT}")
    if max_time_ms is not None and (time > max_time_ms).any():
        refuse("time_ms", time > max_time_ms, f"lies in the future (after {max_time_ms})")
    for name in schema.ACTION_COLUMNS:
        if name in values:
            bad = (values[name] != 0) & (values[name] != 1)
            if bad.any():
                refuse(name, bad, "is an action flag and must be 0 or 1")


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
