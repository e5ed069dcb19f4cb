"""CUDA-graph capture and the median seconds of one replay, timed with CUDA events (shared by the
bench scripts)."""

from __future__ import annotations

import statistics

import torch


def capture(body) -> torch.cuda.CUDAGraph:
    """body() once on a side stream (compiles and allocates outside the capture), then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


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
