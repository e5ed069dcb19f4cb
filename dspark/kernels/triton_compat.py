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
PREFETCH = True  # the one place that turns the weight prefetch before the PDL wait off (`pdl_prefetch`)
_WAVES = 4  # grids of at most this many programs per SM launch with PDL (decode-sized)


@jit
def pdl_prologue(PDL: tl.constexpr):
    """The first statement of every kernel: with PDL, wait for the predecessor grid (nothing of the
    kernel may read its output before), then release the successor so that it is scheduled early
    and parks in its own wait while this grid runs."""
    if PDL:
        _cuda.gdc_wait()
        _cuda.gdc_launch_dependents()


@jit
def pdl_prologue_unless(early, PDL: tl.constexpr):
    """`pdl_prologue` for a kernel whose programs with `early` true load nothing its predecessor grid
    writes (the launcher guarantees it, and launches with `pdl_launch(..., early=True)`): those start
    their loads at once, while the predecessor still runs, and call `pdl_wait_if(early, PDL)` before
    their first store (the predecessor may still read memory this grid's outputs reuse); the others
    wait here. Every program then releases the successor, as in `pdl_prologue`."""
    if PDL:
        if not early:
            _cuda.gdc_wait()
        _cuda.gdc_launch_dependents()


@jit
def pdl_prologue_release(RELEASE_FIRST: tl.constexpr, PDL: tl.constexpr):
    """`pdl_prologue`, or with RELEASE_FIRST the other way round: release the successor, then wait. For a
    one-wave kernel whose successor has early programs (`pdl_prologue_unless`), which then start while this
    kernel still waits for its own predecessor. Safe for any successor: one that waits waits for this grid's
    end, which comes after this grid's wait; early programs load only data written before this grid's
    predecessor passed its own wait (the decode router: x, read by the logits kernel before this one)."""
    if PDL:
        if RELEASE_FIRST:
            _cuda.gdc_launch_dependents()
            _cuda.gdc_wait()
        else:
            _cuda.gdc_wait()
            _cuda.gdc_launch_dependents()


@jit
def pdl_wait_if(early, PDL: tl.constexpr):
    """The wait that `pdl_prologue_unless` skipped, for the early programs, before they store."""
    if PDL:
        if early:
            _cuda.gdc_wait()


@jit
def pdl_prefetch(ptr, nbytes, PDL: tl.constexpr):
    """Before `pdl_prologue`: ask L2 for the `nbytes` bytes at `ptr` (a scalar pointer; 16-byte aligned,
    nbytes a multiple of 16: the launcher checks), for operands no predecessor writes (weights). While
    this grid then waits in `gdc_wait` for its predecessor, its weights already stream from HBM into
    L2: a one-row decode kernel is otherwise a launch, a wait, then a full HBM round trip for data
    known before the step began. Thread t issues one bulk prefetch of the t-th 4 KB chunk (so the
    range should be at most 4 KB × threads; the rest is not requested, it is only a hint). Without PDL
    the kernel starts after its predecessor anyway: nothing to overlap, nothing issued."""
    if PDL:
        base = ptr + tl.zeros((1,), dtype=tl.int32)  # one element, held by every thread
        size = tl.zeros((1,), dtype=tl.int32) + nbytes
        tl.inline_asm_elementwise(
            """{
            .reg .u32 t, n;
            .reg .u64 a;
            .reg .pred p;
            mov.u32 t, %tid.x;
            mul.lo.u32 t, t, 4096;
            setp.lt.u32 p, t, $2;
            sub.u32 n, $2, t;
            min.u32 n, n, 4096;
            cvt.u64.u32 a, t;
            add.u64 a, a, $1;
            @p cp.async.bulk.prefetch.L2.global [a], n;
            mov.u32 $0, 0;
            }""", "=r,l,r", [base, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_launch(pdl: bool, *weights: torch.Tensor) -> bool:
    """Whether a launch with PDL `pdl` prefetches `weights` (each [rows, ...] with contiguous rows) with
    `pdl_prefetch`: only under PDL, and where every base address and row is 16-byte aligned."""
    return PREFETCH and pdl and all(w.data_ptr() % 16 == 0 and (w.stride(0) * w.element_size()) % 16 == 0
                                    for w in weights)


@functools.lru_cache(maxsize=None)
def _pdl_device(index: int) -> tuple[bool, int]:
    """(PDL supported: compute capability >= 9, SM count) of CUDA device `index`."""
    props = torch.cuda.get_device_properties(index)
    return props.major >= 9, props.multi_processor_count


def sm90(device: torch.device) -> bool:
    """Whether CUDA `device` has compute capability >= 9 (Hopper: PDL, TMA); read once per device."""
    return _pdl_device(torch.cuda.current_device() if device.index is None else device.index)[0]


def pdl_launch(device: torch.device, programs: int, early: bool = False) -> bool:
    """Whether a launch of `programs` programs on `device` uses PDL: only on CUDA devices of compute
    capability >= 9 and for decode-sized grids (<= 4 programs per SM). A large prefill grid keeps
    the plain launch: its early-scheduled successor would hold SM slots while it still has waves to
    run. `early`: a kernel with `pdl_prologue_unless` whose predecessor is one short wave (the decode
    router's last launch) takes PDL at any size, since its early programs are the point. Never on
    CPU, where the Triton interpreter has no `gdc_*`."""
    if not PDL or device.type != "cuda":
        return False
    capable, sms = _pdl_device(torch.cuda.current_device() if device.index is None else device.index)
    return capable and (early or programs <= _WAVES * sms)
