"""The CI gate: gate.py (match cells, judge metrics, exit code), rules.py (the rules)
and report.py (terminal, Markdown and plot renderings)."""
