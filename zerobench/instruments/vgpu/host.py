"""The host model's preset from host.json-shaped measurements (microseconds per call).

A stand-in of one function, so that a GPU preset's measured ``"host"`` section can be
used before the host model lands: an operator that launches no kernel costs what
``torch.empty`` cost (the dispatcher and Python, no launch), and one that launches a
kernel costs what ``x.add_(1)`` cost, the difference being the launch."""

from __future__ import annotations

from zerobench.instruments.vgpu.presets import HostPreset


def from_measurements(measured: dict) -> HostPreset:
    """The host preset of ``measured`` (host.json's keys, microseconds)."""
    dispatch_us = float(measured["empty_alloc_us"])
    launch_us = max(float(measured["add_inplace_us"]) - dispatch_us, 0.0)
    return HostPreset("measured", dispatch_s=dispatch_us * 1e-6, launch_s=launch_us * 1e-6)
