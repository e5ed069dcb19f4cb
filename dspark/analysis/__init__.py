"""Acceptance-rate analysis of round traces: pure functions from trace records to tables.

    traces       schema checks, JSONL write/read, step numbering, the `TraceArrays` column view
    acceptance   τ and its distribution, prefix survival, conditional acceptance, per-domain tables
    calibration  reliability data, ECE, AUROC, Brier of cumprod(confidence); STS from a trace
    threshold    static confidence-threshold sweep replayed from verify-all traces (Fig. 5)
    load         verification budget and modelled throughput vs concurrency; the frontier (Fig. 7–8)
    plots        matplotlib PNG writers for those tables (`dspark.analysis.plots`, optional import)

Every function accepts a list of trace records (docs/traces.md) or a `TraceArrays`.
"""

from dspark.analysis.acceptance import (CATEGORIES, accept_histogram, acceptance_rate, category_means,
                                        conditional_acceptance, domain_table, position_counts, prefix_survival,
                                        summary_row, tau, tau_histogram, tau_per_request, verify_rate)
from dspark.analysis.calibration import (Reliability, auroc, calibration_table, confidence_logits, ece,
                                         fit_sts_from_trace, holdout_split, reliability, reliability_by_position,
                                         survival_and_labels, verify_all_rounds)
from dspark.analysis.load import frontier, load_table, step_table
from dspark.analysis.threshold import threshold_sweep, truncation_lengths
from dspark.analysis.traces import (TraceArrays, number_steps, read_traces, to_arrays, validate_record,
                                    write_traces)

__all__ = [
    "CATEGORIES", "Reliability", "TraceArrays", "accept_histogram", "acceptance_rate", "auroc",
    "calibration_table", "category_means", "conditional_acceptance", "confidence_logits", "domain_table", "ece",
    "fit_sts_from_trace", "frontier", "holdout_split", "load_table", "number_steps", "position_counts", "prefix_survival",
    "read_traces", "reliability", "reliability_by_position", "step_table", "summary_row", "survival_and_labels",
    "tau", "tau_histogram", "tau_per_request", "threshold_sweep", "to_arrays", "truncation_lengths",
    "validate_record", "verify_all_rounds", "verify_rate", "write_traces",
]
