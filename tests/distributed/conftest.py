"""Shared by the distributed tests: run a per-rank function in 2 spawned processes, collect results."""

import socket

import pytest
import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def spawn_ranks():
    """`spawn_ranks(fn, out_dir, *args, nprocs=2, weights_only=True)`: runs fn(rank, port, out_dir,
    *args) in `nprocs` processes (a fresh rendezvous port each time) and returns the objects the
    ranks saved as `out_dir/rank{r}.pt`, in rank order."""

    def run(fn, out_dir, *args, nprocs: int = 2, weights_only: bool = True) -> list:
        mp.spawn(fn, args=(_free_port(), str(out_dir), *args), nprocs=nprocs)
        return [torch.load(f"{out_dir}/rank{r}.pt", weights_only=weights_only) for r in range(nprocs)]

    return run
