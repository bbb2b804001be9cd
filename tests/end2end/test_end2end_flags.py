"""Every flag of the end-to-end replay (benchmark/inference_end2end_example.py) refuses a bad value with an argparse-style
`error:` line naming the flag (exit status 2), before the long work; none falls back silently."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO_ROOT, build_processed, subprocess_env

EXAMPLE = REPO_ROOT / "benchmark" / "inference_end2end_example.py"  # the published entry point, run as a file
NOT_LOADED = "/nonexistent/processed"  # a parse-time refusal never gets as far as reading --data_dir


@pytest.fixture(scope="module")
def example():
    from benchmark.serving import end2end

    return end2end


@pytest.fixture(scope="module")
def processed(tmp_path_factory) -> Path:
    return build_processed(tmp_path_factory.mktemp("flags"))


def run(example, argv: list[str], capsys) -> tuple[int, str]:
    """-> (exit status, stderr) of the script's main."""
    capsys.readouterr()
    code = example.main([*argv, "--quiet"])
    return code, capsys.readouterr().err


def assert_refused(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    message = err.strip().splitlines()[-1]
    assert re.match(r"\S+: error: ", message), err  # argparse's own format
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.fixture
def a_file(tmp_path: Path) -> str:
    path = tmp_path / "a_file"
    path.write_text("not a directory")
    return str(path)


# case -> (flags, fragments of the error); {file} is a regular file, {tmp} an empty directory
PARSE_REFUSALS = {
    "kv_pages 0": (["--kv_pages", "0"], ["argument --kv_pages", "must be >= 1, got 0"]),
    "kv_pages negative": (["--kv_pages", "-5"], ["argument --kv_pages", "must be >= 1, got -5"]),
    "host_capacity 0": (["--host_capacity", "0"], ["argument --host_capacity", "must be >= 1, got 0"]),
    "page_size 0": (["--page_size", "0"], ["argument --page_size", "must be >= 1, got 0"]),
    "batch_size 0": (["--batch_size", "0"], ["argument --batch_size", "must be >= 1, got 0"]),
    "attention_window negative": (["--attention_window", "-1"], ["argument --attention_window", "must be >= 0, got -1"]),
    "max_requests 0": (["--max_requests", "0"], ["argument --max_requests", "must be >= 1, got 0"]),
    "max_requests negative": (["--max_requests", "-2"], ["argument --max_requests", "must be >= 1, got -2"]),
    "tier_capacity 0": (["--kv_tier", "disk", "--kv_dir", "{tmp}/kv", "--tier_capacity", "0"],
                        ["argument --tier_capacity", "must be >= 1"]),
    "not an integer": (["--batch_size", "eight"], ["argument --batch_size", "expected an integer, got 'eight'"]),
    "impossible date": (["--from_date", "20221345"], ["argument --from_date", "20221345 is not a calendar date"]),
    "date format": (["--from_date", "2022-04-22"], ["argument --from_date", "YYYYMMDD"]),
    "unknown device": (["--device", "foo"], ["argument --device", "'foo' is not a device"]),
    "device of another kind": (["--device", "meta"], ["argument --device", "only cpu and cuda"]),
    "missing CUDA device": (["--device", "cuda:99"], ["argument --device", "'cuda:99'", "CUDA"]),
    "kv_dir is a file": (["--kv_tier", "disk", "--kv_dir", "{file}"], ["argument --kv_dir", "is not a directory"]),
    "kv_dir under a file": (["--kv_tier", "disk", "--kv_dir", "{file}/kv"], ["argument --kv_dir", "is not a directory"]),
    "disk tier without kv_dir": (["--kv_tier", "disk"], ["--kv_tier disk needs --kv_dir"]),
    "kv_dir without disk tier": (["--kv_dir", "{tmp}/kv"], ["--kv_dir is only used with --kv_tier disk"]),
    "redis tier without url": (["--kv_tier", "redis"], ["--kv_tier redis needs --redis_url"]),
    "redis url scheme": (["--kv_tier", "redis", "--redis_url", "localhost:6379"], ["argument --redis_url", "redis://"]),
    "redis_url without redis tier": (["--redis_url", "redis://127.0.0.1:1/0"], ["--redis_url is only used with"]),
    "tier_capacity without a tier": (["--tier_capacity", "1000"], ["--tier_capacity is only used with"]),
    "preset with checkpoint": (["--checkpoint", "{tmp}", "--preset", "tiny"], ["--preset is only used without"]),
    "recipe with checkpoint": (["--checkpoint", "{tmp}", "--recipe", "default"], ["--recipe is only used without"]),
    "unknown recipe": (["--recipe", "fast"], ["argument --recipe: invalid choice: 'fast'"]),
    "unknown preset": (["--preset", "huge"], ["argument --preset", "invalid choice: 'huge'"]),
    "tolerance negative": (["--tolerance", "-1"], ["argument --tolerance", "finite number >= 0"]),
    "tolerance nan": (["--tolerance", "nan"], ["argument --tolerance", "finite number >= 0"]),
    "seed negative": (["--seed", "-1"], ["argument --seed", "must be >= 0"]),
    "seed too large": (["--seed", str(2**64)], ["argument --seed", "must be < 2^63"]),
    "output is a directory": (["--output", "{tmp}"], ["argument --output", "is a directory"]),
    "output under a file": (["--output", "{file}/r.json"], ["argument --output", "is not a directory"]),
    "plot under a file": (["--plot", "{file}/r.png"], ["argument --plot", "is not a directory"]),
    "plot is the output": (["--output", "{tmp}/r.png"], ["--plot and --output name the same file"]),
    "cuda graphs on cpu": (["--device", "cpu", "--cuda_graphs"], ["--cuda_graphs needs a CUDA --device"]),
}


@pytest.mark.parametrize("case", list(PARSE_REFUSALS))
def test_bad_flag_is_refused_while_parsing(case: str, example, a_file: str, tmp_path: Path, capsys):
    flags, fragments = PARSE_REFUSALS[case]
    flags = [f.format(file=a_file, tmp=tmp_path) for f in flags]
    before = sorted(tmp_path.rglob("*"))
    code, err = run(example, ["--data_dir", NOT_LOADED, *flags], capsys)
    assert_refused(code, err, *fragments)
    assert sorted(tmp_path.rglob("*")) == before  # no output, no kv_dir


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused(example, capsys):
    code, err = run(example, ["--data_dir", NOT_LOADED, "--device", "cuda"], capsys)
    assert_refused(code, err, "argument --device", "CUDA is not available")


@pytest.mark.parametrize("flags, fragment", [
    (["--batch_size", "0"], "argument --batch_size: must be >= 1"),  # judged while parsing
    (["--kv_pages", "1"], "--kv_pages 1 is too small"),  # judged once the data is loaded
])  # fmt: skip
def test_the_real_script_exits_2_with_one_error(flags: list[str], fragment: str, processed: Path, tmp_path: Path):
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--data_dir", str(processed), "--preset", "tiny", *flags, "--quiet",
         "--output", str(tmp_path / "r.json")],
        capture_output=True, text=True, cwd=REPO_ROOT, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    assert_refused(done.returncode, done.stderr, fragment)
    assert not (tmp_path / "r.json").exists()


# ---------------------------------------------------------------- refusals that need the data
def random_model_flags(processed: Path, tmp_path: Path) -> list[str]:
    return ["--data_dir", str(processed), "--preset", "tiny", "--no_compare", "--no_cost_probe", "--max_requests", "12",
            "--batch_size", "4", "--output", str(tmp_path / "r.json")]  # fmt: skip


def test_kv_pages_must_hold_the_largest_batch_and_that_is_enough(example, processed: Path, tmp_path: Path, capsys):
    flags = random_model_flags(processed, tmp_path)
    code, err = run(example, [*flags, "--kv_pages", "1"], capsys)
    assert_refused(code, err, "--kv_pages 1 is too small", "--batch_size")
    needed = int(re.search(r"needs (\d+) pages", err).group(1))
    assert needed > 1
    code, err = run(example, [*flags, "--kv_pages", str(needed - 1)], capsys)
    assert_refused(code, err, f"--kv_pages {needed - 1} is too small", f"needs {needed} pages")
    assert not (tmp_path / "r.json").exists()
    assert run(example, [*flags, "--kv_pages", str(needed)], capsys)[0] == 0  # the bound is exact
    assert (tmp_path / "r.json").is_file()


def test_no_visits_after_from_date_names_the_flag(example, processed: Path, tmp_path: Path, capsys):
    code, err = run(example, [*random_model_flags(processed, tmp_path), "--from_date", "20300101"], capsys)
    assert_refused(code, err, "--from_date 20300101", "no visits")


def test_a_device_pool_that_cannot_be_allocated_is_refused(example, processed: Path, tmp_path: Path, capsys):
    code, err = run(example, [*random_model_flags(processed, tmp_path), "--kv_pages", str(10**14)], capsys)
    assert_refused(code, err, "cannot be allocated", "--kv_pages")


@pytest.mark.skipif(not Path("/proc/1").is_dir(), reason="needs /proc")
def test_a_kv_dir_that_cannot_be_created_is_refused(example, processed: Path, tmp_path: Path, capsys):
    flags = [*random_model_flags(processed, tmp_path), "--kv_tier", "disk", "--kv_dir", "/proc/1/kv"]
    code, err = run(example, flags, capsys)
    assert_refused(code, err, "--kv_dir /proc/1/kv")


def test_a_directory_that_is_not_an_output_names_data_dir(example, tmp_path: Path, capsys):
    code, err = run(example, ["--data_dir", str(tmp_path), "--output", str(tmp_path / "r.json")], capsys)
    assert_refused(code, err, "--data_dir", "manifest")


def test_replay_defaults_are_the_parsers_with_the_fields_given_over_them(tmp_path: Path):
    """What kvcache/codec_report.py and kvcache/entropy.py hand to the replay's load_model and cache_config."""
    from benchmark.serving.end2end_args import build_parser, parse_args, replay_defaults

    parsed = vars(parse_args(build_parser(""), ["--data_dir", str(tmp_path)]))
    given = vars(replay_defaults(data_dir=str(tmp_path), device="cpu", batch_size=3, codecs=["raw"]))
    assert given == {**parsed, "device": "cpu", "batch_size": 3, "codecs": ["raw"]}
    assert given["recipe"] is None and given["kv_codec"] == "raw" and given["preset"] == "demo"
