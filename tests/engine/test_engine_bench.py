"""bench/engine_h200.py runs end to end on the CPU (`--smoke`: tiny config, tiny grid), and its
fabricated decode states have the shapes of a real prefill (checked inside the script)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_engine_bench_smoke_writes_every_section(tmp_path):
    out = tmp_path / "engine.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(ROOT / "bench" / "engine_h200.py"), "--smoke", "--out", str(out)],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)
    r = json.loads(out.read_text())
    assert r["conditions"]["decode_state"].startswith("fabricated") and r["fabrication_check"]
    cells = {(d["mode"], d["requests"], d["context"]) for d in r["decode"]} | {
        (s["mode"], s["requests"], s["context"]) for s in r["skipped"] if s["phase"] == "decode"}
    assert cells == {(m, n, c) for m in ("none", "mtp1", "dspark3", "auto", "auto_async") for n in (1, 4) for c in (40, 100)}
    for d in r["decode"]:
        assert d["step_ms"] > 0 and d["tok_s_total"] == d["tok_s_per_user"] * d["requests"]
        assert d["mean_drafts_verified_per_request"] == {"none": 0, "mtp1": 1, "dspark3": 3}.get(d["mode"], d["mean_drafts_verified_per_request"])
    assert {p["new_tokens"] for p in r["prefill"]} | {s.get("new_tokens") for s in r["skipped"]} >= {16, 32}
    assert r["roofline"]["roofline_s"] > 0 and "peer" in r and "summary" in r
    assert set(r["capacity"]) == {"40", "100"}
    if r["peer"].get("available"):  # the ratio a roofline step would reach against the same peer
        s, roof = r["summary"], r["roofline"]["roofline_s"]
        assert abs(s["ratio_vs_hf_at_roofline"] * roof * r["peer"]["tok_s_decode"] - 1) < 1e-9


def test_engine_bench_smoke_static_decode_runs_every_decode_cell_on_static_slots(tmp_path):
    """`--static-decode`: every decode cell runs (fabricated states loaded into the static slots of
    `EngineConfig(static_decode=True)`; DSpark and MTP-1 cells draft on their static drafters) and says so; no CUDA
    graphs on the CPU."""
    out = tmp_path / "engine-static.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(ROOT / "bench" / "engine_h200.py"), "--smoke", "--static-decode",
                    "--steps", "3", "--out", str(out)], check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)
    r = json.loads(out.read_text())
    assert r["conditions"]["static_decode"] is True and r["conditions"]["graphs"] is False
    assert r["conditions"]["grid"]["steps"] == 3 and all(len(d["step_ms_all"]) == 3 for d in r["decode"])
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "engine_h200.py"), "--smoke", "--steps", "0",
                          "--out", str(tmp_path / "bad.json")], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "--steps must be >= 1, got 0" in bad.stderr
    cells = {(d["mode"], d["requests"], d["context"]) for d in r["decode"]}
    assert cells == {(m, n, c) for m in ("none", "mtp1", "dspark3", "auto", "auto_async") for n in (1, 4) for c in (40, 100)}
    for d in r["decode"]:
        assert d["static_decode"] is True and d["step_ms"] > 0 and d["engine_build_s"] >= 0
        assert d["static_drafter"] is (d["mode"] != "none") and d["draft_graphs"] is False
        assert d["n_draft"] == {"dspark3": 3, "auto": 5, "auto_async": 5}.get(d["mode"])  # DSpark drafts what it verifies
        assert d["mean_drafts_verified_per_request"] == {"none": 0, "mtp1": 1, "dspark3": 3}.get(d["mode"], d["mean_drafts_verified_per_request"])


def test_engine_bench_grid_options_restrict_the_decode_grid(tmp_path):
    """`--requests / --modes / --contexts / --decode-only` run exactly that grid and no peer or prefill;
    an unknown mode is refused by name."""
    out = tmp_path / "engine-grid.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(ROOT / "bench" / "engine_h200.py"), "--smoke", "--requests", "2",
                    "--modes", "none,dspark3", "--contexts", "40", "--decode-only", "--out", str(out)],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)
    r = json.loads(out.read_text())
    assert {(d["mode"], d["requests"], d["context"]) for d in r["decode"]} == {("none", 2, 40), ("dspark3", 2, 40)}
    assert r["prefill"] == [] and "peer" not in r
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "engine_h200.py"), "--smoke", "--modes", "fast",
                          "--out", str(tmp_path / "bad.json")], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "--modes 'fast'" in bad.stderr


def test_engine_bench_overlap_runs_on_the_static_path(tmp_path):
    """`--static-decode --overlap`: the decode cells run with EngineConfig(overlap=True) (the grid says
    so); `--overlap` alone is refused."""
    out = tmp_path / "engine-overlap.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    script = str(ROOT / "bench" / "engine_h200.py")
    subprocess.run([sys.executable, script, "--smoke", "--static-decode", "--overlap", "--requests", "2", "--modes",
                    "none", "--contexts", "40", "--decode-only", "--out", str(out)],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)
    r = json.loads(out.read_text())
    assert r["conditions"]["grid"]["overlap"] is True and [d["mode"] for d in r["decode"]] == ["none"]
    bad = subprocess.run([sys.executable, script, "--smoke", "--overlap", "--out", str(tmp_path / "bad.json")],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--overlap needs --static-decode" in bad.stderr


def test_engine_bench_auto_against_fixed_budgets_with_a_constant_confidence(tmp_path):
    """`--modes none,dspark1,dspark2,dspark3,auto_async --confidence C --table-from-cells` with
    `--overlap`: fixed budgets 1..3 are converted at the geometric model Σ_{k<=n} C^k, the async planner
    keeps its rounds in flight and plans on the fixed cells' SPS, the summary compares it with the best
    fixed budget in both timings; a confidence outside (0, 1) is refused by value, and so is a table
    from cells that lack a fixed budget (it would interpolate the missing ones)."""
    out = tmp_path / "engine-auto.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    script = str(ROOT / "bench" / "engine_h200.py")
    subprocess.run([sys.executable, script, "--smoke", "--static-decode", "--overlap", "--requests", "2", "--modes",
                    "auto_async,none,dspark1,dspark2,dspark3", "--contexts", "40", "--decode-only", "--steps", "2",
                    "--confidence", "0.8629", "--table-from-cells", "--out", str(out)],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)
    r = json.loads(out.read_text())
    rows = {d["mode"]: d for d in r["decode"]}
    assert list(rows) == ["none", "dspark1", "dspark2", "dspark3", "auto_async"]  # fixed cells first
    for n in (1, 2, 3):
        assert rows[f"dspark{n}"]["mean_drafts_verified_per_request"] == n
        assert abs(rows[f"dspark{n}"]["tau_converted"] - sum(0.8629 ** k for k in range(n + 1))) < 1e-9
    auto = rows["auto_async"]
    assert auto["round_in_flight"] is True and auto["capacity_label"].endswith("2 requests, fixed cells")
    assert set(r["summary"]["auto_async_over_best_fixed_pipelined"]) == {"2@40"}
    bad = subprocess.run([sys.executable, script, "--smoke", "--confidence", "1.5", "--out", str(tmp_path / "b.json")],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--confidence must lie in (0, 1), got 1.5" in bad.stderr
    sparse = subprocess.run([sys.executable, script, "--smoke", "--modes", "none,dspark3,auto_async", "--table-from-cells",
                             "--out", str(tmp_path / "s.json")], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert sparse.returncode != 0 and "needs every fixed cell in --modes: none,dspark1,dspark2,dspark3" in sparse.stderr
