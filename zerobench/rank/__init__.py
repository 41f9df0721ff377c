"""One rank: what runs inside a rank process. protocol.py is what the launcher tells a
rank (the torchrun environment); worlds.py the worlds a rank runs in (real ranks, or one
rank of a fake process group); session.py runs a cell's engine in a world; worker.py is
the torchrun entry point and its three passes; devices.py chooses the device and backend."""
