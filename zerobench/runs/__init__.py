"""Run folders: files.py (atomic writes), folder.py (the layout of a run folder and
reading it back), tables.py (results.csv with its types), kinds.py (a run, an estimate
or a prediction). Their columns are named below every floor, in zerobench/schema/columns.py."""
