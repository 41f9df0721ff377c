"""``zerobench calibrate``: measure what the virtual GPU's cost model needs on the GPU at
hand. host.py measures the host: per call, per stream call, per collective call, and
whole training steps (the figures of zerobench/instruments/vgpu/host.py, [Note: host
cost])."""
