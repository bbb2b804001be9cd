"""How far can a lossless codec shrink a trained model's K/V? Entropy against what zstd and zstd-channel achieve.

    python -m benchmark.kvcache.entropy --data_dir artifacts/synthetic/processed \\
        --checkpoint artifacts/synthetic/checkpoint --max_requests 300 --output kv_entropy.json

Replays the first visits from the split date through a KV cache large enough to keep every user,
then reads every page the cache holds. Partly filled last pages are left out (their zero slots
compress for free and would flatter any codec), so the figures are those of a long history. For
the pages as the model stored them (fp32 here) and rounded to bf16 (what a bf16-serving model
stores), it reports:

- the order-0 entropy of each value's sign and exponent, and of its leading mantissa byte; the
  remaining mantissa bits count as incompressible. Bits per value over that sum bounds what a coder
  of independent values can reach (`order0_bound`);
- the same entropies given each value's channel (layer, K or V, head, dim), which a coder can use by
  storing a reference per channel and page (`channel_bound`; the references' bytes not counted);
- what the `zstd` codec (byte-plane shuffle, zstd per page) and the `zstd-channel` codec (sign and exponent
  against each channel's median, kvcache/codecs/channel_zstd.py) store, per page as the tiers store it.

A ratio above the order-0 bound needs structure across values: trained K/V have it across channels
(each has its scale and sign), which per-page zstd cannot see and `zstd-channel` codes.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np
import torch

from benchmark.cli import DTYPES, add_checkpoint, add_data_dir, add_output
from benchmark.report import write_json
from benchmark.serving.end2end_args import replay_defaults
from benchmark.serving.replay_setup import cache_config, load_model, working_set_pages
from data.dataset import InferenceDataset
from data.schema import DEFAULT_SPLIT_DATE, beijing_midnight_ms
from kvcache import KVCacheManager, PageLayout
from kvcache.codecs import get_codec
from kvcache.page_data import PageData
from model.checkpoint import model_fingerprint
from model.inference import InferenceSession
from model.replay import replay

CODECS = ("zstd", "zstd-channel")  # the lossless codecs measured against the bounds


def entropy_bits(values: np.ndarray) -> float:
    counts = np.bincount(values.ravel())
    return entropy_bits_of_counts(counts[counts > 0])


def entropy_bits_of_counts(counts: np.ndarray) -> float:
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def conditional_entropy_bits(values: np.ndarray, context: np.ndarray) -> float:
    """H(values | context) in bits, from the joint and the context's counts (both non-negative int64)."""
    joint = np.unique(context.ravel() * (int(values.max()) + 1) + values.ravel(), return_counts=True)[1]
    return entropy_bits_of_counts(joint) - entropy_bits_of_counts(np.unique(context, return_counts=True)[1])


@dataclasses.dataclass(frozen=True)
class _Fields:
    """A float32 or bf16 tensor's values split as the bounds count them (int64 arrays of its shape)."""

    bits: int  # of a value
    sign_exponent: np.ndarray  # the top 9 bits
    lead: np.ndarray  # the leading mantissa bits, at most 8
    leading: int  # how many those are
    rest: int  # the other mantissa bits, counted as incompressible

    @classmethod
    def of(cls, values: torch.Tensor) -> _Fields:
        bits = values.element_size() * 8
        words = values.contiguous().view(torch.int32 if bits == 32 else torch.int16).numpy().astype(np.int64)
        words &= (1 << bits) - 1
        mantissa_bits = bits - 9
        leading = min(8, mantissa_bits)
        return cls(bits, words >> mantissa_bits, (words >> (mantissa_bits - leading)) & ((1 << leading) - 1),
                   leading, mantissa_bits - leading)


def order0_bound(values: torch.Tensor) -> dict[str, float]:
    """Entropy of sign + exponent and of the leading mantissa byte of float32 or bf16 values."""
    f = _Fields.of(values)
    sign_exponent, lead_mantissa = entropy_bits(f.sign_exponent), entropy_bits(f.lead)
    bits_per_value = sign_exponent + lead_mantissa + f.rest
    return {"bits": f.bits, "sign_exponent_bits": sign_exponent, "leading_mantissa_bits": lead_mantissa,
            "leading_mantissa_width": f.leading, "bits_per_value": bits_per_value,
            "order0_bound": f.bits / bits_per_value}


def channel_bound(values: torch.Tensor) -> dict[str, float]:
    """`order0_bound`'s entropies given each value's channel: values [k, L, 2, S, H, D] float32 or bf16."""
    f = _Fields.of(values)
    _, num_layers, two, _, heads, dim = values.shape
    channel = np.arange(num_layers * two * heads * dim).reshape(num_layers, two, 1, heads, dim)
    channel = np.broadcast_to(channel[None], f.sign_exponent.shape)
    se_bits = conditional_entropy_bits(f.sign_exponent, channel)
    lead_bits = conditional_entropy_bits(f.lead, channel * 512 + f.sign_exponent)
    bits_per_value = se_bits + lead_bits + f.rest
    # what the previous token of the page adds to the channel (tokens 1.. of each page): a coder
    # of neighbouring tokens could take this much more from the sign and exponent
    se, before = f.sign_exponent[:, :, :, 1:], f.sign_exponent[:, :, :, :-1]
    here = channel[:, :, :, 1:]
    return {"channel_sign_exponent_bits": se_bits, "channel_leading_mantissa_bits": lead_bits,
            "channel_bits_per_value": bits_per_value, "channel_bound": f.bits / bits_per_value,
            "channel_sign_exponent_bits_tokens_after_first": conditional_entropy_bits(se, here),
            "channel_previous_token_sign_exponent_bits": conditional_entropy_bits(se, here * 512 + before)}


def full_pages(cache: KVCacheManager, user_ids: np.ndarray) -> torch.Tensor:
    """The K/V of every full page of the users' cached tokens, [k, L, 2, S, H, D] (through `read_kv`)."""
    layout = cache.config.page_layout
    pages = []
    for u in user_ids.tolist():
        per_layer = [torch.stack(cache.read_kv(u, layer)) for layer in range(layout.num_layers)]  # [2, n, H, D]
        n = per_layer[0].shape[1] // layout.page_size * layout.page_size
        kv = torch.stack(per_layer)[:, :, :n]  # [L, 2, n, H, D]
        pages.append(kv.unflatten(2, (-1, layout.page_size)).permute(2, 0, 1, 3, 4, 5))
    return torch.cat(pages)


def codec_stats(codec: str, layout: PageLayout, kv: torch.Tensor) -> dict[str, float]:
    """What `codec` stores for these pages (times zero: they are not the question), and how fast:
    {codec}_ratio (raw page bytes over stored bytes), {codec}_encode_mb_s and {codec}_decode_mb_s
    (raw megabytes a second, one pass each, this process's torch threads)."""
    pages = PageData(kv, torch.zeros(kv.shape[0], layout.page_size, dtype=torch.int64))
    coder, nbytes = get_codec(codec), kv.shape[0] * layout.page_nbytes
    started = time.perf_counter()
    encoded = coder.encode(layout, pages)
    encoded_s = time.perf_counter() - started
    started = time.perf_counter()
    decoded = coder.decode(layout, encoded)
    decoded_s = time.perf_counter() - started
    if not torch.equal(decoded.kv.view(torch.uint8), kv.contiguous().view(torch.uint8)):
        raise AssertionError(f"codec {codec} did not give back the pages it was given")
    return {f"{codec}_ratio": nbytes / encoded.nbytes, f"{codec}_encode_mb_s": nbytes / encoded_s / 1e6,
            f"{codec}_decode_mb_s": nbytes / decoded_s / 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(p)
    add_checkpoint(p, help="model.train output (omit: a random-init --preset model)")
    p.add_argument("--preset", default="demo", help="the random-init model's preset (without --checkpoint)")
    p.add_argument("--max_requests", type=int, default=300)
    p.add_argument("--from_date", type=int, default=DEFAULT_SPLIT_DATE)
    add_output(p, "kv_entropy.json")
    # the replay's defaults for what load_model and cache_config read, on the CPU
    args = replay_defaults(**vars(p.parse_args(argv)), device="cpu")
    dataset = InferenceDataset(args.data_dir)
    model = load_model(args, dataset)
    indices = dataset.request_indices(from_time_ms=beijing_midnight_ms(args.from_date), max_requests=args.max_requests)
    pages_needed, largest = working_set_pages(model, dataset, indices, model.config.page_size)
    fingerprint = model_fingerprint(model)
    config = cache_config(args, model, pages_needed, largest, model.config.page_size, fingerprint)
    with KVCacheManager(dataclasses.replace(config, num_pages=pages_needed + args.batch_size * largest)) as cache:
        session = InferenceSession(model, dataset, kv_cache=cache, model_fingerprint=fingerprint)
        replay(session, list(dataset.batches(indices, args.batch_size)), "replay", progress=False)
        kv = full_pages(cache, np.unique(dataset.requests.user_id[indices]))
        layout = cache.config.page_layout
    rows = {}
    for name, dtype in DTYPES.items():
        typed, values = dataclasses.replace(layout, dtype=dtype), kv.to(dtype)
        rows[name] = {**order0_bound(values), **channel_bound(values),
                      **{key: v for codec in CODECS for key, v in codec_stats(codec, typed, values).items()}}
    report = {"checkpoint": args.checkpoint, "num_requests": len(indices), "full_pages": kv.shape[0],
              "tokens": kv.shape[0] * layout.page_size, "dtypes": rows}
    write_json(args.output, report)
    print(f"{kv.shape[0]} full pages ({report['tokens']} tokens) of {args.checkpoint}")
    print(f"{'K/V dtype':<10} {'H(sign+exp)':>11} {'H(lead mant.)':>13} {'bits/value':>10} {'order-0 bound':>13} "
          f"{'given channel':>13} {'channel bound':>13} {'zstd':>6} {'zstd-channel':>12}")
    for name, r in rows.items():
        print(f"{name:<10} {r['sign_exponent_bits']:>11.2f} {r['leading_mantissa_bits']:>8.2f} of {r['leading_mantissa_width']}"
              f" {r['bits_per_value']:>10.2f} {r['order0_bound']:>12.3f}x {r['channel_bits_per_value']:>13.2f}"
              f" {r['channel_bound']:>12.3f}x {r['zstd_ratio']:>5.3f}x {r['zstd-channel_ratio']:>11.3f}x")
    for name, r in rows.items():
        speeds = (f"{c} encode {r[f'{c}_encode_mb_s']:.0f} / decode {r[f'{c}_decode_mb_s']:.0f} MB/s" for c in CODECS)
        print(f"{name}: " + ", ".join(speeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
