"""Which compiled Triton variants launches pick: Triton's own specialisation rules, applied to a launch.

Triton compiles a variant per distinct set of constexprs, argument dtypes, int arguments' value class
(equal to 1, divisible by 16, other) and pointers' 16-byte alignment, except for the arguments it is
told not to specialise on. Each new variant is seconds of JIT compile, so the node warms up every one
it can meet (model/warm_up.py) and tests/model/test_kernel_variants.py holds a replay to one per key
layout. `TritonLaunches` records the variant keys of the attention kernel's launches inside a block:

    with TritonLaunches() as launches:
        serve(...)
    launches.variants   # distinct specialisation keys
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model.attention import triton_attention


def _no_specialisation(kernel) -> set[str]:
    names = getattr(kernel, "do_not_specialize", None)
    if names is None:  # the interpreter keeps the decorator's arguments
        names = kernel.kwargs.get("do_not_specialize", ())
    return {kernel.arg_names[n] if isinstance(n, int) else n for n in names}


def specialisation(kernel, args: tuple, kwargs: dict) -> tuple:
    """The parts of a launch of `kernel` that pick Triton's compiled variant."""
    free = _no_specialisation(kernel)
    key = []
    for name, value in zip(kernel.arg_names, args):
        if isinstance(value, torch.Tensor):
            key.append((name, value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and name not in free:
            key.append((name, value == 1, value % 16 == 0))
    return (*key, *sorted((k, str(v)) for k, v in kwargs.items()))


@dataclass
class TritonLaunches:
    """Records the attention kernel's launches while entered (it stands in for the module's kernel, which
    triton_hstu_attention looks up at every launch). Not reentrant; one thread launches meanwhile."""

    keys: list[tuple] = field(default_factory=list)  # one per launch, in order
    int_arguments: dict[str, set[int]] = field(default_factory=dict)  # the values each int argument took

    @property
    def variants(self) -> set[tuple]:
        return set(self.keys)

    def __enter__(self) -> TritonLaunches:
        self._kernel = triton_attention._hstu_attention_kernel
        triton_attention._hstu_attention_kernel = self
        return self

    def __exit__(self, *exc) -> None:
        triton_attention._hstu_attention_kernel = self._kernel

    def __getitem__(self, grid):
        kernel = self._kernel

        def launch(*args, **kwargs):
            self.keys.append(specialisation(kernel, args, kwargs))
            for name, value in zip(kernel.arg_names, args):
                if isinstance(value, int):
                    self.int_arguments.setdefault(name, set()).add(value)
            return kernel[grid](*args, **kwargs)

        return launch
