"""``parameters_as_bucket_view``: each rank's trainable parameters as views of one flat tensor.

As in PyTorch's ``ZeroRedundancyOptimizer`` (docs/behaviour.md §Z1.4): for every
device and every rank, the trainable parameters that rank owns are copied back to
back into one flat ``bucket`` and their ``.data`` becomes a view into it. The owner's
update then reaches the other ranks as *one* broadcast per (device, rank) instead of
one per parameter.

Frozen parameters are kept out of the buckets (they are never updated, so never
broadcast) and are given their own storage again: a parameter frozen after it was put
in a bucket would otherwise keep pointing into a bucket that is about to be replaced.
"""

from __future__ import annotations

import torch


def params_per_device(params_per_rank: list[list[torch.Tensor]]) -> dict[torch.device, list[list[torch.Tensor]]]:
    """Regroup ``params_per_rank[rank]`` as ``{device: [params of rank 0, rank 1, ...]}``.

    Devices appear in the order they are first met; every device has one list per
    rank, possibly empty. The same on every rank, as the broadcasts require.
    """
    world_size = len(params_per_rank)
    per_device: dict[torch.device, list[list[torch.Tensor]]] = {}
    for rank, params in enumerate(params_per_rank):
        for param in params:
            lists = per_device.setdefault(param.device, [[] for _ in range(world_size)])
            lists[rank].append(param)
    return per_device


def build_bucket_views(per_device: dict[torch.device, list[list[torch.Tensor]]]) -> list[list[torch.Tensor]]:
    """Return ``buckets[device_index][rank]``, rebinding each trainable parameter's data.

    A rank with nothing trainable on a device gets a dummy ``zeros(1)``, so that every
    rank still takes part in the same number of broadcasts.
    """
    buckets: list[list[torch.Tensor]] = []
    for device, params_per_rank in per_device.items():
        device_buckets = []
        for params in params_per_rank:
            trainable = [p for p in params if p.requires_grad]
            for param in params:
                if not param.requires_grad:
                    param.data = param.data.detach().clone()  # leave any previous bucket
            numel = sum(p.numel() for p in trainable)
            if numel == 0:
                device_buckets.append(torch.zeros(1, device=device))
                continue
            bucket = torch.empty(numel, dtype=trainable[0].dtype, device=device)  # 1D, params back to back
            offset = 0
            for param in trainable:
                view = bucket[offset : offset + param.numel()]
                view.copy_(param.data.reshape(-1))
                param.data = view.view_as(param.data)
                offset += param.numel()
            device_buckets.append(bucket)
        buckets.append(device_buckets)
    return buckets
