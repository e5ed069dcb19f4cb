"""Round traces: one record per request per speculative round, stored as JSON lines.

The schema is documented in docs/traces.md; `dspark.round.trace_record` writes the engine's fields,
`number_steps` adds the engine-step index the load analyses group by. Analyses read the records
through `TraceArrays`, a column view (one numpy array per field) that is cheap to filter.

Shape symbols: N rounds (records), γ drafted tokens per round (block size; 0 for plain decoding).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

import numpy as np

# Field name -> accepted Python types. `domain`, `round`, `stop`, `tokens`, `confidence_logits` and
# `step` are optional so that traces written before they existed still load.
REQUIRED_FIELDS = {
    "request_id": (str,), "position": (int,), "draft": (list,), "confidence": (list,),
    "verified": (int,), "accepted": (int,), "committed": (int,), "bonus": (bool,), "load": (int,),
    "temperature": (int, float),
}
OPTIONAL_FIELDS = {
    "domain": (str,), "round": (int,), "tokens": (list,), "stop": (bool,),
    "confidence_logits": (list, type(None)), "step": (int,),
}


def validate_record(record: dict, where: str = "record") -> None:
    """Raise ValueError naming `where` and the field when `record` does not follow the schema."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in REQUIRED_FIELDS if k not in record]
    if missing:
        raise ValueError(f"{where}: missing fields {missing}")
    for name, types in {**REQUIRED_FIELDS, **OPTIONAL_FIELDS}.items():
        if name not in record:
            continue
        value = record[name]
        # bool is an int subclass: a bool where a count is expected is a schema error.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ValueError(f"{where}: field {name!r} must be {'/'.join(t.__name__ for t in types)}, "
                             f"got {value!r}")
    gamma = len(record["draft"])
    if len(record["confidence"]) not in (0, gamma):
        raise ValueError(f"{where}: confidence has {len(record['confidence'])} entries for γ={gamma} drafts")
    if record.get("confidence_logits") is not None and len(record["confidence_logits"]) != gamma:
        raise ValueError(f"{where}: confidence_logits has {len(record['confidence_logits'])} entries for γ={gamma}")
    v, a, c = record["verified"], record["accepted"], record["committed"]
    if not 0 <= a <= v <= gamma:
        raise ValueError(f"{where}: need 0 <= accepted ({a}) <= verified ({v}) <= γ ({gamma})")
    if not 1 <= c <= a + 1:
        raise ValueError(f"{where}: committed ({c}) must lie in [1, accepted + 1 = {a + 1}]")
    if record["load"] < 1:
        raise ValueError(f"{where}: load must be >= 1, got {record['load']}")


def write_traces(path: str | os.PathLike, records: Iterable[dict]) -> int:
    """Write `records` as JSON lines (one object per line, no header); returns how many."""
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            validate_record(record, f"record {count}")
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
            count += 1
    return count


def read_traces(path: str | os.PathLike) -> list[dict]:
    """Read a JSONL trace; ValueError names the file and line of the first bad record."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            validate_record(record, f"{path}:{lineno}")
            records.append(record)
    return records


def number_steps(records: Sequence[dict], start: int = 0) -> list[dict]:
    """Copies of `records` with `step`: the index of the engine round each record belongs to.

    Relies on the engine's order: a round appends exactly `load` consecutive records, one per live
    request. So the trace must be complete and unfiltered (as returned by `Engine.take_trace`,
    possibly concatenated over several calls); a group whose loads differ or that repeats a request
    raises ValueError.
    """
    out, i, step = [], 0, start
    while i < len(records):
        load = records[i]["load"]
        group = records[i:i + load]
        if len(group) < load or any(r["load"] != load for r in group):
            raise ValueError(f"record {i}: the next {load} records (its load) are not one round; "
                             f"number_steps needs the complete, unfiltered engine trace")
        if len({r["request_id"] for r in group}) != load:
            raise ValueError(f"record {i}: a request appears twice in one round of load {load}")
        out.extend({**r, "step": step} for r in group)
        i, step = i + load, step + 1
    return out


@dataclass(frozen=True)
class TraceArrays:
    """Column view of N round records (see docs/traces.md for each field's meaning).

    request_id, domain : str arrays [N]
    round, position, step : int64 [N] (-1 where the record lacks the field)
    verified, accepted, committed, load : int64 [N]
    bonus, stop : bool [N]
    temperature : float64 [N]
    confidence : float64 [N, γ], c_k as the planner saw it (NaN rows for records without confidences)
    confidence_logits : float64 [N, γ] raw head logits z_k, or None unless every record has them
    """

    request_id: np.ndarray
    domain: np.ndarray
    round: np.ndarray
    position: np.ndarray
    step: np.ndarray
    verified: np.ndarray
    accepted: np.ndarray
    committed: np.ndarray
    load: np.ndarray
    bonus: np.ndarray
    stop: np.ndarray
    temperature: np.ndarray
    confidence: np.ndarray
    confidence_logits: np.ndarray | None

    @property
    def num_rounds(self) -> int:
        return int(self.verified.shape[0])

    @property
    def gamma(self) -> int:
        return int(self.confidence.shape[1])

    def select(self, mask: np.ndarray) -> TraceArrays:
        """The rounds where the bool mask [N] is true."""
        mask = np.asarray(mask)
        if mask.dtype != bool or mask.shape != (self.num_rounds,):
            raise ValueError(f"mask must be bool [{self.num_rounds}], got {mask.dtype} {mask.shape}")
        return TraceArrays(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[mask]
                              for f in fields(self)})

    def domains(self) -> list[str]:
        """Distinct domains in first-seen order."""
        return list(dict.fromkeys(self.domain.tolist()))


def to_arrays(records: Sequence[dict] | TraceArrays) -> TraceArrays:
    """Column view of a list of records (validated); a TraceArrays passes through.

    Every record that drafted must have the same block size γ; ValueError otherwise. A record that
    drafted nothing (plain decoding, or a plain round of an engine with a drafter: "auto"'s budget 0 on
    the round in flight) fits any γ, with a NaN confidence row and nothing verified.
    """
    if isinstance(records, TraceArrays):
        return records
    gammas = set()
    for i, r in enumerate(records):
        validate_record(r, f"record {i}")
        if r["draft"]:
            gammas.add(len(r["draft"]))
    if len(gammas) > 1:
        raise ValueError(f"records mix block sizes γ={sorted(gammas)}; analyse each drafter separately")
    gamma = gammas.pop() if gammas else 0
    n = len(records)

    def col(name, dtype, default=None):
        return np.array([r.get(name, default) for r in records], dtype=dtype).reshape(n)

    conf = np.full((n, gamma), math.nan)
    for i, r in enumerate(records):
        if r["confidence"]:
            conf[i] = r["confidence"]
    has_logits = n > 0 and gamma > 0 and all(r.get("confidence_logits") is not None for r in records)
    logits = np.array([r["confidence_logits"] for r in records], dtype=np.float64) if has_logits else None
    return TraceArrays(
        request_id=col("request_id", object).astype(str), domain=col("domain", object, "").astype(str),
        round=col("round", np.int64, -1), position=col("position", np.int64), step=col("step", np.int64, -1),
        verified=col("verified", np.int64), accepted=col("accepted", np.int64),
        committed=col("committed", np.int64), load=col("load", np.int64), bonus=col("bonus", bool),
        stop=col("stop", bool, False), temperature=col("temperature", np.float64),
        confidence=conf, confidence_logits=logits)
