"""``use_orig_params=True``: the original parameters stay the module's parameters, as
views of the flat parameter (PyTorch 2.x FSDP1's ``_use_sharded_views`` /
``_use_sharded_grad_views`` / ``_writeback_orig_params``).

[Note: use_orig_params]
With ``use_orig_params=False`` a unit's original parameters leave their modules and
the optimizer sees one flat shard per unit. Code written for PyTorch 2.x often needs the
original ``nn.Parameter`` objects instead: per-parameter optimizer groups (no weight
decay on norms and biases), ``named_parameters()`` under the original names,
torch.compile. With ``use_orig_params=True``:

* The original parameters stay registered on their modules (the flat shard is not a
  registered parameter), and each one's ``.data`` is a view of the part of this rank's
  shard that holds it: 1-D, of ``numel_in_shard`` elements, possibly 0 when the
  parameter lies wholly in other ranks' shards, or only partly here when it straddles
  a shard boundary (FSDP1 keeps such views flat for the same reason). Under NO_SHARD
  (one-rank shard) the view has the parameter's own shape. So an optimizer step on the
  original parameters updates the shard in place, and each parameter keeps its own
  optimizer options.
* While the unit computes, ``module.<name>`` resolves to the unsharded parameter
  (``FlatParamHandle.use_unsharded_params`` sets the module's ``__dict__`` entry, which
  shadows ``_parameters``); at reshard the entry is removed, so outside forward and
  backward ``module.<name>`` is the original parameter again.
* After backward each original parameter's ``.grad`` is a view of its part of the
  reduced gradient shard (None when it has no part here or does not require grad).
  Because the views alias the shard's gradient, ``zero_grad()``, in-place clipping and
  the optimizer all act on the flat gradient.
* What the user may have replaced (``p.grad = None`` or a new tensor, ``p.data = t``)
  is written back into the flat shard before the next forward (``writeback``), so the
  flat gradient accumulates from what the parameters show.

Unlike FSDP1 the views are made once, not at every unshard: the unsharded parameters
the module computes with are separate tensors ([Note: one autograd leaf per parameter]),
so the original parameters never need to point at unsharded storage, except inside
``summon_full_params``, which points them at the full copy and back.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class OrigParamViews:
    """The original parameters of one unit as views of its flat shard.

    ``handle`` is the unit's FlatParamHandle (flat_param.py); ``params`` are the unique
    original parameters in ``handle.infos`` order. ``in_shard[i]`` is
    ``(offset in the shard, numel in the shard)`` of parameter ``i``.
    """

    def __init__(self, handle, params: list[nn.Parameter]):
        self.handle = handle
        self.params = params
        start = handle.shard_rank * handle.shard_numel
        end = start + handle.shard_numel
        self.in_shard: list[tuple[int, int]] = []
        for info in handle.infos:
            lo, hi = max(info.offset, start), min(info.offset + info.numel, end)
            self.in_shard.append((lo - start, hi - lo) if hi > lo else (0, 0))

    def _view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        offset, numel = self.in_shard[i]
        view = flat[offset : offset + numel]
        if self.handle.shard_world == 1:  # the whole parameter: its own shape
            return view.view(self.handle.infos[i].shape)
        return view

    # -- data ----------------------------------------------------------------------

    @torch.no_grad()
    def use_sharded_views(self) -> None:
        """Point each original parameter's ``.data`` at its part of the shard."""
        flat = self.handle.sharded_flat.detach()
        for i, param in enumerate(self.params):
            param.data = self._view(flat, i)

    def use_full_views(self, full: torch.Tensor) -> list[nn.Parameter]:
        """Point each original parameter at its full-shape piece of ``full`` (1-D, padded)
        for ``summon_full_params``; returns the parameters in ``infos`` order."""
        for param, info in zip(self.params, self.handle.infos):
            param.data = full[info.offset : info.offset + info.numel].view(info.shape)
        return self.params

    # -- gradients -------------------------------------------------------------------

    @torch.no_grad()
    def use_sharded_grad_views(self) -> None:
        """Set each original parameter's ``.grad`` to its part of the shard's gradient."""
        grad = self.handle.sharded_flat.grad
        for i, param in enumerate(self.params):
            if grad is None or self.in_shard[i][1] == 0 or not param.requires_grad:
                param.grad = None
                continue
            view = self._view(grad, i)
            if view.dtype != param.dtype:  # keep_low_precision_grads: as FSDP1, through .data
                if param.grad is None or param.grad.shape != param.shape:
                    param.grad = torch.empty_like(param)
                param.grad.data = view
            else:
                param.grad = view

    @torch.no_grad()
    def writeback(self) -> None:
        """Copy into the flat shard what the user replaced on the original parameters:
        ``.data`` set to another tensor, ``.grad`` set to None or to another tensor."""
        h = self.handle
        flat = h.sharded_flat.detach()
        for i, param in enumerate(self.params):
            view = self._view(flat, i)
            if param.data.data_ptr() != view.data_ptr() or param.data.shape != view.shape:
                if param.data.numel() == view.numel():
                    view.copy_(param.data.reshape(view.shape))
                elif param.data.numel() == h.infos[i].numel:  # a full-shape tensor: keep this rank's part
                    offset, numel = self.in_shard[i]
                    start = h.shard_rank * h.shard_numel + offset - h.infos[i].offset
                    view.copy_(param.data.reshape(-1)[start : start + numel].view(view.shape))
                else:
                    raise RuntimeError(
                        f"use_orig_params: {h.infos[i].fqn} was given data of {param.data.numel()} elements; "
                        f"expected {view.numel()} (this rank's part) or {h.infos[i].numel} (the whole parameter)"
                    )
                param.data = view
        grads = [param.grad for param, (_, numel) in zip(self.params, self.in_shard) if numel > 0]
        if all(g is None for g in grads):
            h.sharded_flat.grad = None
            return
        flat_grad = h.sharded_flat.grad
        if flat_grad is None:
            dtype = next(g.dtype for g in grads if g is not None)
            flat_grad = torch.zeros(h.shard_numel, dtype=dtype, device=flat.device)
            _set_grad(h.sharded_flat, flat_grad)
        for i, param in enumerate(self.params):
            if self.in_shard[i][1] == 0:
                continue
            view = self._view(flat_grad, i)
            if param.grad is None:
                view.zero_()
            elif param.grad.data_ptr() != view.data_ptr():
                view.copy_(param.grad.reshape(view.shape))
        self.use_sharded_grad_views()


def _set_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad = grad``, also when their dtypes differ (keep_low_precision_grads)."""
    if grad.dtype == param.dtype:
        param.grad = grad
    else:
        param.grad = torch.empty_like(param)
        param.grad.data = grad
