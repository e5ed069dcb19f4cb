import pytest
import torch

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
