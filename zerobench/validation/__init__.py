"""Checks of zerobench against real hardware: ``gpu_check`` runs impl's limiter and
prefetch, and the harness's cells, on a CUDA GPU (or on the virtual GPU with
``--virtual``), for ``scripts/gpu-check``. It sits above every other floor: it drives
ranks, engines and the virtual GPU, and nothing imports it."""
