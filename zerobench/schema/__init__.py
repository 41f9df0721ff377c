"""The vocabulary every floor shares, below all of them: the columns of every table
(columns.py: names, units, how each is compared) and the records a run folder keeps
(records.py: a cell's and each rank's). It imports nothing of zerobench, so the
instruments that measure a rank and the run folders that keep what they measured both
read it without one depending on the other."""
