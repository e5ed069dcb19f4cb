"""The analysis notebooks run top to bottom on the embedded dspark-tiny pair with tiny parameters.

Each notebook's first cell holds its parameters; the test appends overrides to that cell (tiny
subsets, greedy decoding, output folder under tmp_path), executes with nbclient and checks the
PNGs. Needs the `notebooks` extra (matplotlib, nbclient, nbformat, ipykernel).
"""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

CASES = {
    "01_acceptance_by_position_and_domain": (
        'DATASETS = ["gsm8k", "mt-bench"]; LIMIT = 2; MAX_NEW_TOKENS = 12; CONCURRENCY = 4',
        ["tau_by_domain.png", "acceptance_by_position.png", "accept_histogram.png"]),
    "02_calibration_and_threshold_sweep": (
        'DATASETS = ["gsm8k", "mt-bench"]; LIMIT = 3; MAX_NEW_TOKENS = 16; CONCURRENCY = 6; THRESHOLDS = [0.0, 0.5, 0.9]',
        ["reliability.png", "threshold_sweep.png", "sts.json"]),
    "03_scheduler_under_load": (
        'DATASETS = ["gsm8k"]; LIMIT = 4; MAX_NEW_TOKENS = 10; CONCURRENCY_LEVELS = [1, 2, 4]; '
        'BUDGETS = {"all": "all", "auto": "auto"}',
        ["budget_and_throughput_vs_load.png", "frontier.png"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_notebook_runs(name, tmp_path):
    overrides, expected = CASES[name]
    book = nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)
    first = book.cells[0]
    assert "parameters" in first.metadata.get("tags", []) and first.cell_type == "code"
    assert all(not c.get("outputs") for c in book.cells if c.cell_type == "code")      # stored stripped
    out = tmp_path / "out"
    # One intra-op thread: the tiny model is slower with more (thread hand-offs dominate).
    first.source += (f"\nimport sys, torch\nsys.path.insert(0, {str(REPO)!r})\ntorch.set_num_threads(1)\n"
                     f"{overrides}\nTEMPERATURE = 0.0\nOUT_DIR = {str(out)!r}\n")
    nbclient.NotebookClient(book, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    for file in expected:
        data = (out / file).read_bytes()
        assert data[:8] == PNG_MAGIC if file.endswith(".png") else data.startswith(b"{")
