"""The harness: running a matrix on this machine. runner.py drives the cells, launch.py
starts each cell's ranks the way torchrun does, preflight.py refuses what cannot fit,
reference.py computes the single-process losses, active.py sees other runs, and
testing.py runs a function on real gloo ranks for tests."""
