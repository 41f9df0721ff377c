"""The device every calibrate section runs on, named with its index ([Note: calibrate's
sections] in __init__.py)."""

from __future__ import annotations

import torch


def device_of(device: str | torch.device) -> torch.device:
    """``device`` with its index: an unindexed CUDA device is the current one, named
    (``cuda`` -> ``cuda:0``); other devices as they are ([Note: calibrate's sections])."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
