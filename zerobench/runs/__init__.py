"""Run folders: files.py (atomic writes), schema.py (every column), folder.py (the
layout of a run folder and reading it back), tables.py (results.csv with its types)."""
