"""Ways to decode `int8` pages into the pool, each timed against the raw onload's copy in the same run.

    PYTHONPATH=. python benchmark/int8_decode_variants.py --pages 128 512 --threads 2 [--compile] \\
        [--output int8_decode_variants.json]

The destination is a slice of a pool-shaped tensor ([L, 2, P, S, H, D], viewed page-major as the
pool's onload writes it), kuairand-1k geometry (3 layers, 4 heads x 128, page 32: 384 KiB of fp32
a page). Variants, each writing the same values (checked against the codec's own decode):

- `raw copy`: fp32 pages copied into the pool, what a raw onload costs;
- `as built`: `Int8Values.decode_into` (an exact int8 -> fp32 copy, then the scale in place, in
  cache-sized steps);
- `one mixed-type pass`: `torch.mul(codes, scale, out=pages)`;
- `numpy cast-and-multiply`: numpy's buffered ufunc over the pages, split over the threads;
- `split over Python threads`: each thread single-threaded (`torch.set_num_threads(1)` in it, which
  also sets ATen's default for threads started later), 8-page steps of the built decode's passes;
- `torch.compile` (with --compile): inductor's CPU code for `codes.float() * scale`, dynamic shapes.

Prints the median time of each and its ratio to the raw copy's; docs/benchmarks.md, "int8 onload
in cache-sized steps", has the figures and why the built decode is the one kept.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from tqdm import tqdm

from kvcache.codecs.int8 import Int8Values
from kvcache.page_layout import PageLayout

LAYOUT = PageLayout(num_layers=3, num_heads=4, head_dim=128, page_size=32, dtype=torch.float32)
_STEP_PAGES = 8


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return float(np.median(times)) * 1e3


def variants(num_pages: int, workers: ThreadPoolExecutor, threads: int,
             compile_decode: bool) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """For `num_pages` random pages: {name: fn}, each fn decoding (or copying) into `out`, the pool view
    they write, and the values `Int8Values.decode` gives."""
    codec = Int8Values(affine=False)
    shape = (num_pages, *LAYOUT.page_shape)
    source = torch.randn(shape)
    rows = torch.empty(num_pages, codec.width(LAYOUT, LAYOUT.num_layers), dtype=torch.uint8)
    codec.encode_into(LAYOUT, source, rows)
    scales, _, codes = codec._fields(LAYOUT, rows, LAYOUT.num_layers)
    per_value = scales[:, :, :, None, :, None]  # [k, l, 2, 1, H, 1]
    pool = torch.empty(LAYOUT.num_layers, 2, num_pages + 8, *LAYOUT.page_shape[2:])
    out = pool[:, :, 4 : 4 + num_pages].permute(2, 0, 1, 3, 4, 5)  # the onload's page-major view
    codes_np, scales_np, out_np = codes.numpy(), per_value.numpy(), out.numpy()
    cuts = np.linspace(0, num_pages, threads + 1).astype(int)

    def on_threads(part) -> None:
        for future in [workers.submit(part, lo, hi) for lo, hi in itertools.pairwise(cuts)]:
            future.result()

    def numpy_part(lo: int, hi: int) -> None:
        np.multiply(codes_np[lo:hi], scales_np[lo:hi], out=out_np[lo:hi], casting="unsafe")

    def steps_part(lo: int, hi: int) -> None:
        for first in range(lo, hi, _STEP_PAGES):
            pages = slice(first, min(first + _STEP_PAGES, hi))
            out[pages].copy_(codes[pages])
            out[pages].mul_(per_value[pages])

    table = {
        "raw copy": lambda: out.copy_(source),
        "as built": lambda: codec.decode_into(LAYOUT, rows, out),
        "one mixed-type pass": lambda: torch.mul(codes, per_value, out=out),
        "numpy cast-and-multiply": lambda: on_threads(numpy_part),
        "split over Python threads": lambda: on_threads(steps_part),
    }
    if compile_decode:
        compiled = torch.compile(lambda c, s, o: o.copy_(c.float() * s), dynamic=True)
        table["torch.compile"] = lambda: compiled(codes, per_value, out)
    return table, out, codec.decode(LAYOUT, rows, LAYOUT.num_layers)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, nargs="+", default=[32, 128, 512])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--compile", action="store_true", help="also time torch.compile's decode (compiles for seconds)")
    p.add_argument("--output", help="write the results as JSON")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    # Single-threaded decode threads, for the two variants that split the pages over them.
    workers = ThreadPoolExecutor(args.threads, initializer=torch.set_num_threads, initargs=(1,))
    results = []
    for num_pages in tqdm(args.pages, desc="page counts"):
        table, out, expected = variants(num_pages, workers, args.threads, args.compile)
        for name, fn in table.items():
            ms = _median_ms(fn, args.repeats)
            if name != "raw copy" and not torch.equal(out, expected):
                raise AssertionError(f"{name} decoded other values than Int8Values.decode ({num_pages} pages)")
            results.append({"pages": num_pages, "variant": name, "ms": ms})
    raw = {r["pages"]: r["ms"] for r in results if r["variant"] == "raw copy"}
    print(f"int8 decode into the pool, {args.threads} threads, medians of {args.repeats}; ratio = time / raw copy's")
    print(f"{'variant':28s} {'pages':>6s} {'ms':>8s} {'ratio':>7s}")
    for r in results:
        r["ratio_to_raw"] = r["ms"] / raw[r["pages"]]
        print(f"{r['variant']:28s} {r['pages']:6d} {r['ms']:8.2f} {r['ratio_to_raw']:6.2f}x")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"threads": args.threads, "repeats": args.repeats, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
