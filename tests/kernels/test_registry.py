"""Kernel registry (dspark/kernels/registry.py): config-driven op selection, optional Triton."""

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dspark.kernels import OPS, KernelConfig, get_op, triton_available
from dspark.kernels import mhc, moe, registry


def test_default_config_is_reference_everywhere():
    config = KernelConfig()
    assert all(getattr(config, op) == "ref" for op in OPS)
    assert get_op(config, "mhc_pre") is mhc.mhc_pre_ref
    assert get_op(config, "fused_moe") is moe.fused_moe_ref


def test_for_device_picks_reference_on_cpu():
    assert KernelConfig.for_device("cpu") == KernelConfig.uniform("ref")


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_for_device_picks_triton_on_cuda():
    picked = KernelConfig.for_device(torch.device("cuda", 0))
    assert {op: getattr(picked, op) for op in OPS} == {op: "ref" if op in registry.NOT_YET_ON_GPU else "triton" for op in OPS}


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_every_op_has_both_implementations():
    ref, fused = KernelConfig.uniform("ref"), KernelConfig.uniform("triton")
    for op in OPS:
        module = importlib.import_module(f"dspark.kernels.{registry._OP_MODULES[op]}")
        assert get_op(ref, op) is getattr(module, f"{op}_ref")
        assert get_op(fused, op) is getattr(module, op)


def test_config_is_frozen_and_validated():
    config = KernelConfig(fused_moe="triton")
    with pytest.raises(AttributeError):
        config.fused_moe = "ref"
    with pytest.raises(ValueError, match="mhc_pre='cuda'"):
        KernelConfig(mhc_pre="cuda")
    with pytest.raises(ValueError, match="unknown kernel op"):
        get_op(config, "attention")


def test_import_and_reference_without_triton(tmp_path):
    """With triton made unimportable: the package and the references work, 'triton' says why not."""
    script = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch
        from dspark.kernels import KernelConfig, get_op, triton_available
        assert not triton_available()
        assert KernelConfig.for_device("cuda") == KernelConfig.uniform("ref")
        x = torch.randn(2, 4, 8)
        post, comb, u = get_op(KernelConfig(), "mhc_pre")(
            x, torch.randn(24, 32), torch.zeros(24), torch.ones(3), rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
        assert u.shape == (2, 8)
        try:
            get_op(KernelConfig(mhc_pre="triton"), "mhc_pre")
        except ImportError as e:
            assert "pip install" in str(e)
        else:
            raise AssertionError("no ImportError")
        from dspark.kernels import moe
        try:
            moe.fused_moe(*[None] * 11, top_k=1, routed_scaling_factor=1.0, swiglu_limit=0.0, hash_routing=False)
        except ImportError:
            pass
        else:
            raise AssertionError("no ImportError")
        print("ok")
    """)
    # The child resolves imports exactly as this process does (same path order, neutral cwd).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
