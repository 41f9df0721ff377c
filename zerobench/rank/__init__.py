"""One rank: what runs inside a rank process. protocol.py is what the launcher tells a
rank (the torchrun environment); worlds.py the worlds a rank runs in (real ranks, or one
rank of a fake process group); session.py runs a cell's engine in a world; passes.py runs
a cell on this rank, its three passes (timing, profiling, memory) and its record, under
the torchrun entry point ``python -m zerobench.worker``; devices.py chooses the device
and backend."""
