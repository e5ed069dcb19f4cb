"""Triton when it is installed, else stand-ins, so that every kernel module imports (and its torch
reference runs) on machines without the optional `gpu` extra; `require_triton` guards the calls."""

try:
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:
    triton = tl = None

    def jit(fn):
        return fn
