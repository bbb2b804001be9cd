"""Preprocessing cost relative to just parsing the same CSVs, measured in one run.

    python -m benchmark.data.preprocess --scale 1.0 --output artifacts/preprocess_benchmark.json

Generates (or reuses, or takes --data_dir) a synthetic KuaiRand-1K, then alternates two
child processes: a plain `pyarrow.csv.read_csv` of the two standard logs and the user
features (timed inside the child, so interpreter start-up is not charged to it), and
`data.preprocess.preprocess` with default parameters, exactly what preprocessor_inference.py
runs (timed as a whole process, start-up included). The ratio uses the best of
--repeats runs of each, so it holds on a noisy shared machine.
Peak memory is each child's RSS high-water mark (`os.wait4` rusage).
Targets: ratio <= 3, preprocessing peak RSS <= 8 GB.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmark.cli import add_seed
from benchmark.report import write_json
from data import schema

REPO = Path(__file__).resolve().parents[2]

TARGET_RATIO = 3.0
TARGET_PEAK_BYTES = 8 * 1024**3
READ_FILES = (*schema.STANDARD_LOGS, schema.USER_FEATURES)
_READ_CHILD = """
import sys, time, pyarrow.csv
start = time.perf_counter()
rows = sum(pyarrow.csv.read_csv(path).num_rows for path in sys.argv[1:])
print(time.perf_counter() - start, rows)
"""
_PREPROCESS_CHILD = """
import sys, time
start = time.perf_counter()
from data.manifest import PreprocessParams
from data.preprocess import preprocess
preprocess(sys.argv[1], sys.argv[2], PreprocessParams(), progress=False)
print(time.perf_counter() - start)
"""


def run_child(command: list[str]) -> tuple[float, float, int, str]:
    """Run a child -> (wall s, CPU s (user + sys), peak RSS bytes, stdout); raises on failure.
    The child is reaped with os.wait4, whose rusage belongs to that child alone."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        child = subprocess.Popen(command, stdout=out, stderr=err, cwd=REPO)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if child.returncode != 0:
            raise RuntimeError(f"{' '.join(command[:3])} failed ({child.returncode}):\n{err.read()}")
        cpu = usage.ru_utime + usage.ru_stime
        return wall, cpu, usage.ru_maxrss * 1024, out.read()  # Linux reports ru_maxrss in KiB


def ensure_data(args: argparse.Namespace) -> Path:
    if args.data_dir is not None:
        return args.data_dir
    data_dir = args.work_dir / "KuaiRand-1K" / "data"
    marker = args.work_dir / "synthetic.json"
    wanted = {"scale": args.scale, "seed": args.seed}
    present = all((data_dir / f).is_file() for f in READ_FILES)
    if present and marker.is_file() and json.loads(marker.read_text()) == wanted:
        print(f"reusing {data_dir}", file=sys.stderr)
        return data_dir
    print(f"generating scale {args.scale} into {data_dir}", file=sys.stderr)
    marker.unlink(missing_ok=True)
    command = [sys.executable, "-m", "data.synthetic", "--out", str(data_dir),
               "--scale", str(args.scale), "--seed", str(args.seed)]  # fmt: skip
    subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    marker.write_text(json.dumps(wanted))
    return data_dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0)
    add_seed(parser)
    parser.add_argument("--data_dir", type=Path, default=None, help="use these CSVs instead of generating")
    parser.add_argument("--work_dir", type=Path, default=Path(tempfile.gettempdir()) / "preprocess_benchmark")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side; the best counts")
    parser.add_argument("--output", type=Path, default=None, help="results JSON (default WORK_DIR/results.json)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    data_dir = ensure_data(args)
    files = [str(data_dir / f) for f in READ_FILES]
    out_dir = args.work_dir / "preprocessed"
    for path in files:  # warm the page cache so both sides read from memory
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass

    load_before = os.getloadavg()
    read_s, read_cpu, read_rss, prep_s, prep_call_s, prep_cpu, prep_rss = [], [], [], [], [], [], []
    for _ in range(args.repeats):
        _, cpu, rss, stdout = run_child([sys.executable, "-c", _READ_CHILD, *files])
        read_s.append(float(stdout.split()[0]))
        read_cpu.append(cpu)
        read_rss.append(rss)
        wall, cpu, rss, stdout = run_child([sys.executable, "-c", _PREPROCESS_CHILD, str(data_dir), str(out_dir)])
        prep_s.append(wall)
        prep_call_s.append(float(stdout.split()[0]))
        prep_cpu.append(cpu)
        prep_rss.append(rss)
    manifest = json.loads((out_dir / schema.MANIFEST_FILE).read_text())
    ratio = min(prep_s) / min(read_s)
    results = {
        "data_dir": str(data_dir),
        "scale": None if args.data_dir else args.scale,
        "rows_read": manifest["counts"]["rows_read"],
        "input_bytes": sum(os.path.getsize(f) for f in files),
        "read_csv_s": read_s,
        "read_csv_process_cpu_s": read_cpu,  # whole child, both cores counted
        "read_csv_peak_rss_bytes": max(read_rss),
        "preprocess_s": prep_s,  # whole child process: interpreter start, imports, work
        "preprocess_call_s": prep_call_s,  # the preprocess() call alone (imports included)
        "preprocess_process_cpu_s": prep_cpu,
        "preprocess_peak_rss_bytes": max(prep_rss),
        "ratio": ratio,
        "meets_ratio_target": ratio <= TARGET_RATIO,
        "meets_memory_target": max(prep_rss) <= TARGET_PEAK_BYTES,
        "counts": manifest["counts"],
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
    }
    output = args.output or args.work_dir / "results.json"
    write_json(output, results)
    gib = 1024**3
    print(
        f"rows: {sum(results['rows_read'].values()):,}  read_csv: {min(read_s):.2f} s  "
        f"preprocess: {min(prep_s):.2f} s  ratio: {ratio:.2f}x (target <= {TARGET_RATIO})  "
        f"peak RSS: {max(prep_rss) / gib:.2f} GiB (target <= 8)  -> {output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
