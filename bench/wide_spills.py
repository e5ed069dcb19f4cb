"""`attention_wide._wide_kernel` on the GPU: registers and spills of what the JIT compiled, next to the
ahead-of-time compile of the same launch by tests/kernels/test_compile_sm90.py (its recorder and compiler).

    PYTHONPATH=. python bench/wide_spills.py --out $OUT/wide-spills-h200.json   # one H200, < 2 min

For 64 and 32 heads at head_dim 512 (bf16, `attention.wide_tiles`), the op runs at 64 query rows of 64
keys (one key chunk: the kernel writes `out`), 64 rows of 640 keys (key chunks, partials) and 256 rows
of 640 keys (one chunk). Each row of the JSON: the launch's constexprs and hints, `jit` (registers and
local memory bytes per thread of the kernel the JIT built for that launch: the driver's count, which
Triton keeps in 4-byte words as `n_spills`) and `aot`
(registers and stack bytes of the sm_90 cubin the compile test builds for the recorded launch). Equal
numbers mean the test compiles what the GPU runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "tests" / "kernels"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import test_compile_sm90 as aot  # noqa: E402
from dspark.kernels import attention, attention_wide  # noqa: E402

SHAPES = [(heads, rows, keys) for heads in (64, 32) for rows, keys in ((64, 64), (64, 640), (256, 640))]


class Keep(aot.Recorder):
    """The compile test's recorder that also keeps the kernel the JIT compiled for each launch."""

    def __init__(self, kernel, log: list, compiled: list):
        super().__init__(kernel, attention_wide.__name__, "_wide_kernel", log)
        self.compiled = compiled

    def __getitem__(self, grid):
        record = super().__getitem__(grid)

        def launch(*args, **kwargs):
            record(*args, **kwargs)  # the recorder only logs the launch (it no longer runs it)
            kernel = self.kernel[grid](*args, **kwargs)  # JITFunction.run returns the compiled kernel
            self.compiled.append(kernel)
            return kernel

        return launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    log, compiled = [], []
    attention_wide._wide_kernel = Keep(attention_wide._wide_kernel, log, compiled)
    g = torch.Generator().manual_seed(0)
    for heads, rows, keys in SHAPES:
        q = torch.randn(rows, heads, 512, generator=g).bfloat16().cuda()
        pool = torch.randn(4096, 512, generator=g).bfloat16().cuda()
        index = torch.randint(-1, 4096, (rows, keys), generator=g).cuda()
        attention.sparse_attention(q, pool, index, torch.zeros(heads, device="cuda"), 512 ** -0.5)
    torch.cuda.synchronize()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run([sys.executable, "-c", aot.COMPILE], input=json.dumps(log), capture_output=True, text=True,
                          env=env, timeout=600)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    rows = []
    for (heads, n_q, keys), launch, kernel, built in zip(SHAPES, log, compiled,
                                                         json.loads(done.stdout.strip().splitlines()[-1])):
        rows.append({"heads": heads, "rows": n_q, "keys": keys, "params": launch["params"],
                     "options": launch["options"], "jit": {"regs": kernel.n_regs, "stack": 4 * kernel.n_spills},
                     "aot": {"regs": built["regs"], "stack": built["stack"]}})
        print(heads, n_q, keys, rows[-1]["jit"], rows[-1]["aot"], flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.datetime.now().isoformat(), "device": torch.cuda.get_device_name(),
                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
