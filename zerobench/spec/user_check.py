"""The user's code a workload names, run once before anything is written: so that a
factory that raises, a batch function that returns the wrong thing or a loss that is no
scalar is a WorkloadError naming its key and its own message, exit 2, instead of a
traceback in the harness or a failed cell after a run folder was made. (Its own module:
it calls the model builders, the batches and the losses, which call user_models.)"""

from __future__ import annotations

import torch

from zerobench.spec.data import global_batch
from zerobench.spec.models import loss_fn
from zerobench.spec.user_models import build_factory_model, units_by_class
from zerobench.spec.workload import FactoryConfig, HFConfig, WorkloadError


def check_user_model(cfg, batch_size: int = 2, seed: int = 0, label: str = "") -> None:
    """Run what the workload names of the user's code once, before anything is written:
    the factory on the meta device (no memory), the batch function on ``batch_size``
    samples (at most 8: its types are checked, not its size), and the loss on the meta model's output when the model runs on meta tensors.
    WorkloadError naming ``label`` (the workload's file), the key (model.factory, model.batch,
    model.loss, model.wrap) and the user's own exception. A Hugging Face model's ``wrap``
    classes are looked for in the model built on the meta device; builtin models pass untouched."""
    try:
        _check(cfg, batch_size, seed)
    except WorkloadError as err:
        raise WorkloadError(f"{label}: {err}" if label else str(err)) from None


def _check(cfg, batch_size: int, seed: int) -> None:
    if isinstance(cfg, HFConfig) and cfg.wrap:
        from zerobench.spec.user_models import build_hf_model

        with torch.device("meta"):
            units_by_class(build_hf_model(cfg), tuple(cfg.wrap))
        return
    if not isinstance(cfg, FactoryConfig):
        return
    with torch.device("meta"):
        model = build_factory_model(cfg)
    units_by_class(model, tuple(cfg.wrap))
    inputs, targets = global_batch(cfg, max(1, min(batch_size, 8)), seed, 0)
    loss = loss_fn(cfg)
    try:
        with torch.no_grad():
            output = model(inputs.to("meta"))
    except Exception:  # a model that does not run on meta tensors is checked when it runs
        return
    loss(output, targets.to("meta"))
