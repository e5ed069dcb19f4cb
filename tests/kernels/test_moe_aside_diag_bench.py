"""`bench/moe_aside_diag.py`'s variants compute the op they time: every one equals the in-line op bit for bit
(the same tiles; `aside_light` differs only in its side kernels' step, which the shared sum does not see at
these widths), so the GPU call that times them measures one result computed several ways."""

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[2] / "bench")]

from bench import moe_aside_diag as diag  # noqa: E402
from bench.kernels import LayerShape, build_layer  # noqa: E402
from dspark.kernels import moe_decode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_every_variant_is_the_in_line_op(kind="fp8_128"):
    shape = LayerShape("tiny", dim=128, n_hc=4, n_experts=4, top_k=2, inter=64)
    layer = build_layer(shape, DEVICE)
    x = torch.randn(2, shape.dim, generator=torch.Generator().manual_seed(1)).bfloat16().to(DEVICE)
    inline = diag.thunk("inline", shape, layer, layer[kind], x)()
    for variant in diag.VARIANTS:
        out = diag.thunk(variant, shape, layer, layer[kind], x)()
        if variant == "shared_alone":
            tiles = moe_decode._default_tiles(x, layer[kind][0], shape.top_k)
            assert torch.equal(out, moe_decode.decode_shared(x, *layer[kind][3:], 10.0, tiles)), variant
        else:
            assert torch.equal(out, inline), variant
    assert set(diag.VARIANTS) >= {"inline", "aside", "routed_alone", "shared_alone"}
