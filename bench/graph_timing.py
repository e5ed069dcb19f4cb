"""Median seconds of one CUDA-graph replay, timed with CUDA events (shared by the bench scripts)."""

from __future__ import annotations

import statistics

import torch


def replay_seconds(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median over `reps` replays of `graph`, each between two recorded events (one warm replay first)."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)
