"""PNG plots of the tables computed in `dspark.analysis` (matplotlib, imported only here).

Each helper takes tables (lists of row dicts, or `Reliability` objects) and a path, writes one PNG
and returns the path; none computes statistics. Figures are built with `matplotlib.figure.Figure`
rather than pyplot, so no global figure state is created or left behind.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

from dspark.analysis.calibration import Reliability


def _figure(ncols: int = 1, width: float = 5.0, height: float = 3.6):
    try:
        from matplotlib.figure import Figure
    except ImportError as e:  # optional dependency: analysis tables work without it
        raise ImportError("plotting needs matplotlib: pip install 'dspark[notebooks]'") from e
    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    return fig, fig.subplots(1, ncols, squeeze=False)[0]


def _save(fig, path: str | os.PathLike) -> str:
    fig.savefig(path, dpi=110)
    return str(path)


def plot_tau_by_domain(rows: Sequence[dict], path: str | os.PathLike, title: str = "") -> str:
    """Bar chart of τ per domain (rows of `domain_table`)."""
    fig, (ax,) = _figure()
    names = [r["domain"] for r in rows]
    ax.bar(names, [r["tau"] for r in rows], color="C0")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['tau']:.2f}", (i, r["tau"]), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("τ (tokens per round, bonus included)")
    ax.set_title(title or "Accepted length per domain")
    ax.tick_params(axis="x", labelrotation=30)
    return _save(fig, path)


def plot_acceptance_by_position(rows: Sequence[dict], path: str | os.PathLike, title: str = "") -> str:
    """Unconditional prefix survival (left) and conditional acceptance (right, DSpark Fig. 2) per
    draft position, one line per domain (rows of `domain_table`)."""
    fig, (left, right) = _figure(2)
    for r in rows:
        pos = np.arange(1, len(r["conditional"]) + 1)
        left.plot(pos, r["accept_rate_at_k"], marker="o", label=r["domain"])
        right.plot(pos, r["conditional"], marker="o", label=r["domain"])
    for ax, name in ((left, "accept_rate@k (prefix survival)"), (right, "P(accept k | 1..k−1 accepted)")):
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("draft position k")
        ax.set_ylabel(name)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(title or "Acceptance by position")
    return _save(fig, path)


def plot_accept_histogram(rows: Sequence[dict], path: str | os.PathLike, title: str = "") -> str:
    """Share of rounds accepting j drafts, j = 0..γ, one group of bars per domain."""
    fig, (ax,) = _figure()
    width = 0.8 / max(len(rows), 1)
    for i, r in enumerate(rows):
        hist = np.asarray(r["accept_hist"], np.float64)
        ax.bar(np.arange(hist.size) + i * width, hist / max(hist.sum(), 1), width, label=r["domain"])
    ax.set_xlabel("accepted drafts per round")
    ax.set_ylabel("share of rounds")
    ax.set_title(title or "Accepted-count histogram")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_reliability(diagrams: Mapping[str, Sequence[Reliability]], path: str | os.PathLike,
                     positions: Sequence[int] | None = None, title: str = "") -> str:
    """Reliability diagrams (observed vs predicted prefix survival) for the chosen positions
    (0-based slots; default all), one marker series per label, e.g. {"raw": ..., "STS": ...}."""
    first = next(iter(diagrams.values()))
    positions = list(positions) if positions is not None else list(range(len(first)))
    fig, axes = _figure(len(positions), width=3.4, height=3.4)
    for ax, k in zip(axes, positions):
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
        for label, diags in diagrams.items():
            d = diags[k]
            ok = d.count > 0
            ax.plot(d.mean_pred[ok], d.mean_label[ok], marker="o", ms=3, label=label)
        ax.set_title(f"position {k + 1}")
        ax.set_xlabel("predicted survival")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("observed survival")
    axes[-1].legend(fontsize=8)
    fig.suptitle(title or "Reliability of cumprod(confidence)")
    return _save(fig, path)


def plot_threshold_sweep(sweeps: Mapping[str, Sequence[dict]], path: str | os.PathLike, title: str = "") -> str:
    """Accepted and rejected drafts per round (left) and acceptance rate (right) against the
    threshold, one line per label (rows of `threshold_sweep`), as in DSpark Fig. 5."""
    fig, (left, right) = _figure(2)
    for i, (label, rows) in enumerate(sweeps.items()):
        th = [r["threshold"] for r in rows]
        left.plot(th, [r["accepted"] for r in rows], color=f"C{i}", label=f"{label} accepted")
        left.plot(th, [r["rejected"] for r in rows], color=f"C{i}", ls="--", label=f"{label} rejected")
        right.plot(th, [r["acceptance_rate"] for r in rows], color=f"C{i}", marker="o", ms=3, label=label)
    left.set_ylabel("drafts per round")
    right.set_ylabel("acceptance rate (accepted / verified)")
    for ax in (left, right):
        ax.set_xlabel("confidence threshold")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or "Static threshold sweep")
    return _save(fig, path)


def plot_load(tables: Mapping[str, Sequence[dict]], path: str | os.PathLike, title: str = "") -> str:
    """Verification budget per request (left) and modelled throughput (right) against
    concurrency, one line per label (rows of `load_table`), as in DSpark Fig. 8."""
    fig, (left, right) = _figure(2)
    for label, rows in tables.items():
        load = [r["load"] for r in rows]
        left.plot(load, [r["verify_tokens"] for r in rows], marker="o", label=label)
        right.plot(load, [r["throughput"] for r in rows], marker="o", label=label)
    left.set_ylabel("verified tokens per request (1 + ℓ)")
    right.set_ylabel("total tokens/s (capacity model)")
    for ax in (left, right):
        ax.set_xlabel("concurrent requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "Scheduler under load")
    return _save(fig, path)


def plot_frontier(tables: Mapping[str, Sequence[dict]], path: str | os.PathLike, title: str = "") -> str:
    """Total throughput against tokens/s per user, one line per label (rows of `frontier` or
    `load_table`); Pareto points filled when the rows carry the `pareto` flag."""
    fig, (ax,) = _figure()
    for i, (label, rows) in enumerate(tables.items()):
        rows = sorted(rows, key=lambda r: r["per_user"])
        ax.plot([r["per_user"] for r in rows], [r["throughput"] for r in rows], color=f"C{i}", label=label)
        ax.scatter([r["per_user"] for r in rows], [r["throughput"] for r in rows], edgecolors=f"C{i}",
                   facecolors=[f"C{i}" if r.get("pareto", True) else "none" for r in rows], zorder=3)
    ax.set_xlabel("tokens/s per user")
    ax.set_ylabel("total tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "Throughput–interactivity frontier")
    return _save(fig, path)
