"""Load and validate the raw KuaiRand-1K CSV files.

Every problem with the input raises `RawDataError`, whose message names the file, the
column and, where it applies, the 1-based CSV line (line 1 is the header), so a user
with a broken download knows exactly what to look at. Reading uses pyarrow.csv with
explicit column types and only the needed columns; the slow search for the offending
line runs only after a read has failed.
"""
from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from data import schema


class RawDataError(ValueError):
    """Invalid raw input; `str(err)` reads "<file>: column '<col>': line <n>: <problem>"."""

    def __init__(self, path: Path | str, problem: str, column: str | None = None, line: int | None = None):
        where = [str(path)]
        if column is not None:
            where.append(f"column '{column}'")
        if line is not None:
            where.append(f"line {line}")
        super().__init__(f"{': '.join(where)}: {problem}")
        self.path, self.column, self.line = Path(path), column, line


def find_data_dir(path: Path | str) -> Path:
    """The directory holding the CSVs: `path` itself, `path/data` or `path/KuaiRand-1K/data`.

    Accepts the unpacked `KuaiRand-1K/data/`, the `KuaiRand-1K` folder, or its parent.
    """
    root = Path(path)
    if not root.is_dir():
        raise RawDataError(root, "data directory does not exist")
    candidates = (root, root / "data", root / "KuaiRand-1K" / "data")
    for candidate in candidates:
        if any((candidate / name).is_file() for name in schema.RAW_FILES):
            return candidate
    return root / "data" if (root / "data").is_dir() else root


def required_file(data_dir: Path, name: str) -> Path:
    path = data_dir / name
    if not path.is_file():
        raise RawDataError(path, "required file is missing")
    return path


def read_header(path: Path) -> list[str]:
    with open(path, "rb") as f:
        first = f.readline().decode("utf-8-sig", errors="replace").strip()
    if not first:
        raise RawDataError(path, "file is empty (no header line)", line=1)
    return [name.strip().strip('"') for name in first.split(",")]


def read_columns(path: Path, column_types: dict[str, pa.DataType]) -> pa.Table:
    """Read only `column_types`' columns with those types; no nulls allowed in integer columns."""
    header = read_header(path)
    missing = [c for c in column_types if c not in header]
    if missing:
        raise RawDataError(path, f"missing column (header has {len(header)} columns)", column=missing[0])
    try:
        table = pacsv.read_csv(
            path,
            convert_options=pacsv.ConvertOptions(
                column_types=column_types, include_columns=list(column_types)
            ),
        )
    except pa.ArrowInvalid as err:
        raise _locate_read_error(path, column_types, err) from err
    for name, dtype in column_types.items():
        column = table.column(name)
        if pa.types.is_integer(dtype) and column.null_count:
            raise RawDataError(path, "empty cell", column=name, line=_first_line(column.is_null()))
    return table


class ValueRange(NamedTuple):
    """Values allowed in some integer columns, [low, high] (high None: unbounded); `problem`
    describes an offending value (formatted with `value`)."""

    columns: tuple[str, ...]
    low: int
    high: int | None
    problem: str


LOG_VALUE_RANGES = (
    ValueRange(schema.LOG_ID_COLUMNS, 0, None, "negative id {value}"),
    ValueRange(schema.ACTION_COLUMNS, 0, 1, "action flag must be 0 or 1, got {value}"),
    ValueRange(
        ("time_ms",), *schema.TIME_MS_RANGE,
        f"{{value}} is outside the accepted time range {schema.TIME_MS_RANGE_TEXT}, "
        f"i.e. epoch ms {schema.TIME_MS_RANGE[0]} .. {schema.TIME_MS_RANGE[1]}",
    ),
)  # fmt: skip


def read_log(path: Path) -> pa.Table:
    """One interaction log (all 19 int64 columns), checked against LOG_VALUE_RANGES."""
    table = read_columns(path, {c: pa.from_numpy_dtype(schema.LOG_DTYPE) for c in schema.LOG_COLUMNS})
    for allowed in LOG_VALUE_RANGES:
        for name in allowed.columns:
            _check_range(path, name, table.column(name), allowed)
    return table


def read_user_features(path: Path) -> pa.Table:
    """user_id plus the contextual-feature columns. Integer codes are read as float64
    (the real file stores some of them with missing values, hence as floats) and checked
    to be whole numbers; user_id must be unique and non-negative."""
    types = {"user_id": pa.int64()}
    types.update({f.column: pa.string() if f.is_text else pa.float64() for f in schema.CONTEXT_FEATURES})
    table = read_columns(path, types)
    _check_range(path, "user_id", table.column("user_id"), LOG_VALUE_RANGES[0])
    _refuse_repeated(path, table, "user_id")
    for feature in schema.CONTEXT_FEATURES:
        if feature.is_text:
            continue
        values = table.column(feature.column)
        bad = pc.fill_null(pc.not_equal(values, pc.floor(values)), False)
        if pc.any(bad).as_py():
            raise RawDataError(path, "expected a whole number", column=feature.column, line=_first_line(bad))
    return table



def read_video_tags(path: Path) -> pa.Table:
    """video_id and its primary tag (int64 columns), for the videos whose `tag` cell is not empty.
    A cell lists the video's category ids comma-separated, the primary one first ("28", "2,28");
    video_id must be unique and non-negative, and every listed id a whole number >= 0."""
    table = read_columns(path, {"video_id": pa.int64(), "tag": pa.string()})
    _check_range(path, "video_id", table.column("video_id"), LOG_VALUE_RANGES[0])
    _refuse_repeated(path, table, "video_id")
    cells = pc.utf8_trim_whitespace(pc.fill_null(table.column("tag").combine_chunks(), ""))
    tagged = pc.not_equal(cells, "")
    bad = pc.and_(tagged, pc.invert(pc.match_substring_regex(cells, r"^\d{1,18}( *, *\d{1,18})*$")))
    if pc.any(bad).as_py():
        line = _first_line(bad)
        raise RawDataError(path, f"expected comma-separated category ids, got {cells[line - 2].as_py()!r}",
                           column="tag", line=line)
    primary = pc.utf8_trim_whitespace(pc.list_element(pc.split_pattern(cells.filter(tagged), ","), 0))
    return pa.table({"video_id": table.column("video_id").filter(tagged), "tag": pc.cast(primary, pa.int64())})


def read_video_side_features(path: Path) -> pa.Table | None:
    """video_id and the side features of schema.VIDEO_SIDE_COLUMNS the file has (author_id, music_id,
    video_duration in ms, upload_type), one row per video; None when it has none of them. Empty cells stay
    null (an empty upload type: empty), unknown to the model; ids must be whole numbers >= 0."""
    header = read_header(path)
    present = {name: pa.type_for_alias(dtype) for name, dtype in schema.VIDEO_SIDE_COLUMNS.items() if name in header}
    if not present:
        return None
    types = {"video_id": pa.int64(), **{name: pa.float64() if pa.types.is_integer(t) else t for name, t in present.items()}}
    table = read_columns(path, types)
    _check_range(path, "video_id", table.column("video_id"), LOG_VALUE_RANGES[0])
    _refuse_repeated(path, table, "video_id")
    columns = {"video_id": table.column("video_id")}
    for name, dtype in present.items():
        values = table.column(name)
        if pa.types.is_integer(dtype):
            bad = pc.fill_null(pc.or_(pc.less(values, 0), pc.not_equal(values, pc.floor(values))), False)
            if pc.any(bad).as_py():
                raise RawDataError(path, "expected a whole number >= 0", column=name, line=_first_line(bad))
            values = pc.cast(values, dtype)
        columns[name] = values
    return pa.table(columns)


def _refuse_repeated(path: Path, table: pa.Table, column: str) -> None:
    """RawDataError at the first line whose `column` value an earlier line already had."""
    ids = table.column(column).to_numpy()
    order = np.argsort(ids, kind="stable")
    repeated = order[1:][ids[order[1:]] == ids[order[:-1]]]
    if len(repeated):
        raise RawDataError(path, f"duplicate {column}", column=column, line=int(repeated.min()) + 2)


def _check_range(path: Path, name: str, column: pa.ChunkedArray, allowed: ValueRange) -> None:
    """One min/max pass; the first offending row is located only when there is one."""
    if len(column) == 0:
        return
    low, high = (v.as_py() for v in pc.min_max(column).values())
    if low >= allowed.low and (allowed.high is None or high <= allowed.high):
        return
    bad = pc.less(column, allowed.low)
    if allowed.high is not None:
        bad = pc.or_(bad, pc.greater(column, allowed.high))
    line = _first_line(bad)
    value = column[line - 2].as_py()
    raise RawDataError(path, allowed.problem.format(value=value), column=name, line=line)


# ---------------------------------------------------------------- error location (slow path)
def _first_line(mask: pa.ChunkedArray | pa.Array) -> int:
    """1-based CSV line of the first true row (row r is on line r + 2: line 1 is the header)."""
    return int(np.flatnonzero(np.asarray(mask.to_numpy(zero_copy_only=False), dtype=bool))[0]) + 2


def _locate_read_error(path: Path, column_types: dict[str, pa.DataType], err: pa.ArrowInvalid) -> RawDataError:
    """Turn a pyarrow read failure into a RawDataError with line and, for a bad cell, column."""
    message = str(err)
    if "CSV parse error" in message:
        return _locate_ragged_row(path, column_types, message)
    # Conversion error: read the suspect columns as raw bytes and find the first cell that
    # pyarrow's own casts refuse (so the located cell is exactly the one the reader refused).
    named = re.search(r"column #(\d+)", message)
    header = read_header(path)
    first = header[int(named.group(1))] if named and int(named.group(1)) < len(header) else None
    suspects = sorted(column_types, key=lambda c: c != first)  # the named column first
    try:
        cells_by_column = pacsv.read_csv(
            path,
            convert_options=pacsv.ConvertOptions(
                column_types={c: pa.binary() for c in suspects},
                include_columns=suspects,
                strings_can_be_null=True,  # empty cells are nulls, as in the typed read
            ),
        )
    except pa.ArrowInvalid as parse_err:  # a ragged row further on than the refused cell
        return _locate_ragged_row(path, column_types, str(parse_err))
    for name in suspects:
        cells = cells_by_column.column(name).combine_chunks()
        row = _first_uncastable(cells, column_types[name])
        if row is not None:
            return RawDataError(path, _unreadable(cells[row].as_py(), column_types[name]), column=name, line=row + 2)
    return RawDataError(path, message)


def _locate_ragged_row(path: Path, column_types: dict[str, pa.DataType], message: str) -> RawDataError:
    """Re-parse single-threaded with a handler that learns the line of the first ragged row.
    Decoding as latin-1 (any byte is a character; lines and cells stay where they are) lets a
    row with invalid UTF-8 reach the handler: pyarrow decodes a row's text before calling it."""
    found: list[tuple[int | None, int, int]] = []

    def remember(row) -> str:
        found.append((row.number, row.expected_columns, row.actual_columns))
        return "error"

    with contextlib.suppress(pa.ArrowInvalid):
        pacsv.read_csv(
            path,
            read_options=pacsv.ReadOptions(use_threads=False, encoding="latin-1"),
            parse_options=pacsv.ParseOptions(invalid_row_handler=remember),
            convert_options=pacsv.ConvertOptions(column_types={c: pa.string() for c in column_types}),
        )
    if found:
        line, expected, actual = found[0]
        return RawDataError(path, f"expected {expected} columns, got {actual}", line=line)
    return RawDataError(path, message)


def _unreadable(cell: bytes, dtype: pa.DataType) -> str:
    """What is wrong with a raw cell that does not cast to `dtype`."""
    try:
        text = cell.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"invalid UTF-8 at byte {err.start + 1} of {cell!r}"
    return f"cannot read {text!r} as {dtype}"


def _first_uncastable(cells: pa.Array, dtype: pa.DataType) -> int | None:
    """Index of the first raw cell that does not decode as UTF-8 and cast to `dtype` (binary
    search over slices)."""

    def casts(lo: int, hi: int) -> bool:
        try:
            pc.cast(pc.cast(cells.slice(lo, hi - lo), pa.string()), dtype)
            return True
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return False

    if casts(0, len(cells)):
        return None
    lo, hi = 0, len(cells)  # invariant: [lo, hi) contains the first bad cell, [0, lo) casts
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if casts(lo, mid):
            lo = mid
        else:
            hi = mid
    return lo
