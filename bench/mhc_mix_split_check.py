"""Whether V4's folded mHC site gives the same bits with its mixes launched apart (`mixes_on`): per
output of `mhc_pre_norm` (post, comb, h), equal or not, the largest |Δ| and the count of elements
that differ, one launch against two, at 3 (padded) and 4 streams in fp32 and bf16.

    PYTHONPATH=. python bench/mhc_mix_split_check.py       # one GPU, seconds

Printed, not written: the twenty-ninth session ran it once on an H100 (bench/README.md).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from any directory
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from dspark.kernels import mhc_norm  # noqa: E402

EPS = dict(rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
CASES = [(3, 3, 1100, torch.float32), (1, 4, 2048, torch.float32), (3, 3, 1100, torch.bfloat16),
         (4, 4, 2048, torch.bfloat16)]  # (N, streams, D, dtype of x)


def main() -> None:
    for n, hc, dim, dtype in CASES:
        g = torch.Generator().manual_seed(n + 11)
        x = torch.randn(n, hc, dim, generator=g).to(dtype).cuda()
        params = [t.cuda() for t in (torch.randn((2 + hc) * hc, hc * dim, generator=g) * 0.05,
                                     torch.randn((2 + hc) * hc, generator=g) * 0.5, torch.rand(3, generator=g) + 0.5)]
        weight = (torch.rand(dim, generator=g) + 0.5).cuda()
        whole = mhc_norm.mhc_pre_norm(x, *params, weight, **EPS, norm_eps=1e-6)
        apart = mhc_norm.mhc_pre_norm(x, *params, weight, **EPS, norm_eps=1e-6, mixes_on=contextlib.nullcontext)
        print(n, hc, dim, dtype, [(name, torch.equal(a, b), (a.double() - b.double()).abs().max().item(),
                                   int(a.ne(b).sum())) for name, a, b in zip(("post", "comb", "h"), whole, apart)])


if __name__ == "__main__":
    main()
