"""int8:group=token: fbgemm's rowwise format, decoded by its kernel straight into pool-shaped pages on
the host, equal to the torch decode used everywhere else, whatever the threads."""
import pytest
import torch

from kvcache import PageLayout
from kvcache.codecs.int8_rows import Int8RowValues
from kvcache.page_data import empty_pages

LAYOUT = PageLayout(num_layers=3, num_heads=2, head_dim=16, page_size=4, dtype=torch.float32)


def _encoded(k, seed):
    g = torch.Generator().manual_seed(seed)
    pages = empty_pages(LAYOUT, k)
    pages.kv.copy_(torch.randn(pages.kv.shape, generator=g) * torch.rand(pages.kv.shape[:-1] + (1,), generator=g) * 5)
    values = Int8RowValues()
    # rows as a tier holds them: 16 bytes of something else (the times) ahead of each page's codes
    rows = torch.full((k, 16 + values.width(LAYOUT, 3)), 0xAB, dtype=torch.uint8)[:, 16:]
    values.encode_into(LAYOUT, pages.kv, rows)
    return values, rows, pages


def test_the_rows_are_fbgemms_format():
    """A row is [codes][scale][minimum], so fbgemm's own decode reads it as written."""
    values, rows, pages = _encoded(3, 0)
    fused = rows.reshape(-1, LAYOUT.head_dim + 8)
    want = torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(fused.contiguous())
    assert torch.equal(values.decode(LAYOUT, rows, 3).reshape(-1, LAYOUT.head_dim), want)
    step = (pages.kv.amax(-1, keepdim=True) - pages.kv.amin(-1, keepdim=True)) / 255
    assert bool(((want.view(pages.kv.shape) - pages.kv).abs() <= step / 2 * 1.0001 + 1e-6).all())


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 5])
def test_kernel_decode_into_pool_pages_equals_the_torch_decode(threads, k):
    """Pool pages are layer-major ([layers, 2, pages, ...]): each (layer, K/V) block of a run of pages is
    contiguous, which is where the kernel writes; pages outside the run are untouched."""
    values, rows, _ = _encoded(k, k)
    pool = torch.full((3, 2, k + 4, *LAYOUT.page_shape[2:]), 7.0)
    dst = pool[:, :, 2 : 2 + k].permute(2, 0, 1, 3, 4, 5)
    from kvcache.codecs.int8_rows import _blocks_contiguous

    assert values._kernel_can_write(rows, dst) and _blocks_contiguous(dst)  # the in-place path is the one tested
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        values.decode_into(LAYOUT, rows, dst)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(dst, values.decode(LAYOUT, rows, 3))
    assert bool((pool[:, :, :2] == 7.0).all()) and bool((pool[:, :, 2 + k :] == 7.0).all())


def test_page_major_pages_and_other_dtypes_decode_equal():
    """A tier's fresh pages are page-major (blocks strided by page): decoded block-major by the kernel, then
    copied; a bf16 layout takes the torch decode. Both equal `decode`."""
    values, rows, _ = _encoded(4, 9)
    page_major = torch.empty(4, *LAYOUT.page_shape)
    values.decode_into(LAYOUT, rows, page_major)
    assert torch.equal(page_major, values.decode(LAYOUT, rows, 3))
    bf16 = PageLayout(3, 2, 16, 4, torch.bfloat16)
    out = torch.empty(4, *bf16.page_shape, dtype=torch.bfloat16)
    assert not values._kernel_can_write(rows, out)
    values.decode_into(bf16, rows, out)
    assert torch.equal(out, values.decode(bf16, rows, 3))


def test_a_run_of_layers_decodes_into_its_layers_only():
    """`mixed:deep=int8token` decodes layers [1, 3) into a slice of the pool's layers."""
    values = Int8RowValues()
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 2, 2, *LAYOUT.page_shape[2:], generator=g)
    rows = torch.empty((2, values.width(LAYOUT, 2)), dtype=torch.uint8)
    values.encode_into(LAYOUT, kv, rows)
    pool = torch.full((3, 2, 2, *LAYOUT.page_shape[2:]), 7.0)
    dst = pool.permute(2, 0, 1, 3, 4, 5)
    values.decode_into(LAYOUT, rows, dst[:, 1:])
    assert torch.equal(dst[:, 1:], values.decode(LAYOUT, rows, 2)) and bool((pool[0] == 7.0).all())


def test_a_forked_child_decodes_with_its_own_threads():
    """A child forked after the parent decoded inherits an executor with no threads behind it."""
    import multiprocessing

    values, rows, _ = _encoded(3, 2)
    pool = torch.zeros(3, 2, 3, *LAYOUT.page_shape[2:])
    values.decode_into(LAYOUT, rows, pool.permute(2, 0, 1, 3, 4, 5))  # the parent's threads exist now
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as children:
        decoded = children.apply_async(_decode_in_child, (values, rows)).get(timeout=60)
    assert torch.equal(decoded, pool.permute(2, 0, 1, 3, 4, 5))


def test_a_child_forked_while_a_parent_thread_starts_the_decoders_does_not_hang():
    """The lock that guards the executor's start may be copied held into a child: the child gets its own."""
    import multiprocessing

    from kvcache.codecs import int8_rows

    values, rows, _ = _encoded(3, 2)
    context = multiprocessing.get_context("fork")
    with int8_rows._WORKERS_LOCK, context.Pool(1) as children:  # forked with the lock held
        decoded = children.apply_async(_decode_in_child, (values, rows)).get(timeout=60)
    assert torch.equal(decoded, values.decode(LAYOUT, rows, 3))


def _decode_in_child(values, rows):
    torch.set_num_threads(2)
    pool = torch.zeros(3, 2, 3, *LAYOUT.page_shape[2:])
    values.decode_into(LAYOUT, rows, pool.permute(2, 0, 1, 3, 4, 5))
    return pool.permute(2, 0, 1, 3, 4, 5).clone()


def test_decode_buffers_are_reused_and_kept_only_up_to_their_cap(monkeypatch):
    from kvcache.codecs.int8_rows import _Buffers

    buffers = _Buffers()
    monkeypatch.setattr(_Buffers, "KEEP_NBYTES", 1000)
    small = buffers.take(100, torch.float32)
    assert buffers.take(50, torch.float32).data_ptr() == small.data_ptr()  # reused
    big = buffers.take(1000, torch.float32)  # 4000 bytes: past the cap
    assert big.numel() == 1000 and buffers.by_dtype[torch.float32].data_ptr() == small.data_ptr()
