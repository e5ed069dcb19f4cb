"""Side CUDA streams for the parts of a static step that do not depend on each other.

    side = SideStreams(device, lanes=2)      # once per decoder (inline on the CPU)
    with side.fork(COMPRESS):                # enqueued after everything the current stream has so far
        update_compressor(...)               # runs beside what the current stream enqueues next
    with side.fork(KV):
        attn.project_kv(...)                 # a second lane beside both (its rows to the window ring)
    q = attn.project_q_heads(...)            # current stream
    side.join(COMPRESS); side.join(KV)       # the current stream waits for the lanes' work
    attend(q, window, entries)

At one decode token a layer's kernels are latency-bound (a few µs each, most SMs idle). Its
compressors (projection, pooling, norm: three launches each, two on a CSA layer) and its kv
projection (projection, norm + RoPE) need only the sublayer input, as does the q projection, and the
indexer's queries (its wq_b, RoPE, head weights) only that and c_q, beside the q heads' wq_b and norm;
in one stream every launch waits for the one before it, forked onto lanes they overlap. Under CUDA-graph
capture a fork and a join become edges of the graph (branches), so the replay keeps the overlap at
no host cost. The math is unchanged: each kernel reads and writes what it did in one stream, so the
step's results are the same bits.

Ordering and memory, from two rules the static steps keep: a lane's work is always forked from the
current stream's latest point (`fork` makes the lane wait for it), and the current stream joins every
lane it forked before the attention of the layer reads anything (and so before the sublayer input or
any other tensor a lane read can be freed and its memory reused by the current stream). Then a tensor
a lane allocates and the current stream reads after the join (the indexer's queries) may return to the
lane's pool when it is dropped: the lane's next work that could reuse it comes after a later fork,
i.e. after the current stream's reads. Results that outlive the layer go to the decoder's state.
The step's `StepIndex` must be planned (`StepTables.planned`): its tensors are then views of one buffer
built before any fork, where an unplanned one builds each on first use, on whichever stream asks,
and another stream could read it before its join (`StaticDecoderBase` keeps such a step on one stream).

The mHC sites use a third lane, MIX: a site's mixes (V4.1: pre, post, comb; V4: post and comb, the
collapse needing only pre; their sigmoids and Sinkhorn are about a quarter of the site's time) are
read only by the next site, so they run beside the sublayer, which reads the normed collapse alone.
That lane is joined before the next site, after the sublayer; its work reads statistics partials the
current stream made and then drops, so the site op marks them in use by the lane
(`Tensor.record_stream`) and they are not reused before. (V4 splits its folded sites
(`mhc_norm.folds`) and the unfolded epilogue of larger steps alike. Where the lane is
not a stream, on the CPU, the sites keep their one-launch epilogue: the same bits in fewer launches.)

A lane numbered past `lanes` (and every lane on the CPU) runs its block inline: `lanes` = 0 is the
single-stream step a bench compares with.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from dspark.models.deepseek_v4.compressor import head_weights

COMPRESS, KV, MIX = 0, 1, 2  # the static steps' lanes (MIX: the mHC sites' mixes beside the sublayer)
MAX_LANES = 3
# The static decoders' default: every lane. One H100 (`bench/gpu_session23.sh b`,
# `side-streams-h100-s24*.json`): the v4-mini graph step 1.397 ms with 2 lanes, 1.442 with 1, 1.536 with
# none at one request (1.10x); 1.09x at 8 requests, 1.08x for the 4-token verify block, 1.07x on v41-mini;
# logits and state equal bit for bit in every case.
DEFAULT_LANES = 3


# Whether the static steps compute a CSA layer's indexer head weights (weights_proj, which reads x alone) on the
# KV lane before that lane waits for c_q, leaving the indexer's queries (wq_b, RoPE) after it: one launch fewer
# between c_q and the selection, the same bits. A candidate, not yet timed (`bench/graph_decode.py --gemv-ab
# head_weights_early`); off.
HEAD_WEIGHTS_EARLY = False


def early_head_weights(indexer, x: torch.Tensor) -> torch.Tensor | None:
    """`head_weights(indexer, x)` [N, Hi] fp32 where HEAD_WEIGHTS_EARLY and the layer has an indexer, else None."""
    return None if indexer is None or not HEAD_WEIGHTS_EARLY else head_weights(indexer, x)


def index_queries(indexer, x: torch.Tensor, q_lora: torch.Tensor, cos, sin, weights: torch.Tensor | None):
    """The indexer's (queries, head weights): `indexer.queries`, or with `weights` from `early_head_weights`
    the queries alone beside them."""
    if weights is None:
        return indexer.queries(x, q_lora, cos, sin)
    return indexer.rotated(q_lora, cos, sin), weights


def check_lanes(lanes) -> int:
    """`lanes` when it is an int in [0, MAX_LANES], else a ValueError naming it."""
    if isinstance(lanes, bool) or not isinstance(lanes, int) or not 0 <= lanes <= MAX_LANES:
        raise ValueError(f"side streams must be an int in [0, {MAX_LANES}], got {lanes!r}")
    return lanes


class SideStreams:
    """`lanes` side streams of `device` (module docstring)."""

    def __init__(self, device: torch.device, lanes: int = MAX_LANES):
        check_lanes(lanes)
        device = torch.device(device)
        self.streams = [torch.cuda.Stream(device) for _ in range(lanes)] if device.type == "cuda" else []
        self.forked = [False] * len(self.streams)  # work forked onto the lane since its last join

    @contextlib.contextmanager
    def fork(self, lane: int) -> Iterator[None]:
        """Run the block's work on lane `lane`, after what the current stream has enqueued."""
        if lane >= len(self.streams):
            yield
            return
        stream = self.streams[lane]
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        self.forked[lane] = True
        with torch.cuda.stream(stream):
            yield

    def lane_fork(self, lane: int):
        """A zero-argument factory of `fork(lane)` (what the site ops take as `mixes_on`) where the
        lane is a real stream; None elsewhere (on the CPU, or past `lanes`), where the caller keeps the
        work in order on its own stream: inline, one launch gives the same bits in fewer launches."""
        return functools.partial(self.fork, lane) if lane < len(self.streams) else None

    def join(self, lane: int) -> None:
        """Make the current stream wait for everything forked onto `lane` since its last join (nothing
        to wait for without a fork: under graph capture a wait on a lane with no captured work
        would be a dependency outside the graph)."""
        if lane < len(self.streams) and self.forked[lane]:
            stream = self.streams[lane]
            torch.cuda.current_stream(stream.device).wait_stream(stream)
            self.forked[lane] = False
