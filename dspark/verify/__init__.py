"""Verification: exact chain acceptance, verify-length planning, capacity curves, STS calibration.

`acceptance` decides which drafts a target forward accepts and emits the extra token, `planner`
decides how many drafts each request sends to that forward (fixed budget, the paper's Algorithm 1,
the asynchronous production variant), `capacity` holds the profiled SPS(B) curve the planner
optimises against, and `sts` calibrates the confidences it reads.
"""

from dspark.verify.acceptance import (pad_ragged, verify_chain, verify_chain_batch, verify_greedy,
                                      verify_greedy_batch, verify_sample, verify_sample_batch)
from dspark.verify.capacity import CapacityTable, default_cpu_table
from dspark.verify.planner import (VerifyPlan, async_budget, expected_tokens, plan_algorithm1, plan_async,
                                   plan_fixed, select_top_k, survival, throughput, uniform_budget)
from dspark.verify.sts import StsCalibration, expected_calibration_error, fit_sts

__all__ = [
    "CapacityTable", "StsCalibration", "VerifyPlan", "async_budget", "default_cpu_table",
    "expected_calibration_error", "expected_tokens", "fit_sts", "pad_ragged", "plan_algorithm1",
    "plan_async", "plan_fixed", "select_top_k", "survival", "throughput", "uniform_budget", "verify_chain",
    "verify_chain_batch", "verify_greedy", "verify_greedy_batch", "verify_sample", "verify_sample_batch",
]
