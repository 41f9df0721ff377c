"""The instruments a rank is measured with: collectives.py (the collectives and their
sizes), link.py (the interconnect model), emulation.py (an emulated link), memory.py (the
storage tracker), telemetry.py (NVML sampling) and vgpu/ (the virtual GPU)."""
