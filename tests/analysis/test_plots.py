"""Plot helpers write one PNG each from the analysis tables (skipped without matplotlib)."""

import pytest

from dspark.analysis import (calibration_table, domain_table, fit_sts_from_trace, frontier, load_table,
                             number_steps, reliability_by_position, threshold_sweep)
from dspark.verify.capacity import default_cpu_table

plots = pytest.importorskip("dspark.analysis.plots", exc_type=ImportError)
pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def trace(record):
    rows = []
    for i, (a, c) in enumerate([(3, 0.9), (0, 0.3), (2, 0.8), (1, 0.5)] * 3):
        rows.append(record(f"r{i % 2}", accepted=a, confidence=[c, c, c], load=2, domain=["gsm8k", "mbpp"][i % 2],
                           logits=[1.0 + a, 0.5 * a, a - 1.0]))
    return number_steps(rows)


def test_every_plot_writes_a_png(tmp_path, trace):
    rows = domain_table(trace)
    cal = fit_sts_from_trace(trace)
    loads = {"fixed": load_table(trace, default_cpu_table())}
    written = [
        plots.plot_tau_by_domain(rows, tmp_path / "tau.png"),
        plots.plot_acceptance_by_position(rows, tmp_path / "position.png"),
        plots.plot_accept_histogram(rows, tmp_path / "hist.png"),
        plots.plot_reliability({"raw": reliability_by_position(trace),
                                "STS": reliability_by_position(trace, cal)}, tmp_path / "rel.png", positions=[0, 2]),
        plots.plot_threshold_sweep({"all": threshold_sweep(trace, [0.0, 0.4, 0.85])}, tmp_path / "sweep.png"),
        plots.plot_load(loads, tmp_path / "load.png"),
        plots.plot_frontier({k: frontier(v) for k, v in loads.items()}, tmp_path / "frontier.png"),
    ]
    assert len(calibration_table(trace, cal)) == 3
    for path in written:
        with open(path, "rb") as f:
            assert f.read(8) == PNG_MAGIC
