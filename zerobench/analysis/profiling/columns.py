"""The columns ``zerobench analyze`` adds to results.csv: defined in :mod:`zerobench.schema.columns`
(the one place that names columns), re-exported here for the analysis code."""

from zerobench.schema.columns import ANALYSIS_METRICS, GPU_TELEMETRY_METRICS, bandwidth_metrics

__all__ = ["ANALYSIS_METRICS", "GPU_TELEMETRY_METRICS", "bandwidth_metrics"]
