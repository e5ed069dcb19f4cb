"""Kernel tests: on a machine without CUDA the Triton kernels run on CPU through Triton's interpreter.

TRITON_INTERPRET is read when a kernel is *decorated* (at import of dspark.kernels.mhc/moe), so it is
set here, before the test modules import them; a kernel module that another test package imported
earlier is reloaded so that its kernels are rebuilt as interpreted functions.

Two gaps of the Triton 3.6 interpreter are closed here (test-only; the library keeps the code that is
right for the GPU):

* a scalar used as a loop bound is converted with int(ndarray of shape [1]), which NumPy >= 2.4
  rejects, so every `for k in range(0, runtime_value, BLOCK)` fails;
* `tl.dot` on bf16 operands multiplies their raw uint16 storage. The patch widens bf16 to fp32 first,
  which is what the tensor cores compute (exact bf16 products, fp32 accumulation).
* fp32 -> e4m3 casts round by adding the first cut-off bit to the mantissa without carrying into the
  exponent (125.96 becomes 64, not 128). The patch converts with torch, round to nearest even, as the
  GPU's cvt.rn does for the in-range values the kernels cast.

Known, not patched: the interpreter rounds fp32 -> bf16 casts toward zero (the GPU rounds to nearest
even), so bf16 outputs differ from the reference by up to 1 ulp; bf16 tolerances allow for it.
"""

import contextlib
import importlib
import os
import sys

import numpy as np
import pytest
import torch

INTERPRET = not torch.cuda.is_available()
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton.language as tl  # after TRITON_INTERPRET is set

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False


def _patch_scalar_index(interpreter) -> None:
    try:
        int(np.ones(1))
        return  # this NumPy still converts size-1 arrays
    except TypeError:
        pass
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _patch_bf16_dot(interpreter) -> None:
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot


def _patch_fp8_cast(interpreter) -> None:
    builder = interpreter.InterpreterBuilder
    original = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.float8e4nv:
            return original(self, src, dst_type, rounding_mode)
        wide = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
        return interpreter.TensorHandle(wide.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), dst_type.scalar)

    builder.create_fp_to_fp = create_fp_to_fp


if HAVE_TRITON and INTERPRET:
    from triton.runtime import interpreter as _interpreter

    if not getattr(_interpreter, "_dspark_patched", False):
        _patch_scalar_index(_interpreter)
        _patch_bf16_dot(_interpreter)
        _patch_fp8_cast(_interpreter)
        _interpreter._dspark_patched = True
    for _name in ("dspark.kernels.mhc", "dspark.kernels.mhc_norm", "dspark.kernels.hc_head_norm", "dspark.kernels.mhc_v41", "dspark.kernels.moe", "dspark.kernels.moe_decode", "dspark.kernels.moe_w8a8",
                  "dspark.kernels.moe_route_decode",
                  "dspark.kernels.attention_wide", "dspark.kernels.attention", "dspark.kernels.indexer", "dspark.kernels.indexer_pool",
                  "dspark.kernels.compressor", "dspark.kernels.grouped_wo_a", "dspark.kernels.linear", "dspark.kernels.cache_round",
                  "dspark.kernels.rms_norm", "dspark.kernels.rope", "dspark.kernels.norm_rope", "dspark.kernels.attention_flashinfer",
                  "dspark.kernels.step_index", "dspark.kernels.markov_greedy", "dspark.kernels.slot_noise"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])


@pytest.fixture
def counted_lane():
    """A stand-in for a side stream's fork as the site ops take it (`mixes_on`): its block runs
    inline, and `counted_lane.entered` counts the launches made under it."""

    def mixes_on():
        mixes_on.entered += 1
        return contextlib.nullcontext()

    mixes_on.entered = 0
    return mixes_on


@pytest.fixture
def poisoned():
    """Context manager factory: inside it, torch.empty/empty_like return NaN-filled float tensors
    (integer ones: -1), so any output or intermediate element a kernel forgets to write shows up."""

    def fill(t):
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    @contextlib.contextmanager
    def scope():
        empty, empty_like = torch.empty, torch.empty_like
        torch.empty = lambda *a, **k: fill(empty(*a, **k))
        torch.empty_like = lambda *a, **k: fill(empty_like(*a, **k))
        try:
            yield
        finally:
            torch.empty, torch.empty_like = empty, empty_like

    return scope
