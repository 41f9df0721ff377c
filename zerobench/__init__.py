"""zerobench: profiling-first benchmarks of ZeRO and FSDP engines.

Read it in the order a cell travels (each folder's ``__init__.py`` gives its own order):

1. ``spec/``: what a cell is. A workload (workload.py) names a model (models.py,
   llama.py, user_models.py), its data (data.py), activation checkpointing
   (checkpointing.py) and a matrix of engines and axes (matrix.py) that expands into
   cells. ``engines/`` holds the adapters every cell runs through (base.py's ``Engine``).
2. ``harness/``: running a matrix on this machine. runner.py drives the cells,
   preflight.py refuses what cannot fit, reference.py computes single-process losses,
   launch.py starts every rank process.
3. ``rank/``: one rank. passes.py runs a cell's passes under the torchrun entry point
   (``python -m zerobench.worker``); session.py runs a cell's engine ([Note: the rank session]) in a
   world of worlds.py: real ranks, or one rank of a fake process group ([Note: two worlds]).
4. ``instruments/``: what a rank is measured with. collectives.py is the one
   interception of ``torch.distributed`` ([Note: one interception]); link.py the
   interconnect model; emulation.py the emulated link; memory.py the storage tracker;
   vgpu/ the virtual GPU.
5. ``runs/``: run folders. folder.py reads and writes a folder ([Note: readers have no
   side effects]); files.py writes atomically. The columns of every table are named
   below every floor, in ``schema/columns.py``.
6. ``analysis/``: reading runs. summary.py, plots.py, profiling/ (traces), compare/ (the
   CI gate).
7. ``whatif/``: cells.py (what estimate and predict share), estimate/ (memory at any
   world size), simulate/ (a measured run re-timed), predict/ (the virtual GPU).
8. ``validation/``: gpu_check.py, the check of impl and the harness on a real GPU.

cli.py is the front door. Which folder may import which is held by
tests/test_import_graph.py (FLOORS).
"""
