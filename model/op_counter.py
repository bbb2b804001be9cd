"""Count the aten ops a piece of code dispatches: the CPU proxy for GPU launches and host syncs.

    with OpCounter() as ops:
        session.serve(batch)
    ops.total, ops.syncs            # every aten op; those that force a device-to-host sync

On a GPU every aten op on a device tensor is at least one kernel launch, and the ops in
`SYNC_OPS` make the host wait for the device (they need a value or a size from it). Counting
them on CPU tells whether serving is batch-shaped: a per-user Python loop shows up as an op
count that grows with the batch size, and a `.item()` or a boolean mask as a sync op.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose result size or value needs the device's data on the host.
SYNC_OPS = frozenset({
    "aten::_local_scalar_dense",  # .item(), int(t), float(t), bool(t)
    "aten::is_nonzero",  # if tensor:
    "aten::nonzero",
    "aten::nonzero_static",
    "aten::masked_select",
    "aten::unique",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::unique_dim",
    "aten::equal",
    "aten::allclose",
})
# Ops that only reinterpret a tensor (no kernel runs on any device).
VIEW_OPS = frozenset({
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::alias", "aten::as_strided", "aten::t",
    "aten::transpose", "aten::permute", "aten::expand", "aten::slice", "aten::select", "aten::squeeze",
    "aten::unsqueeze", "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::unbind", "aten::detach",
    "aten::lift_fresh", "aten::view_as_real", "aten::view_as_complex",
})


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._inside_one_op = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside_one_op:
            self.counts[func._schema.name] += 1
        return func(*args, **(kwargs or {}))

    @contextmanager
    def one_op(self, name: str) -> Iterator[None]:
        """Count what runs inside as the one op `name`: a kernel launcher is one launch on a GPU, whatever
        its CPU emulation (Triton's interpreter) dispatches meanwhile."""
        self.counts[name] += 1
        self._inside_one_op += 1
        try:
            yield
        finally:
            self._inside_one_op -= 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def kernels(self) -> int:
        """Ops that run a kernel (views excluded): an estimate of device launches."""
        return sum(n for name, n in self.counts.items() if name not in VIEW_OPS)

    @property
    def syncs(self) -> Counter[str]:
        return Counter({name: n for name, n in self.counts.items() if name in SYNC_OPS})
