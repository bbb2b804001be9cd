"""Which compiled Triton variants launches pick: Triton's own specialisation rules, applied to a launch.

Triton compiles a variant per distinct set of constexprs, argument dtypes, int arguments' value class
(equal to 1, divisible by 16, other) and pointers' 16-byte alignment, except for the arguments it is
told not to specialise on. Each new variant is seconds of JIT compile, so the node warms up every one
it can meet (model/warm_up.py) and tests/model/test_kernel_variants.py holds a replay to one per key
layout. `TritonLaunches` records the variant keys of the attention kernel's launches inside a block:

    with TritonLaunches() as launches:
        serve(...)
    launches.variants   # distinct specialisation keys

and `launches_as_one_op(counter)` makes the CPU op-count proxy (model/op_counter.py) count each Triton
launch as the one launch it is on a GPU.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch

from model.attention import triton_attention
from model.op_counter import OpCounter


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


class _LaunchHook:
    """Stands in for a module's Triton kernel while entered (launchers look their kernel up in the module at
    every launch): each launch goes through `on_launch(kernel, args, kwargs, launch)`, which runs `launch()`."""

    def __init__(self, module, attribute: str, on_launch: Callable) -> None:
        self.module, self.attribute, self.on_launch = module, attribute, on_launch

    def __enter__(self) -> _LaunchHook:
        self.kernel = getattr(self.module, self.attribute)
        setattr(self.module, self.attribute, self)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.module, self.attribute, self.kernel)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            return self.on_launch(self.kernel, args, kwargs, lambda: self.kernel[grid](*args, **kwargs))

        return launch


@dataclass
class TritonLaunches:
    """Records the attention kernel's launches while entered. Not reentrant; one thread launches meanwhile."""

    keys: list[tuple] = field(default_factory=list)  # one per launch, in order
    int_arguments: dict[str, set[int]] = field(default_factory=dict)  # the values each int argument took

    @property
    def variants(self) -> set[tuple]:
        return set(self.keys)

    def __enter__(self) -> TritonLaunches:
        self._hook = _LaunchHook(triton_attention, "_hstu_attention_kernel", self._record).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hook.__exit__(*exc)

    def _record(self, kernel, args: tuple, kwargs: dict, launch: Callable):
        self.keys.append(specialisation(kernel, args, kwargs))
        for name, value in zip(kernel.arg_names, args):
            if isinstance(value, int):
                self.int_arguments.setdefault(name, set()).add(value)
        return launch()


@contextmanager
def launches_as_one_op(counter: OpCounter) -> Iterator[None]:
    """Every Triton launch inside (attention and KV append) counts as one op of `counter`, as on a GPU,
    instead of the ops Triton's CPU interpreter dispatches to emulate it."""
    from kvcache import triton_append

    def one_op(kernel, args, kwargs, launch):
        with counter.one_op(f"triton::{kernel.fn.__name__}"):
            return launch()

    with ExitStack() as hooks:
        for module, attribute in ((triton_attention, "_hstu_attention_kernel"), (triton_append, "_append_kernel")):
            if hasattr(module, attribute):
                hooks.enter_context(_LaunchHook(module, attribute, one_op))
        yield
