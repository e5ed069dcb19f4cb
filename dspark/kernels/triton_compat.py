"""Triton when it is installed, else stand-ins, so that every kernel module imports (and its torch
reference runs) on machines without the optional `gpu` extra; `require_triton` guards the calls.

Programmatic dependent launch (PDL, Hopper and later): a kernel launched with `launch_pdl=True` may
be scheduled while its predecessor in the stream still runs, once every program of the predecessor
has signalled `gdc_launch_dependents` (or exited). Each kernel therefore starts with `pdl_prologue`:
it first waits (`gdc_wait`: the predecessor has finished and its writes are visible), then lets its
own successor be scheduled. A batch-1 decode step replays ~500 such small dependent launches from
one CUDA graph; on one H200 (bench/pdl_chain.py) this cut a tiny kernel's step from 0.93 to 0.68 µs.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import cuda as _cuda

    jit = triton.jit
except ImportError:
    triton = tl = _cuda = None

    def jit(fn):
        return fn


PDL = True  # the one place that turns programmatic dependent launch off for every kernel
_WAVES = 4  # grids of at most this many programs per SM launch with PDL (decode-sized)


@jit
def pdl_prologue(PDL: tl.constexpr):
    """The first statement of every kernel: with PDL, wait for the predecessor grid (nothing of the
    kernel may read its output before), then release the successor so that it is scheduled early
    and parks in its own wait while this grid runs."""
    if PDL:
        _cuda.gdc_wait()
        _cuda.gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _pdl_device(index: int) -> tuple[bool, int]:
    """(PDL supported: compute capability >= 9, SM count) of CUDA device `index`."""
    props = torch.cuda.get_device_properties(index)
    return props.major >= 9, props.multi_processor_count


def pdl_launch(device: torch.device, programs: int) -> bool:
    """Whether a launch of `programs` programs on `device` uses PDL: only on CUDA devices of compute
    capability >= 9 and for decode-sized grids (<= 4 programs per SM). A large prefill grid keeps
    the plain launch: its early-scheduled successor would hold SM slots while it still has waves to
    run. Never on CPU, where the Triton interpreter has no `gdc_*`."""
    if not PDL or device.type != "cuda":
        return False
    capable, sms = _pdl_device(torch.cuda.current_device() if device.index is None else device.index)
    return capable and programs <= _WAVES * sms
