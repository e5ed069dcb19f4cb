"""`LockstepEngine`: the engine of one DP-attention rank, kept in step with the other ranks.

Every target forward call runs each layer's `DispatchMoE`, and every rank must join every
exchange. Ranks own different requests, so one rank may have prompt chunks to feed while another
has none, or finish earlier. Each step therefore starts with one small all-reduce deciding which
phases (prefill, decode) run anywhere; a rank with nothing to do in a running phase joins each
layer's exchanges with zero tokens (`DispatchMoE.idle`), after the lookups of the sharded Engram
tables (`ShardedEngramTable.idle`), which the model issues before layer 0. Drafting and planning
stay local: the drafter, the planner and the sampling of each rank only see its own requests.
"""

from __future__ import annotations

from dspark.distributed.comm import Comm
from dspark.distributed.engram_shard import sharded_tables
from dspark.engine.engine import Engine, EngineConfig


class LockstepEngine(Engine):
    """`Engine` for DP attention + EP: same API (`add_request`, `step`, `abort`); loop on
    `has_work_anywhere()` instead of `has_work()`, on every rank."""

    def __init__(self, model, config: EngineConfig, comm: Comm, moe_layers: list):
        super().__init__(model, config)
        self.comm = comm
        self.moe_layers = moe_layers
        self.engram_tables = sharded_tables(model)

    def has_work_anywhere(self) -> bool:
        """Any rank has a waiting or running request (collective)."""
        return self.comm.any([self.has_work()])[0]

    def _run_phases(self, prefilling: list, decoding: list) -> None:
        """`Engine`'s phases, run wherever any rank has work: a rank without work in a running phase
        joins that call's exchanges with zero tokens. Collective: every rank calls `step` together."""
        any_prefill, any_decode = self.comm.any([bool(prefilling), bool(decoding)])
        if prefilling:
            self._prefill(prefilling)
        elif any_prefill:
            self.idle_forward()
        if decoding:
            self._decode(decoding)
        elif any_decode:
            self.idle_forward()

    def idle_forward(self) -> None:
        """Stand in for one target forward call of this rank: every layer's exchanges, no tokens,
        in the forward's order (Engram lookups before layer 0, then each layer's MoE)."""
        m = self.model
        for table in self.engram_tables:
            table.idle()
        for moe in self.moe_layers:
            moe.idle(m.config.hidden_size, m.dtype, m.device)
