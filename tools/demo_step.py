"""Time a step of `make demo` and keep its peak memory; print every step's at the end.

    python tools/demo_step.py --log artifacts/synthetic/steps.jsonl --name train -- python -m model.train ...
    python tools/demo_step.py --log artifacts/synthetic/steps.jsonl --report

A step runs as a child process (its output passes through); its wall time and peak resident memory
(the child's own, from wait4, so each step is measured apart from the others) are appended to the log
as one JSON line. The step's exit status is this script's. `--report` prints the table of the log's
steps and their total, and `--reset` starts a new log.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def run_step(name: str, command: list[str], log: Path) -> int:
    started = time.perf_counter()
    child = subprocess.Popen(command)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    record = {"step": name, "seconds": round(time.perf_counter() - started, 1),
              "peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "exit": child.returncode}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(json.dumps(record) + "\n")
    return child.returncode


def report(log: Path) -> str:
    steps = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []
    lines = [f"{'step':<16}{'time':>10}{'peak RSS':>12}"]
    for s in steps:
        minutes, seconds = divmod(s["seconds"], 60)
        lines.append(f"{s['step']:<16}{int(minutes):>5} min {int(seconds):>2} s{s['peak_rss_mib']:>8.0f} MiB")
    total = sum(s["seconds"] for s in steps)
    lines.append(f"{'total':<16}{int(total // 60):>5} min {int(total % 60):>2} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log", type=Path, required=True, help="JSON lines, one per step")
    p.add_argument("--name", help="the step's name (with a command after --)")
    p.add_argument("--report", action="store_true", help="print the log's steps")
    p.add_argument("--reset", action="store_true", help="start a new log")
    args = p.parse_args(ours)
    if args.reset:
        args.log.unlink(missing_ok=True)
    if command:
        if not args.name:
            p.error("--name is required with a command")
        return run_step(args.name, command, args.log)
    if args.report:
        print(report(args.log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
