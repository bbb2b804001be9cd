"""Int8 K/V with a scale and minimum per token, layer, K-or-V and head: one row of head_dim values.

Each row is stored as fbgemm's fused 8-bit rowwise format, `[head_dim uint8 codes][float32 scale]
[float32 minimum]`, decoded `q * scale + minimum` (a fused multiply-add). Against `int8`'s
per-page groups it spends 8 bytes more per row (3.76x fewer bytes than fp32 at head_dim 128,
against 3.98x), and buys two things:

* a smaller error: a row's range, not a page-head's, sets the step (|error| <= step / 2), 3-10x
  less logit error on trained K/V (docs/kvcache.md, "int8 with a scale per token");
* a decode that writes each value once: fbgemm's CPU kernel reads the codes and writes the float32
  values in one vectorised pass, where the per-page groups take a cast then a scale. (Onload from
  the memory tier is still no faster than `int8`'s on CPU: the gather below costs what it saves.)

The fast path decodes straight into the device pool's pages on the host: every (layer, K/V)
block of a run of pool pages is contiguous there. The codes are first gathered block by block
into a reused staging buffer, in one copy (a quarter of the decoded bytes: in the encoded rows a
page's codes are not next to the next page's), then each block is decoded by the kernel, the
blocks spread over torch's intra-op threads (the kernel is single-threaded and releases the GIL).
Host pages of other strides (a tier's fresh page-major pages) are decoded block-major into a
reused buffer, then copied.
On CUDA the pool's onload decodes straight into its pages with the Triton kernel of
`triton_int8.py`, which also rounds `q * scale + minimum` once. Anywhere else (another dtype, a
decode into fresh memory) it is torch's `addcmul` in float32, which rounds once as well, and equals
fbgemm's kernel (`tests/kvcache/codecs/test_int8_rows.py`).
"""
from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch
from torch import Tensor

from ..page_layout import PageLayout
from .int8 import quantisation_error_bound, quantisation_step
from .values import ValueCodec, aligned

_SCALE_BIAS_NBYTES = 8  # float32 scale, float32 minimum, after each row's codes


def _rows_shape(layout: PageLayout, k: int, num_layers: int) -> tuple[int, ...]:
    return (k, num_layers, 2, layout.page_size, layout.num_heads, layout.head_dim + _SCALE_BIAS_NBYTES)


class _Buffers(threading.local):
    """Growing buffers per thread and dtype, reused across decodes (no allocation, no first touch), kept
    up to `KEEP_NBYTES` each: a longer user's decode gets a buffer of its own, freed after it."""

    KEEP_NBYTES = 64 << 20

    def __init__(self) -> None:
        self.by_dtype: dict[torch.dtype, Tensor] = {}

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        buffer = self.by_dtype.get(dtype)
        if buffer is None or buffer.numel() < numel:
            with torch.inference_mode(False):
                buffer = torch.empty(numel, dtype=dtype)
            if numel * dtype.itemsize <= self.KEEP_NBYTES:
                self.by_dtype[dtype] = buffer
        return buffer[:numel]


_BUFFERS = _Buffers()
_WORKERS: ThreadPoolExecutor | None = None
_WORKERS_LOCK = threading.Lock()


def _workers() -> ThreadPoolExecutor:
    """The decode threads of this process, started on first use."""
    global _WORKERS
    with _WORKERS_LOCK:
        if _WORKERS is None:
            _WORKERS = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="kv-int8-decode")
        return _WORKERS


def _forget_workers() -> None:
    """In a forked child: the parent's executor has no threads behind it here, and its lock may have
    been copied held (by a parent thread that was starting the executor)."""
    global _WORKERS, _WORKERS_LOCK
    _WORKERS, _WORKERS_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_workers)


def _decode_blocks(blocks: list[tuple[Tensor, Tensor]]) -> None:
    """Each (out [n, D] float32, codes [n, D + 8] uint8, both contiguous): out <- decoded codes."""
    for out, codes in blocks:
        torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloatOut(out, codes)


def _blocks_contiguous(out: Tensor) -> bool:
    """Whether every (layer, K/V) block of out [k, l, 2, S, H, D] is contiguous, as in the pool's pages."""
    return all(out[:, layer, part].is_contiguous() for layer in range(out.shape[1]) for part in range(2))


class Int8RowValues(ValueCodec):
    name = "int8token"

    def width(self, layout: PageLayout, num_layers: int) -> int:
        return aligned(num_layers * 2 * layout.page_size * layout.num_heads * (layout.head_dim + _SCALE_BIAS_NBYTES))

    def _fields(self, layout: PageLayout, rows: Tensor, num_layers: int) -> tuple[Tensor, Tensor, Tensor]:
        """Views of rows [k, width]: all [k, l, 2, S, H, D + 8]; codes [.., D] uint8, scale and minimum [.., 1] float32."""
        shape = _rows_shape(layout, rows.shape[0], num_layers)
        fused = rows[:, : math.prod(shape[1:])].view(shape)
        scale_min = fused[..., layout.head_dim :].view(torch.float32)
        return fused, scale_min[..., :1], scale_min[..., 1:]

    def _scale_and_low(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Per row [.., 1]: the step and the minimum."""
        return quantisation_step(x, (-1,), affine=True, codec=self.name, keepdim=True)  # type: ignore[return-value]

    def encode_into(self, layout: PageLayout, kv: Tensor, out: Tensor) -> None:
        x = kv.float()
        scale, lo = self._scale_and_low(x)
        fused, scales, lows = self._fields(layout, out, kv.shape[1])
        scales.copy_(scale)
        lows.copy_(lo)
        fused[..., : layout.head_dim].copy_(torch.round((x - lo) / scale).clamp_(0, 255))

    def decode(self, layout: PageLayout, rows: Tensor, num_layers: int) -> Tensor:
        fused, scales, lows = self._fields(layout, rows, num_layers)
        return torch.addcmul(lows, fused[..., : layout.head_dim].float(), scales).to(layout.dtype)

    def decode_into(self, layout: PageLayout, rows: Tensor, out: Tensor) -> None:
        if out.shape[0] == 0:
            return
        if not self._kernel_can_write(rows, out):
            out.copy_(self.decode(layout, rows, out.shape[1]))
            return
        if not _blocks_contiguous(out):  # e.g. fresh page-major pages: decode block-major, then one copy
            block_major = _BUFFERS.take(out.numel(), torch.float32).view(out.shape[1], 2, out.shape[0], *out.shape[3:])
            self.decode_into(layout, rows, block_major.permute(2, 0, 1, 3, 4, 5))
            out.copy_(block_major.permute(2, 0, 1, 3, 4, 5))
            return
        blocks = self._staged_blocks(layout, rows, out)
        threads = min(torch.get_num_threads(), len(blocks))
        shares = [blocks[i::threads] for i in range(threads)]
        futures = [_workers().submit(_decode_blocks, share) for share in shares[1:]]
        _decode_blocks(shares[0])
        for future in futures:
            future.result()

    def affine_views(self, layout: PageLayout, rows: Tensor, num_layers: int) -> tuple[Tensor, Tensor, Tensor]:
        fused, scales, lows = self._fields(layout, rows, num_layers)
        return fused[..., : layout.head_dim], scales[..., 0], lows[..., 0]

    @staticmethod
    def _kernel_can_write(rows: Tensor, out: Tensor) -> bool:
        return out.device.type == "cpu" and rows.device.type == "cpu" and out.dtype == torch.float32

    def _staged_blocks(self, layout: PageLayout, rows: Tensor, out: Tensor) -> list[tuple[Tensor, Tensor]]:
        """(out block [k*S*H, D], its codes [k*S*H, D + 8]) per layer and K/V of `out` (float32 on the host,
        each block contiguous), the codes gathered into this thread's staging buffer in one copy."""
        k, num_layers = out.shape[0], out.shape[1]
        rows_per_block = k * layout.page_size * layout.num_heads
        fused = self._fields(layout, rows, num_layers)[0]
        by_block = fused.view(k, num_layers, 2, rows_per_block // k, fused.shape[-1]).permute(1, 2, 0, 3, 4)
        staging = _BUFFERS.take(fused[0].numel() * k, torch.uint8).view(by_block.shape)
        staging.copy_(by_block)
        return [(out[:, layer, part].view(rows_per_block, layout.head_dim), staging[layer, part].view(rows_per_block, -1))
                for layer in range(num_layers) for part in range(2)]

    def max_abs_error(self, layout: PageLayout, kv: Tensor) -> Tensor:
        x = kv.float()
        return quantisation_error_bound(x, *self._scale_and_low(x), layout.dtype)
