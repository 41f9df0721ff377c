"""Analysis of run folders: summary.py (the summary table), plots.py, figures.py,
profiling/ (traces) and compare/ (the CI gate)."""
