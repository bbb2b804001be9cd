"""One command for a GPU machine's first run: check it, test it, measure it, in one report.

    python -m benchmark.gpu_report --output artifacts/gpu-report          # on a CUDA machine (make gpu-report)
    python -m benchmark.gpu_report --output artifacts/gpu-report --dry    # here: every step's CPU part, tiny

GPU time is scarce, so the run is planned to fit in 20 minutes and to spend them measuring:

    runtime    tools/gpu_runtime_check.py (torch build, driver, CUDA, fbgemm-gpu, torchrec, triton)
    tests      the CUDA tests: the Triton kernels and the CUDA graph, onload and cache tests on the device
    block      the HSTU block, bf16, CUDA graphs, B = 1/8/32, history 4096 (3968 cached + 128 new) + 256 candidates
    launches   kernel launches per batch at B = 1 and 8 (torch profiler), eager and graph replay, each
               forward under torch.cuda.set_sync_debug_mode("error") (benchmark/model/launch_count.py)
    end2end    the end-to-end replay of synthetic KuaiRand visits, cached vs full recompute, bf16
    study      (named only: --steps study) the KV-reuse study on the device (benchmark/kvcache/study.py):
               histories 256-16k, reload from memory and disk per codec, into kv_study/ (a second run)

Every step runs in its own process under its own time limit, and a failed step does not stop the
others (a first run should bring back every figure it can). The report, `report.json` and
`report.md` in --output, names the device and gives each step's status, time and output tail, and
the measured figures beside the issue's targets. --dry runs the same steps on CPU at tiny sizes
(the runtime check then records that there is no CUDA; the tests are collected, not run).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmark.report import write_json

REPO = Path(__file__).resolve().parents[1]
BUDGET_SECONDS = 20 * 60
STEP_NAMES = ("runtime", "tests", "block", "launches", "end2end")  # the first run's plan, within BUDGET_SECONDS
EXTRA_STEP_NAMES = ("study",)  # run when named (--steps): the first run's budget has no room for them
# The CUDA tests: the kernels and every test whose id names cuda (the device fixture's cuda runs, CUDA-only tests).
KERNEL_TESTS = ("tests/model/test_triton_attention.py", "tests/kvcache/test_triton_append.py")
# H100 targets (issue 22): cached block ms at each batch, history 4096 (3968 cached) + 256 candidates, bf16.
BLOCK_TARGET_MS = {1: 0.6, 8: 1.5, 32: 4.0}
TARGET_HISTORY = 4096
END2END_TARGET_SPEEDUP = 2.5


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    commands: list[list[str]]  # run in order; the step fails at the first that fails
    timeout_s: int
    result_file: str | None = None  # a JSON the step writes into the report directory


@dataclass
class StepResult:
    name: str
    what: str
    status: str  # "passed", "failed" or "timed out"
    seconds: float
    output_tail: str
    result: dict | None = field(default=None)


def plan_steps(out: Path, work: Path, dry: bool) -> list[Step]:
    """The report's steps, writing the report's files into `out` and the replay's data into `work` (the
    report directory stays a handful of files); `dry`: their CPU parts at tiny sizes. Timeouts sum to
    under BUDGET_SECONDS."""
    py = sys.executable
    device, dtype = ("cpu", "float32") if dry else ("cuda", "bfloat16")
    data, raw = work / "processed", work / "raw"
    # The deploy tests whose ids name cuda check manifests, not the device (CI runs them); a module that
    # fails to import (a package the machine lacks) must not stop the CUDA tests of the others.
    tests = [py, "-m", "pytest", "-q", "--ignore=tests/deploy", "--continue-on-collection-errors"]
    if dry:
        tests_commands = [[*tests, "--collect-only", *KERNEL_TESTS], [*tests, "--collect-only", "tests", "-k", "cuda"]]
        block = ["--preset", "tiny", "--histories", "64", "--batches", "1", "2", "--new_tokens", "8",
                 "--candidates", "4", "--repeats", "1"]
        replay = ["--preset", "tiny", "--recipe", "default", "--max_requests", "16", "--batch_size", "4"]
        launches = ["--preset", "tiny", "--history", "64", "--new_tokens", "8", "--candidates", "4"]
        study = ["--preset", "tiny", "--presets", "tiny", "--histories", "16", "64", "--new_tokens", "8",
                 "--candidates", "4", "--repeats", "1", "--tiers", "memory", "--codecs", "raw", "int8",
                 "--batches", "1", "2"]
        scale = "0.0005"
    else:
        tests_commands = [[*tests, *KERNEL_TESTS], [*tests, "tests", "-k", "cuda", "-m", "not slow"]]
        block = ["--preset", "kuairand-1k", "--histories", str(TARGET_HISTORY), "--batches", "1", "8", "32",
                 "--new_tokens", "128", "--candidates", "256", "--repeats", "20", "--cuda_graphs"]
        # The model make demo ships (tags, the tag-match kernel variant, a 512-event window) at the target size.
        replay = ["--preset", "kuairand-1k", "--recipe", "default", "--max_requests", "2000", "--batch_size", "8"]
        launches = ["--preset", "kuairand-1k", "--history", str(TARGET_HISTORY), "--new_tokens", "128",
                    "--candidates", "256"]
        # Redis joins when the machine has redis-server (the study notes it otherwise); the host-decoded
        # lossless codecs measure the host, not the device, and stay out of a short slot.
        study = ["--histories", "256", "1024", "4096", "16384", "--repeats", "3", "--codecs", "raw", "bf16",
                 "int8", "int8:group=token", "mixed"]
        scale = "0.005"
    return [
        Step("runtime", "tools/gpu_runtime_check.py: does this machine run the GPU path?",
             [[py, "tools/gpu_runtime_check.py"]], 60),
        Step("tests", "the CUDA tests (kernels; every test id naming cuda)", tests_commands, 400),
        Step("block", f"HSTU block benchmark ({dtype}{', CUDA graphs' if not dry else ''})",
             [[py, "-m", "benchmark.model.hstu_block", "--device", device, "--dtype", dtype, *block,
               "--output", str(out / "block.json")]], 240, "block.json"),
        Step("launches", f"kernel launches per batch, B=1/8, no host sync in the forward ({dtype})",
             [[py, "-m", "benchmark.model.launch_count", "--device", device, "--dtype", dtype, *launches,
               "--output", str(out / "launches.json")]], 80, "launches.json"),
        Step("end2end", f"end-to-end replay, cached vs full recompute ({dtype})",
             [[py, "-m", "data.synthetic", "--out", str(raw), "--scale", scale, "--seed", "7", "--no_progress"],
              [py, "preprocessor_inference.py", "--dataset_name", "kuairand-1k", "--data_dir", str(raw),
               "--output_dir", str(data)],
              [py, "benchmark/inference_end2end_example.py", "--data_dir", str(data), "--device", device,
               "--dtype", dtype, *replay, "--quiet", "--output", str(out / "end2end.json")]], 360, "end2end.json"),
        Step("study", f"KV-reuse study: visits, memory and reload per tier and codec ({device})",
             [[py, "-m", "benchmark.kvcache.study", "--device", device, *study, "--output_dir", str(out / "kv_study")]],
             300, "kv_study/results.json"),
    ]


def run_step(step: Step, out: Path, scale: float = 1.0) -> StepResult:
    """Run the step's commands in order within `scale` x its time limit."""
    started, tail, status = time.perf_counter(), [], "passed"
    for command in step.commands:
        left = step.timeout_s * scale - (time.perf_counter() - started)
        try:
            run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=max(1.0, left))
        except subprocess.TimeoutExpired as err:
            tail.append(f"$ {' '.join(command)}\n{_text(err.stdout)}{_text(err.stderr)}")
            status = "timed out"
            break
        tail.append(f"$ {' '.join(command)}\n{run.stdout}{run.stderr}")
        if run.returncode != 0:
            status = "failed"
            break
    result = None
    if step.result_file and (out / step.result_file).exists():
        result = json.loads((out / step.result_file).read_text())
    return StepResult(step.name, step.what, status, round(time.perf_counter() - started, 1),
                      "\n".join(tail)[-4000:], result)


def _text(stream: bytes | str | None) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else (stream or "")


def device_name(dry: bool) -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu (dry run: no CUDA device)" if dry else "cpu (no CUDA device)"


def figures(results: list[StepResult], dry: bool) -> list[dict]:
    """The measured figures beside their targets; the targets are an H100's at the issue's shapes, so a dry
    run's tiny CPU figures are listed without them."""
    rows = []
    by_name = {r.name: r for r in results}
    block = by_name.get("block")
    if block and block.result:
        for row in block.result["rows"]:
            target = None if dry or row["history"] != TARGET_HISTORY else BLOCK_TARGET_MS.get(row["batch"])
            rows.append({"figure": f"block cached ms, history {row['history']}, B={row['batch']}",
                         "value": round(row["cached_ms"], 3), "target": target and f"<= {target}",
                         "met": None if target is None else row["cached_ms"] <= target})
            rows.append({"figure": f"block full-recompute ms, history {row['history']}, B={row['batch']}",
                         "value": round(row["full_ms"], 3), "target": None, "met": None})
    launches = by_name.get("launches")
    if launches and launches.result:
        unit = launches.result["launch_unit"]
        for row in launches.result["rows"]:
            rows.append({"figure": f"{unit} per batch, {row['mode']}, B={row['batch']}", "value": row["launches"],
                         "target": None, "met": None})
        rows.append({"figure": "eager launches B=8 / B=1 (x)", "value": round(launches.result["eager_growth_1_to_8"], 2),
                     "target": None if dry else "<= 1.3", "met": None if dry else launches.result["eager_growth_1_to_8"] <= 1.3})
    replay = by_name.get("end2end")
    if replay and replay.result and replay.result.get("speedup") is not None:
        speedup = replay.result["speedup"]
        rows.append({"figure": "end-to-end cached vs full recompute (x)", "value": round(speedup, 2),
                     "target": None if dry else f">= {END2END_TARGET_SPEEDUP}",
                     "met": None if dry else speedup >= END2END_TARGET_SPEEDUP})
        rows.append({"figure": "end-to-end logit parity", "value": replay.result.get("parity"), "target": "pass",
                     "met": replay.result.get("parity") == "pass"})
    study = by_name.get("study")
    if study and study.result:
        for visit in study.result["visits"]:
            rows.append({"figure": f"KV study: cached vs full recompute (x), history {visit['history']}",
                         "value": round(visit["speedup"], 2), "target": None, "met": None})
    return rows


def write_report(out: Path, dry: bool, results: list[StepResult], seconds: float) -> dict:
    report = {"device": device_name(dry), "dry": dry, "torch": torch.__version__, "seconds": round(seconds, 1),
              "steps": [asdict(r) for r in results], "figures": figures(results, dry)}
    write_json(out / "report.json", report)
    lines = [f"# GPU report: {report['device']}", "",
             f"{'Dry run on CPU at tiny sizes: no figure below is a GPU measurement. ' if dry else ''}"
             f"torch {report['torch']}, {report['seconds']} s in all.", "",
             "| step | status | seconds | what |", "| --- | --- | --- | --- |"]
    lines += [f"| {r.name} | {r.status} | {r.seconds} | {r.what} |" for r in results]
    lines += ["", "| figure | value | target | met |", "| --- | --- | --- | --- |"]
    lines += [f"| {f['figure']} | {f['value']} | {f['target'] or ''} | {'' if f['met'] is None else f['met']} |"
              for f in report["figures"]]
    for r in results:
        if r.status != "passed":
            lines += ["", f"## {r.name}: {r.status}", "", "```", r.output_tail, "```"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, default=Path("artifacts/gpu-report"), help="report directory")
    p.add_argument("--work", type=Path, default=Path("artifacts/gpu-report-data"),
                   help="where the end-to-end step writes its synthetic data")
    p.add_argument("--dry", action="store_true", help="every step's CPU part at tiny sizes (no GPU needed)")
    p.add_argument("--steps", nargs="+", choices=STEP_NAMES + EXTRA_STEP_NAMES, default=None,
                   help=f"run only these steps (default: {' '.join(STEP_NAMES)}; {' '.join(EXTRA_STEP_NAMES)} when named)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all steps together: their limits are scaled to it (a runner with a shorter "
                        "command limit than the 20 minutes planned)")
    args = p.parse_args(argv)
    out = args.output.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    steps = [s for s in plan_steps(out, args.work.resolve(), args.dry) if s.name in (args.steps or STEP_NAMES)]
    scale = 1.0 if args.budget is None else args.budget / sum(s.timeout_s for s in steps)
    results = []
    for step in steps:
        print(f"[gpu-report] {step.name}: {step.what}", flush=True)
        results.append(run_step(step, out, scale))
        print(f"[gpu-report] {step.name}: {results[-1].status} in {results[-1].seconds} s", flush=True)
        # After every step: a run killed from outside still leaves the report of the steps it finished.
        report = write_report(out, args.dry, results, time.perf_counter() - started)
    print((out / "report.md").read_text())
    expected = {"runtime"} if args.dry else set()  # without a GPU the runtime check must fail
    return 0 if all(s["status"] == "passed" or s["name"] in expected for s in report["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
