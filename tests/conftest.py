import importlib.util

import pytest
import torch

import dspark

# tests/server needs the installed server (`dspark_server`) and its packages (the `serve` / `dev`
# extras); where they are missing (the GPU machine's Python, a checkout on PYTHONPATH) the directory
# is left out instead of failing the whole collection. CI installs them, so there it always runs.
_SERVER = ("dspark_server", "fastapi", "uvicorn", "httpx")
collect_ignore = [] if all(importlib.util.find_spec(m) for m in _SERVER) else ["server"]

# The tiny test models are far too small for intra-op threads to pay off; one thread is faster and
# keeps runs comparable when several test processes share the machine.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def exact_pair_distribution():
    """f(model, prompt, vocab, params) -> float64 [vocab, vocab]: the exact joint law of generated
    tokens 2 and 3 (1-based) under the target, by enumeration; the reference of the χ² tests."""

    def joint_law(model, prompt, vocab, params):
        def probs_after(seq):
            logits = model(torch.tensor(seq), [model.new_state()], [len(seq)]).logits[-1]
            return dspark.sampling.probs_from_logits(logits, params).double()

        joint = torch.zeros(vocab, vocab, dtype=torch.float64)
        p1 = probs_after(prompt)
        for t1 in range(vocab):
            p2 = probs_after(prompt + [t1])
            for t2 in range(vocab):
                joint[t2] += p1[t1] * p2[t2] * probs_after(prompt + [t1, t2])
        return joint

    return joint_law
