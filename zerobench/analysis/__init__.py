"""Analysis of run folders: render.py (the one table renderer, [Note: tables at any
width]), summary.py (the summary table), plots.py, figures.py, profiling/ (traces) and
compare/ (the CI gate)."""
