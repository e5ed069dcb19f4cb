"""The CSA2 layer schedule of DeepSeek-V4.1 (deepseek_v41 spec §2.3-§2.4, §5): who owns and who reads.

Every layer keeps its own sliding window. On top of that, a layer with `compress_ratios[l] > 0`
attends to global (compressed) KV, which only a few layers produce:

=========  =====================================  ==================================================
role       owns                                   reads
=========  =====================================  ==================================================
swa        nothing (ratio 0)                      its window only
full       compressor + indexer with `wk`,        its own entries, index keys and top-k
           `k_norm` (a KV source, also an index
           source)
reindex    indexer (`wq_b`, `weights_proj`)       the preceding KV source's entries and index keys;
                                                  scores with its own queries (inside the candidate
                                                  pool when a candidate source precedes it)
reuse      nothing extra                          the preceding KV source's entries and the preceding
                                                  index source's top-k list
=========  =====================================  ==================================================

Released Flash (40 layers): swa 0-1; full 2, 8, 14 (ratio 2) and 20 (ratio 1, candidate source);
reindex 24, 28, 32, 36; reuse the rest. `validate_schedule` raises a ValueError naming the layer
for any schedule in which a layer would read state that nobody (or a different source) produced.
"""

from __future__ import annotations

from dataclasses import dataclass

SWA, FULL, REINDEX, REUSE = "swa", "full", "reindex", "reuse"


@dataclass(frozen=True)
class LayerRole:
    """What one layer owns and reads (see the module table).

    kv_source / index_source: the layer whose entries / top-k list this layer reads (None for ratio
    0); uses_candidates: an index source after the candidate source, which scores only inside the
    pool that source published (spec §5.4); rope: "compress" for every ratio > 0, else "main".
    """

    layer_id: int
    kind: str
    ratio: int
    kv_source: int | None
    index_source: int | None
    is_candidate_source: bool
    uses_candidates: bool
    has_engram: bool

    @property
    def rope(self) -> str:
        return "main" if self.ratio == 0 else "compress"

    @property
    def owns_compressor(self) -> bool:
        return self.kind == FULL

    @property
    def owns_indexer(self) -> bool:
        return self.kind in (FULL, REINDEX)


def _latest(ids, layer: int) -> int | None:
    """Latest entry of `ids` at or before `layer`."""
    before = [i for i in ids if i <= layer]
    return max(before) if before else None


def validate_schedule(c) -> None:
    """Check the CSA2 schedule of a config (spec §2.4 rules, plus the ones that keep every read
    well-defined). `c` provides compress_ratios, kv_source_layer_ids, index_source_layer_ids,
    candidate_source_layer_id and num_hidden_layers."""
    n, ratios = c.num_hidden_layers, c.compress_ratios
    kv, index, candidate = c.kv_source_layer_ids, c.index_source_layer_ids, c.candidate_source_layer_id
    for i, r in enumerate(ratios):
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"compress_ratios[{i}]: {r!r} must be an int >= 0 (0 = window only)")
    for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", index)):
        if list(ids) != sorted(set(ids)) or any(not isinstance(i, int) or not 0 <= i < n for i in ids):
            raise ValueError(f"{name}: {list(ids)} must be increasing layer ids in [0, {n})")
        zero = [i for i in ids if ratios[i] == 0]
        if zero:
            raise ValueError(f"{name}: layers {zero} have compress_ratios 0; sources need a compressed branch")
    for layer in range(n):
        if ratios[layer] == 0:
            continue
        source = _latest(kv, layer)
        if source is None:
            raise ValueError(f"compress_ratios[{layer}]: {ratios[layer]} but no kv_source_layer_ids entry at or "
                             f"before layer {layer} publishes global KV (kv_source_layer_ids={list(kv)})")
        if ratios[source] != ratios[layer]:
            raise ValueError(f"compress_ratios[{layer}]: {ratios[layer]} differs from its KV source layer {source} "
                             f"(ratio {ratios[source]}); a layer reads entries pooled at its own ratio")
        picker = _latest(index, layer)
        if picker is None or picker < source:
            raise ValueError(f"index_source_layer_ids: {list(index)} has no entry in [{source}, {layer}] for layer "
                             f"{layer}; its top-k list would index another source's entries (KV source {source})")
    if not isinstance(candidate, int) or isinstance(candidate, bool):
        raise ValueError(f"candidate_source_layer_id: {candidate!r} must be an int (< 0 disables)")
    if candidate >= 0:
        if candidate not in index:
            raise ValueError(f"candidate_source_layer_id: {candidate} must be one of index_source_layer_ids "
                             f"{list(index)}")
        stray = [i for i in index if i > candidate and _latest(kv, i) != _latest(kv, candidate)]
        if stray:
            raise ValueError(f"index_source_layer_ids: layers {stray} come after candidate_source_layer_id "
                             f"{candidate} but read another KV source; its candidate pool covers other entries")


def derive_roles(c) -> tuple[LayerRole, ...]:
    """One `LayerRole` per backbone layer of a validated config."""
    roles = []
    engram = set(c.engram_layer_ids)
    for layer, ratio in enumerate(c.compress_ratios):
        kv = _latest(c.kv_source_layer_ids, layer) if ratio else None
        index = _latest(c.index_source_layer_ids, layer) if ratio else None
        if ratio == 0:
            kind = SWA
        elif layer in c.kv_source_layer_ids:
            kind = FULL
        elif layer in c.index_source_layer_ids:
            kind = REINDEX
        else:
            kind = REUSE
        candidate = c.candidate_source_layer_id
        roles.append(LayerRole(
            layer_id=layer, kind=kind, ratio=ratio, kv_source=kv, index_source=index,
            is_candidate_source=layer == candidate,
            uses_candidates=kind in (FULL, REINDEX) and 0 <= candidate < layer,
            has_engram=layer in engram,
        ))
    return tuple(roles)
