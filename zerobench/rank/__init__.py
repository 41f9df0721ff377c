"""One rank: what runs inside a rank process. worker.py is the torchrun entry point;
devices.py chooses the rank's device and backend."""
