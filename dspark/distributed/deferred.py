"""Build a model without allocating its weights, so that a rank only ever allocates what it keeps.

    with deferred_weights(device):
        model = build_model(config, device, dtype)     # weights on the meta device
    parallelize(model, parallel, comm)                 # other ranks' experts dropped, still meta
    materialize(model, device)                         # this rank's weights allocated, uninitialised

`deferred_weights` redirects every `torch.empty` asking for `device` to the meta device while the
model is built. That is how `nn.Linear`, `nn.Embedding` and the models' own weight tensors (the
stacked routed experts of `deepseek_v4.moe.MoE` first of all) are created, while the values the
constructors compute (RoPE frequencies, Engram hashing constants: non-persistent buffers made by
`arange`, `tensor`, ...) and the small `zeros`/`ones`-initialised parameters (norms, sinks, mHC)
are made for real, so the model files need no meta-device support. A `torch.empty` for another
device (the host-memory Engram tables of a GPU model) is left alone, unless `host=True` defers the
host's too: for sharded Engram tables (`engram_shard`), which `parallelize` re-creates at this
rank's share, in host memory, so the whole tables are never allocated.

`materialize` then gives every remaining meta parameter or persistent buffer fresh, uninitialised
storage on `device` (a loader must fill every one of them), and raises if a tensor the loader
cannot fill (a non-persistent buffer) stayed on meta.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_META = torch.device("meta")


class _DeferEmpty(TorchFunctionMode):
    """`torch.empty(..., device=d)` with d == `device` (or no device, on a CPU build) -> meta."""

    def __init__(self, device: torch.device, host: bool):
        super().__init__()
        self.device = device
        self.host = host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.empty and self._ours(kwargs.get("device")):
            kwargs["device"] = _META
            kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)

    def _ours(self, device) -> bool:
        requested = torch.device("cpu") if device is None else torch.device(device)
        if requested.type == "cuda" and requested.index is None:
            requested = torch.device("cuda", torch.cuda.current_device())
        return requested == self.device or (self.host and requested.type == "cpu")


@contextlib.contextmanager
def deferred_weights(device: str | torch.device, host: bool = False):
    """Inside, `torch.empty` calls for `device` (and for the host with `host=True`) make meta
    tensors (see the module docstring)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _DeferEmpty(device, host):
        yield


def materialize(model: nn.Module, device: str | torch.device) -> nn.Module:
    """Give every meta parameter and persistent buffer of `model` uninitialised storage on
    `device` (tied tensors stay tied); returns `model`. Raises ValueError naming any
    non-persistent buffer left on the meta device (no loader would fill it)."""
    device = torch.device(device)
    fresh: dict[int, torch.Tensor] = {}  # id of a meta tensor -> its replacement (keeps ties)

    def replace(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in fresh:
            new = torch.empty_like(tensor, device=device)
            fresh[id(tensor)] = nn.Parameter(new, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else new
        return fresh[id(tensor)]

    for prefix, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                module._parameters[name] = replace(param)
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                if name in module._non_persistent_buffers_set:
                    raise ValueError(f"non-persistent buffer {prefix}.{name} was computed from a deferred "
                                     "weight: no loader can fill it; build this model without deferred_weights")
                module._buffers[name] = replace(buffer)
    return model
