"""The vocabulary every floor shares, below all of them: the columns of every table
(columns.py: names, units, how each is compared). It imports nothing of zerobench, so
the instruments that measure a rank and the run folders that keep what they measured
both read it without one depending on the other."""
