"""paged_kvcache_ops: append/gather against a plain-indexing reference, validation, torch.library checks."""
import pytest
import torch

from kvcache import paged_kvcache_ops as ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cache(num_pages=6, page_size=4, heads=3, head_dim=8, dtype=torch.float32):
    k = torch.zeros(num_pages, page_size, heads, head_dim, dtype=dtype)
    return k, torch.zeros_like(k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [8, 3])  # 3: rows that are not a whole number of 16-byte words
def test_append_then_gather_matches_reference(dtype, head_dim):
    g = torch.Generator().manual_seed(0)
    k, v = _cache(head_dim=head_dim, dtype=dtype)
    slots = torch.randperm(k.shape[0] * k.shape[1], generator=g)[:13]
    new_k = torch.randn(13, 3, head_dim, generator=g).to(dtype)
    new_v = torch.randn(13, 3, head_dim, generator=g).to(dtype)
    ref_k, ref_v = k.clone().view(-1, 3, head_dim), v.clone().view(-1, 3, head_dim)
    ref_k[slots], ref_v[slots] = new_k, new_v

    ops.append_kvcache(k, v, new_k, new_v, slots)
    assert torch.equal(k.view(-1, 3, head_dim), ref_k) and torch.equal(v.view(-1, 3, head_dim), ref_v)

    order = slots.flip(0)
    got_k, got_v = ops.gather_kvcache(k, v, order)
    assert torch.equal(got_k, ref_k[order]) and torch.equal(got_v, ref_v[order])


def test_append_is_bit_exact_for_nan_payloads():
    k, v = _cache()
    bits = torch.randint(-(2**31), 2**31 - 1, (5, 3 * 8), dtype=torch.int32)
    new = bits.view(torch.float32).view(5, 3, 8)
    slots = torch.tensor([0, 3, 7, 8, 23])
    ops.append_kvcache(k, v, new, new, slots)
    got, _ = ops.gather_kvcache(k, v, slots)
    assert torch.equal(got.view(torch.int32), new.view(torch.int32))


def test_empty_batch():
    k, v = _cache()
    empty = torch.zeros(0, 3, 8)
    ops.append_kvcache(k, v, empty, empty, torch.zeros(0, dtype=torch.int64))
    got_k, got_v = ops.gather_kvcache(k, v, torch.zeros(0, dtype=torch.int64))
    assert got_k.shape == (0, 3, 8) and got_v.shape == (0, 3, 8)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.update(new_k=a["new_k"][:, :2]), "new_k must have shape"),
        (lambda a: a.update(new_v=a["new_v"].double()), "new_v has dtype"),
        (lambda a: a.update(slots=a["slots"].int()), "must be a 1-D int64"),
        (lambda a: a.update(slots=a["slots"][:2]), "new_k must have shape"),
        (lambda a: a.update(v=a["v"][:, :2].contiguous()), "v_cache .* must match"),
        (lambda a: a.update(k=a["k"][0]), "k_cache must be"),
    ],
)
def test_append_validates(mutate, match):
    k, v = _cache()
    args = dict(k=k, v=v, new_k=torch.zeros(3, 3, 8), new_v=torch.zeros(3, 3, 8), slots=torch.tensor([1, 2, 3]))
    mutate(args)
    with pytest.raises(ValueError, match=match):
        ops.append_kvcache(args["k"], args["v"], args["new_k"], args["new_v"], args["slots"])


def test_gather_validates():
    k, v = _cache()
    with pytest.raises(ValueError, match="kv_slots must be a 1-D int64"):
        ops.gather_kvcache(k, v, torch.tensor([[1]]))
    with pytest.raises(ValueError, match="contiguous"):
        ops.gather_kvcache(k.transpose(0, 1), v.transpose(0, 1), torch.tensor([1]))


def test_registered_ops_pass_opcheck():
    k, v = _cache()
    slots = torch.tensor([2, 9, 17])
    new = torch.randn(3, 3, 8)
    torch.library.opcheck(torch.ops.hstu_kvcache.append_kvcache.default, (k, v, new, new, slots))
    torch.library.opcheck(torch.ops.hstu_kvcache.gather_kvcache.default, (k, v, slots))


def test_ops_trace_under_torch_compile():
    def step(k, v, new_k, new_v, new_slots, kv_slots):
        ops.append_kvcache(k, v, new_k, new_v, new_slots)
        kk, vv = ops.gather_kvcache(k, v, kv_slots)
        return (kk * vv).sum(dim=-1)

    k, v = _cache()
    new = torch.randn(3, 3, 8)
    new_slots, kv_slots = torch.tensor([2, 9, 17]), torch.tensor([0, 2, 9, 17])
    expected = step(k.clone(), v.clone(), new, new, new_slots, kv_slots)
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    assert torch.equal(compiled(k, v, new, new, new_slots, kv_slots), expected)
    assert torch.equal(k.view(-1, 3, 8)[new_slots], new)
