"""The device pool decodes pages read from an encoded tier straight into its pages, whatever page ids
they get, and hands pages back out lowest first so that a user's pages stay runs."""
import numpy as np
import pytest
import torch

from kvcache import PageLayout
from kvcache.page_data import decoded, empty_pages
from kvcache.pool import DevicePagePool
from kvcache.storage.tier_codec import TierCodec

LAYOUT = PageLayout(num_layers=2, num_heads=2, head_dim=8, page_size=4, dtype=torch.float32)


def _encoded(codec: str, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    pages = empty_pages(LAYOUT, n)
    pages.kv.copy_(torch.randn(pages.kv.shape, generator=g))
    pages.times.copy_(torch.randint(0, 1 << 40, pages.times.shape, generator=g))
    tier_codec = TierCodec(codec)
    encoded = tier_codec.encode(LAYOUT, pages)
    return tier_codec.deferred(LAYOUT, [encoded.page_range(0, n // 2), encoded.page_range(n // 2, n)])


@pytest.mark.parametrize("codec", ["bf16", "int8", "int8:group=token", "mixed", "zstd"])
@pytest.mark.parametrize("page_ids", [[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], [7, 2, 3, 9, 10, 0]],
                         ids=["run", "descending", "scattered"])
def test_copy_in_decodes_into_any_pages(codec, page_ids):
    src = _encoded(codec, len(page_ids), seed=len(codec))
    pool = DevicePagePool(LAYOUT, num_pages=12, device=torch.device("cpu"))
    pool.copy_in([(page_ids, src)])
    want = decoded(src)
    idx = torch.tensor(page_ids)
    assert torch.equal(pool.kv[:, :, idx].permute(2, 0, 1, 3, 4, 5), want.kv)
    assert torch.equal(pool.times[idx], want.times)
    untouched = torch.tensor(sorted(set(range(13)) - set(page_ids)))
    assert not pool.kv[:, :, untouched].any() and not pool.times[untouched].any()


def test_freed_pages_come_back_lowest_first_in_runs():
    pool = DevicePagePool(LAYOUT, num_pages=16, device=torch.device("cpu"))
    a, b = pool.alloc(5), pool.alloc(5)
    assert list(a) == [0, 1, 2, 3, 4] and list(b) == [5, 6, 7, 8, 9]
    pool.free(array_of([9, 5, 7, 6, 8]))  # in any order
    pool.free(a)
    again = list(pool.alloc(10))
    assert again == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert np.all(np.diff(again) == 1)


def array_of(ids):
    from array import array

    return array("q", ids)


@pytest.mark.parametrize("codec", ["bf16", "int8", "int8:group=token", "mixed", "zstd"])
def test_decode_to_pages_scatters_the_host_decode(codec):
    """What the CUDA pool runs for encoded pages (here on CPU tensors, int8 through Triton's interpreter),
    across the parts of a read and for a range of them: the decoded pages at their ids, nothing else."""
    src = _encoded(codec, 6, seed=3)
    want = decoded(src)
    for part, ids, first in ((src, [9, 0, 4, 5, 6, 2], 0), (src.page_range(1, 5), [3, 8, 1, 7], 1)):
        kv = torch.zeros(LAYOUT.num_layers, 2, 10, *LAYOUT.page_shape[2:])
        times = torch.zeros(10, LAYOUT.page_size, dtype=torch.int64)
        part.decode_to_pages(kv, times, torch.tensor(ids))
        idx = torch.tensor(ids)
        torch.testing.assert_close(kv[:, :, idx].permute(2, 0, 1, 3, 4, 5), want.kv[first : first + len(ids)],
                                   rtol=torch.finfo(torch.float32).eps, atol=1e-6)
        assert torch.equal(times[idx], want.times[first : first + len(ids)])
        untouched = torch.tensor(sorted(set(range(10)) - set(ids)))
        assert not kv[:, :, untouched].any() and not times[untouched].any()


@pytest.mark.parametrize("codec", ["bf16", "int8", "int8:group=token", "mixed"])
def test_fixed_width_codecs_decode_where_their_bytes_are(codec):
    """On the meta device every op runs without data: without a kernel for the device, the decode of these
    codecs is tensor ops only (nothing that needs the bytes on the host), so it runs wherever the encoded
    bytes (a quarter of the decoded ones for int8) have been moved."""
    src = _encoded(codec, 6, seed=4)
    kv = torch.empty(LAYOUT.num_layers, 2, 10, *LAYOUT.page_shape[2:], device="meta")
    times = torch.empty(10, LAYOUT.page_size, dtype=torch.int64, device="meta")
    src.decode_to_pages(kv, times, torch.arange(6, device="meta"))
