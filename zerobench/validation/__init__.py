"""Checks of zerobench against real hardware: ``gpu_check`` runs impl's limiter and
prefetch, and the harness's cells, on a CUDA GPU (or on the virtual GPU with
``--virtual``), for ``scripts/gpu-check``; ``calibrate/`` measures a GPU's kernels and
writes the preset the virtual GPU prices them with (``zerobench calibrate``);
``kernels`` puts those measurements beside the virtual GPU's price of the same kernels
(docs/vgpu.md's kernel table). It sits above every other floor: it drives ranks,
engines and the virtual GPU, and nothing imports it but the command line."""
