"""benchmark/kvcache/entropy.py: the order-0 bound on values whose entropy is known, and the script end to end."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import build_processed


@pytest.fixture(scope="module")
def kv_entropy():
    from benchmark.kvcache import entropy

    return entropy


def test_order0_bound_of_known_distributions(kv_entropy):
    one_value = kv_entropy.order0_bound(torch.full((4096,), 1.5))
    assert one_value["sign_exponent_bits"] == 0 and one_value["leading_mantissa_bits"] == 0
    assert one_value["bits_per_value"] == 15 and one_value["order0_bound"] == pytest.approx(32 / 15)
    # two exponents and two signs, equally often, leading mantissa byte uniform over 256: 2 + 8 + 15 bits
    mantissas = torch.arange(256).repeat(16).float() / 256
    x = (1 + mantissas) * torch.tensor([1.0, -1.0, 2.0, -2.0]).repeat_interleave(1024)
    r = kv_entropy.order0_bound(x)
    assert r["sign_exponent_bits"] == pytest.approx(2) and r["leading_mantissa_bits"] == pytest.approx(8)
    assert r["order0_bound"] == pytest.approx(32 / 25)
    exact_in_bf16 = (1 + torch.arange(128).repeat(32).float() / 128) * torch.tensor([1.0, -1.0]).repeat_interleave(2048)
    bf16 = kv_entropy.order0_bound(exact_in_bf16.to(torch.bfloat16))  # sign: 1 bit, all 7 mantissa bits uniform
    assert bf16["leading_mantissa_width"] == 7 and bf16["bits_per_value"] == pytest.approx(1 + 7)
    assert bf16["order0_bound"] == pytest.approx(2)


def test_channel_bound_sees_what_each_channel_holds(kv_entropy):
    """Two channels, one always +1.5 x 2^e and one -1.5 x 2^(e+3) (e uniform over 4 exponents per page):
    over all values the sign and exponent are spread, given the channel only e remains (2 bits)."""
    g = torch.Generator().manual_seed(0)
    e = torch.randint(0, 4, (8, 1, 1, 64, 1, 1), generator=g).float()  # [k, L, 2, S, H, D] with 2 channels below
    kv = torch.cat([1.5 * torch.exp2(e), -1.5 * torch.exp2(e + 3)], dim=2)  # K: channel 0, V: channel 1
    r = kv_entropy.channel_bound(kv)
    assert r["channel_sign_exponent_bits"] == pytest.approx(2, abs=0.01)
    assert r["channel_leading_mantissa_bits"] == pytest.approx(0)
    assert r["channel_bound"] == pytest.approx(32 / (2 + 15), rel=1e-3)
    assert kv_entropy.order0_bound(kv)["sign_exponent_bits"] > 2.9  # 8 sign-exponent pairs, near-uniform


def test_report_on_tiny_data(kv_entropy, tmp_path):
    processed = build_processed(tmp_path / "data")
    out = tmp_path / "entropy.json"
    assert kv_entropy.main(["--data_dir", str(processed), "--preset", "tiny", "--max_requests", "24",
                            "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["full_pages"] > 0
    fp32, bf16 = report["dtypes"]["float32"], report["dtypes"]["bfloat16"]
    assert 1 < fp32["order0_bound"] < bf16["order0_bound"]
    assert fp32["zstd_ratio"] > 1 and bf16["zstd_ratio"] > fp32["zstd_ratio"]
    for row in (fp32, bf16):  # the channel is context: never more bits than without it
        assert row["channel_bits_per_value"] <= row["bits_per_value"] + 1e-9 and row["zstd-channel_ratio"] > 1
        assert row["channel_previous_token_sign_exponent_bits"] <= row["channel_sign_exponent_bits_tokens_after_first"] + 1e-9
        assert all(row[f"{codec}_{way}_mb_s"] > 0 for codec in ("zstd", "zstd-channel") for way in ("encode", "decode"))
