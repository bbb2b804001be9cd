"""The preprocessed output directory: which targets are safe, atomic replacement, recovery after a kill.

A run writes its files into `.NAME.tmp-TOKEN` beside the output directory NAME (TOKEN is the
run's pid and a random part), holding an exclusive `flock` on it while the run lives, then swaps:

    NAME -> .NAME.old-TOKEN        (only when NAME exists)
    .NAME.tmp-TOKEN -> NAME
    remove .NAME.old-TOKEN

A kill (SIGKILL, not a power failure: nothing is fsynced) leaves one of these states; the next
run repairs it before its own swap, and `readable_output` tells a reader where the complete
output is meanwhile:

    killed                          left beside NAME       the output is     repair
    while writing, before the swap  tmp                    NAME (old)        remove tmp
    between the two renames         old + complete tmp     tmp (new)         tmp -> NAME, remove old
    while removing old              old (partly removed)   NAME (new)        remove old

Only files this module's writers produce (`schema.WRITTEN_FILES`) are ever deleted; a directory
holding anything else is refused, never emptied. The manifest is written last, so a directory
whose manifest reads back is complete.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from data import schema


class OutputDirError(ValueError):
    """An output directory that must not be written or replaced; nothing was changed."""


@dataclass(frozen=True)
class _Leftover:
    """A directory of an interrupted (or running) swap beside the output: `.NAME.tmp-TOKEN` or `.NAME.old-TOKEN`."""

    path: Path
    kind: str  # "tmp" (a run's new output) or "old" (the output it replaces)
    token: str  # shared by the tmp and old directories of one run


def check_target(out: Path, input_dir: Path | None) -> None:
    """Refuse, without changing anything, an output directory that is unsafe to replace: a
    symlink or a file; the input directory (or file), inside it or holding it (None: an input
    elsewhere, a history store's server); a non-empty directory that is not a previous output or
    holds files besides one; one that another run is writing right now, or beside which a killed
    run left files that are not its own."""
    _check_out_dir(out, input_dir)
    for leftover in _leftovers(out):
        _refuse_foreign_entries(leftover.path, "refusing to touch a leftover of an interrupted run that holds")
        if leftover.kind == "tmp" and _is_locked(leftover.path):
            raise OutputDirError(
                f"{out}: another preprocessing run is writing it right now (into {leftover.path}); "
                "wait for it to finish"
            )


def replace_output(out: Path, write: Callable[[Path], None], input_dir: Path | None) -> None:
    """Write a new output with `write(directory)` (manifest last) and swap it in for `out`.

    Leftovers of killed runs are repaired first. On any error the new files are removed and
    `out` is as before (after the first rename the swap is rolled back)."""
    check_target(out, input_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    _repair(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    with _held_lock(tmp):
        try:
            write(tmp)
            _check_out_dir(out, input_dir)  # it may have changed while this run worked
            _swap(tmp, out)
        finally:
            if tmp.exists():
                _remove_output_dir(tmp)


def readable_output(out: Path) -> Path | None:
    """The directory a reader should load for `out`: `out` itself, or, after a run was killed
    between its two renames, the complete new output (else the old one) it left beside `out`.
    None when there is no output. Changes nothing."""
    if out.is_dir():
        return out
    for tmp, old in _runs(out):
        if old is None:
            continue  # a run killed before its swap: its tmp was never the output
        if tmp is not None and _is_complete(tmp):
            return tmp
        if _holds_manifest(old):
            return old
    return None


# ---------------------------------------------------------------- internals
def _leftovers(out: Path) -> list[_Leftover]:
    """Directories of interrupted or running swaps beside `out`, sorted by name."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(tmp|old)-(\d+-[0-9a-f]{{8}})")
    found = []
    if out.parent.is_dir():
        for path in sorted(out.parent.iterdir()):
            match = pattern.fullmatch(path.name)
            if match and path.is_dir() and not path.is_symlink():
                found.append(_Leftover(path, match.group(1), match.group(2)))
    return found


def _holds_manifest(directory: Path) -> bool:
    """Whether `directory` holds a manifest written by the preprocessor (any schema version)."""
    try:
        body = json.loads((directory / schema.MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(body, dict) and "schema_version" in body


def _is_complete(directory: Path) -> bool:
    """Whether a run finished writing `directory`: every output file, the manifest readable."""
    return _holds_manifest(directory) and all((directory / name).is_file() for name in schema.OUTPUT_FILES)


def _remove_output_dir(directory: Path) -> None:
    """Remove the output files in `directory`, then the directory; anything else stays (and
    then so does the directory, reported as an OutputDirError)."""
    for name in schema.WRITTEN_FILES:
        with contextlib.suppress(FileNotFoundError):  # a partial output, or removed by another repair
            (directory / name).unlink()
    try:
        directory.rmdir()
    except FileNotFoundError:
        pass
    except OSError as err:
        raise OutputDirError(f"{directory}: not removed, it holds files the preprocessor did not write") from err


def _check_out_dir(out: Path, input_dir: Path | None) -> None:
    if out.is_symlink():
        raise OutputDirError(f"{out}: output directory is a symbolic link; give the directory it points to")
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{out}: output path exists and is not a directory")
    relation = None if input_dir is None else _relation(out.resolve(), input_dir.resolve())
    if relation is not None:
        raise OutputDirError(
            f"{out}: the output directory {relation} the input directory {input_dir}; "
            "choose an output directory outside the input"
        )
    if out.is_dir() and any(out.iterdir()):
        if not _holds_manifest(out):
            raise OutputDirError(
                f"{out}: refusing to replace a non-empty directory that is not a preprocessed output "
                f"(it has no readable {schema.MANIFEST_FILE})"
            )
        _refuse_foreign_entries(out, "refusing to replace a previous output that also holds")


def _swap(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.rename(tmp, out)
        return
    old = tmp.with_name(tmp.name.replace(".tmp-", ".old-", 1))
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    _remove_output_dir(old)


def _repair(out: Path) -> None:
    """Bring the leftovers of killed runs to the end state their run would have reached (see
    the module docstring). Runs still alive hold their lock and were refused by check_target."""
    for tmp, old in _runs(out):
        if old is not None and not out.exists():  # killed between the two renames
            if tmp is not None and _is_complete(tmp):
                os.rename(tmp, out)
            else:
                os.rename(old, out)
        for path in (tmp, old):
            if path is not None and path.exists():
                _remove_output_dir(path)


def _relation(target: Path, source: Path) -> str | None:
    """How directory `target` overlaps directory `source`, if it does."""
    if target == source:
        return "is"
    if target in source.parents:
        return "contains"
    if source in target.parents:
        return "is inside"
    return None


def _runs(out: Path) -> list[tuple[Path | None, Path | None]]:
    """The leftovers beside `out` as (tmp, old) directories of each run, in token order."""
    by_token: dict[str, dict[str, Path]] = {}
    for leftover in _leftovers(out):
        by_token.setdefault(leftover.token, {})[leftover.kind] = leftover.path
    return [(by_token[t].get("tmp"), by_token[t].get("old")) for t in sorted(by_token)]


def _refuse_foreign_entries(directory: Path, what: str) -> None:
    foreign = sorted(p.name for p in directory.iterdir() if p.name not in schema.WRITTEN_FILES or not p.is_file())
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputDirError(f"{directory}: {what} files the preprocessor did not write ({shown}); move them elsewhere")


@contextlib.contextmanager
def _held_lock(tmp: Path) -> Iterator[None]:
    """Create `tmp` and hold an exclusive flock on it until the block ends: the kernel drops the
    lock when the process dies, which is how a repair tells a killed run from a running one."""
    tmp.mkdir()
    fd = os.open(tmp, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


def _is_locked(directory: Path) -> bool:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
