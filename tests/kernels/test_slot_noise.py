"""`slot_noise` (dspark/kernels/slot_noise.py), the static drafters' counter-based Exp(1) noise: the
Triton kernel against its torch reference (the same 32-bit hash; −log to the last ulp) on random keys
and positions over vocabularies off the 1024-wide chunks, argument errors, the registry's default.
On CPU the kernel runs under the Triton interpreter (conftest.py)."""

import pytest
import torch

from dspark.kernels import KernelConfig, get_op, triton_available
from dspark.kernels import slot_noise as sn
from dspark.kernels.registry import NOT_YET_ON_GPU

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 1000), (5, 2049), (2, 258)])
def test_kernel_matches_reference(rows, vocab, poisoned):
    g = torch.Generator().manual_seed(rows * vocab)
    keys = torch.randint(0, 2**32, (rows,), generator=g, dtype=torch.long).to(DEVICE)
    positions = torch.randint(0, 2**31, (rows,), generator=g, dtype=torch.long).to(DEVICE)
    with poisoned():
        out = sn.slot_noise(keys, positions, vocab)
    ref = sn.slot_noise_ref(keys, positions, vocab)
    assert out.shape == (rows, vocab) and out.dtype == torch.float32 and bool((out > 0).all())
    torch.testing.assert_close(out, ref, rtol=4e-7, atol=0)  # −log: 1 ulp apart at most
    assert torch.equal(sn.slot_noise(keys[-1:], positions[-1:], vocab), out[-1:])  # a row is its own


def test_reference_rejects_bad_arguments():
    keys = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="keys and positions must be LongTensors"):
        sn.slot_noise_ref(keys, torch.zeros(3, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="keys and positions must be LongTensors"):
        sn.slot_noise_ref(keys.int(), keys, 8)
    with pytest.raises(ValueError, match="vocab must be an int >= 1, got 0"):
        sn.slot_noise_ref(keys, keys, 0)


def test_registry_picks_the_kernel_on_cuda_since_its_gpu_run():
    """The kernel passed its GPU tests in the fifteenth session's run: CUDA's default, the reference elsewhere."""
    assert "slot_noise" not in NOT_YET_ON_GPU
    assert KernelConfig.for_device("cuda").slot_noise == ("triton" if triton_available() else "ref")
    assert get_op(KernelConfig(), "slot_noise") is sn.slot_noise_ref
