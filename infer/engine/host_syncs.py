"""Host synchronisations, seen on any device: what would make a CUDA stream wait for the host, or
the host for the stream, detected from the operations themselves so that a CPU run shows them.

On a GPU a device -> host read (`tolist`, `item`, `bool(t)`, `int(t)`, indexing a list with a
tensor), an op whose output shape depends on the data (`nonzero`, boolean-mask indexing,
`masked_select`, `unique`, `repeat_interleave` without `output_size`) or a tensor made from host
data inside a launch (`torch.tensor(...)`, pageable and synchronous) stalls the pipeline, and inside
a CUDA graph capture it raises or records garbage. On CPU none of them costs anything, so nothing
shows them unless they are looked for: `HostSyncs` is a torch function mode plus a dispatch mode that
records each one (kind, operation) and, `strict`, raises `HostSyncError` at the first.

Allowed: the engine's one upload per stage goes through `BatchState.to_device` (pinned memory and a
non_blocking copy on CUDA): host tensors made inside a function of that name are not counted. The
engine's host bookkeeping stays in Python lists (no host tensors), so that every tensor a launch
touches is a device tensor and everything recorded here is a real sync on a GPU.
(tests/test_gpu_discipline.py: capture safety of every captured body, syncs per stage kind.)
"""
from __future__ import annotations

import sys
from collections import Counter

import torch
import torch.nn.attention.flex_attention as fa
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
READS = frozenset({"tolist", "numpy", "cpu"})  # function level (on CPU, tolist dispatches nothing)
HOST_TENSORS = frozenset({"tensor", "as_tensor", "from_numpy"})
TRANSFERS = frozenset({"cuda", "pin_memory"})
UPLOADER = "to_device"  # the engine's one sanctioned host -> device path (BatchState.to_device)
# a Python number from a tensor: _local_scalar_dense with autograd on; under inference mode (where the
# engine runs) item / bool arrive undecomposed
SCALAR_READS = frozenset({_aten._local_scalar_dense.default, _aten.item.default, _aten.is_nonzero.default,
                          _aten.equal.default})
# output shapes read from the data (composite ones, where(cond) and argwhere, arrive undecomposed under
# inference mode)
DYNAMIC = frozenset({_aten.nonzero.default, _aten.nonzero_numpy.default, _aten.where.default,
                     _aten.argwhere.default, _aten.masked_select.default, _aten._unique.default,
                     _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default})
REPEATS = frozenset({_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor})


class HostSyncError(RuntimeError):
    pass


class _Functions(TorchFunctionMode):
    def __init__(self, owner: HostSyncs):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS:
            self.owner.record("read", name)
        elif name in HOST_TENSORS and sys._getframe(1).f_code.co_name != UPLOADER:
            self.owner.record("host_tensor", name)
        elif name in TRANSFERS or (name == "to" and _names_device(args[1:], kwargs)):
            self.owner.record("transfer", name)
        return func(*args, **kwargs)


def _names_device(args, kwargs) -> bool:
    """`t.to(...)` naming a device (a transfer on a GPU) rather than only a dtype."""
    return "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args)


class _Dispatch(TorchDispatchMode):
    # FlexAttention is a higher-order op: it passes through as one fused kernel (compiled on CUDA),
    # its block mask's construction, which is made of ordinary ops, is checked
    supports_higher_order_operators = True

    def __init__(self, owner: HostSyncs):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SCALAR_READS:  # item, bool, int, float, index
            self.owner.record("read", str(func))
        elif func in DYNAMIC:
            self.owner.record("dynamic", str(func))
        elif func in REPEATS and kwargs.get("output_size") is None:
            self.owner.record("dynamic", str(func))
        elif func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
            self.owner.record("dynamic", "boolean-mask indexing")
        return func(*args, **kwargs)


class HostSyncs:
    """`with HostSyncs() as h:` records every host sync in `h.events` [(kind, op)];
    `HostSyncs(strict=True)` raises HostSyncError at the first one (a body a CUDA graph captures)."""

    def __init__(self, strict: bool = False):
        self.strict = strict
        self.events: list[tuple[str, str]] = []
        self._modes = (_Functions(self), _Dispatch(self))

    def record(self, kind: str, op: str) -> None:
        if self.strict:
            raise HostSyncError(f"host sync inside a captured body: {kind} ({op})")
        self.events.append((kind, op))

    @property
    def count(self) -> int:
        return len(self.events)

    def counts(self) -> Counter:
        return Counter(k for k, _ in self.events)

    def __enter__(self) -> HostSyncs:
        # eager FlexAttention wraps its op in torch.compile, which skips frames under a function mode:
        # call the op directly (the same numbers; its debug switch), opaque to the check as a kernel
        self._flex = fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
        fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
        fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = self._flex
