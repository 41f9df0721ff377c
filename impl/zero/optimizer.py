"""ZeRO stage 1: ``impl.zero.ZeroRedundancyOptimizer``, optimizer state sharded by parameter.

A drop-in for ``torch.distributed.optim.ZeroRedundancyOptimizer`` (same constructor,
methods and properties), as in ZeRO (arXiv 1910.02054) stage 1, "P_os": every rank
keeps the whole model and computes full gradients (DDP averages them), but each
parameter's optimizer state lives only on the rank that owns it. Each rank steps its
own parameters and then broadcasts them to the others. Behaviour follows
docs/behaviour.md §Z1; the deliberate differences are listed in docs/zero.md.

Layers (one file each): constructor checks (``validation.py``), who owns what
(``partition.py``), flat bucket views (``param_buckets.py``), local/global state
translation (``state_dict.py``), object transport for checkpoints (``transport.py``).
This file only ties them together.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from impl import comm
from impl.zero import param_buckets
from impl.zero.clip import clip_grad_norm_
from impl.zero.overlap import BucketAssignment, OverlapInfo, OverlapStatus, assign_buckets, build_assignment_tensors
from impl.zero.partition import manual_partition, rank_numels, sorted_greedy_partition
from impl.zero.state_dict import (
    check_param_groups_match,
    global_index,
    index_to_param,
    local_to_global_state,
    sync_hyperparams,
)
from impl.zero.transport import broadcast_object, copy_to_device
from impl.zero.validation import (
    check_same_dense_type,
    materialize_params,
    optimizer_constructor,
)


class _StepOnJoin(JoinHook):
    """Join hook: a rank that ran out of inputs keeps stepping, so that it keeps
    broadcasting the parameters it owns (its gradients must already be set)."""

    def __init__(self, zero: ZeroRedundancyOptimizer):
        self.zero = zero

    def main_hook(self) -> None:
        self.zero.step()


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Shard ``optimizer_class``'s state over the ranks of ``process_group``.

    Args:
        params: tensors or param-group dicts, as for any ``torch.optim`` optimizer.
        optimizer_class: the local optimizer's class (``torch.optim.Adam``, ...).
        process_group: defaults to the world.
        parameters_as_bucket_view: keep each rank's trainable parameters as views of
            one flat tensor, so the post-step broadcast is one collective per rank and
            device instead of one per parameter.
        overlap_with_ddp: run the step inside DDP's communication hook, bucket by
            bucket (register ``impl.zero.ddp_hooks.hook_with_zero_step`` or
            ``hook_with_zero_step_interleaved`` on the DDP model); needs a functional
            optimizer or a class with one (``Adam``, ``SGD``, ...); ``step()`` then does
            nothing, and the first two iterations (three with ``static_graph``) do not
            update the parameters. See impl/zero/overlap.py and docs/zero.md.
        **defaults: the local optimizer's keyword arguments (``lr``, ...).

    The local optimizer, holding only this rank's parameters, is ``self.optim``.
    """

    def __init__(
        self,
        params,
        optimizer_class: type[Optimizer],
        process_group: Any | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        **defaults: Any,
    ):
        params = materialize_params(params, "ZeroRedundancyOptimizer")
        self._overlap_with_ddp = bool(overlap_with_ddp)
        self._optim_constructor = optimizer_constructor(optimizer_class, self._overlap_with_ddp)
        self._optim_defaults = defaults
        # The base constructor calls add_param_group once per group; until the end of
        # __init__ that must only append (there is no partition or local optimizer yet).
        self._initialized = False
        Optimizer.__init__(self, params, defaults)
        Joinable.__init__(self)
        # Every parameter, in "group, then parameter" order: a plain list attribute, as in
        # PyTorch (code such as join hooks iterates ``zero._all_params``). Unlike PyTorch it
        # also gains the parameters of groups added later by ``add_param_group``.
        self._all_params: list[torch.Tensor] = index_to_param(self.param_groups)
        check_same_dense_type(self._all_params, "ZeroRedundancyOptimizer")

        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size: int = dist.get_world_size(self.process_group)
        self.rank: int = dist.get_rank(self.process_group)  # rank within the group
        self.global_rank: int = dist.get_global_rank(self.process_group, self.rank)  # for broadcast src
        # Buckets and object transport live here (the first parameter's device).
        self._default_device = self._all_params[0].device
        # Lazily derived views of the partition, all dropped together by _clear_cache.
        self._cache: dict[str, Any] = {}
        # requires_grad of every parameter at the last bucket build: a change means
        # frozen parameters must leave (or join) the buckets.
        self._is_trainable_mask = self._trainable_mask()

        if not self._overlap_with_ddp:
            self._init_local_optimizer()
        else:
            # The local optimizer waits for DDP's final buckets (_init_zero_for_overlap).
            self._overlap_info = OverlapInfo(self.world_size)
            if parameters_as_bucket_view:
                warnings.warn(
                    "`parameters_as_bucket_view=True` will be ignored since `overlap_with_ddp=True`; "
                    "instead, a different bucketing strategy will be used"
                )

        self.parameters_as_bucket_view = parameters_as_bucket_view
        # buckets[device_index][rank]: flat views of each rank's trainable parameters.
        self._buckets: list[list[torch.Tensor]] = []
        self._build_param_buckets()
        # Every rank's local state dict, filled only on the target of consolidate_state_dict.
        self._all_state_dicts: list[dict[str, Any]] = []
        self._initialized = True

    def _init_local_optimizer(self) -> None:
        """Build ``self.optim`` over this rank's partition. With overlap it is a
        functional optimizer over one flat parameter list (docs/behaviour.md §Z1.8)."""
        groups = self._partition_parameters()[self.rank]
        if not self._overlap_with_ddp:
            self.optim = self._optim_constructor(groups, **self._optim_defaults)
        else:
            if len(groups) != 1:
                raise AssertionError("Initializing the local functional optimizer with more than one parameter group")
            params = groups[0]["params"]
            kwargs = dict(self._optim_defaults)
            if "_allow_empty_param_list" in inspect.signature(self._optim_constructor).parameters:
                kwargs["_allow_empty_param_list"] = True  # a rank may own no bucket
            elif not params:
                warnings.warn(f"{self._optim_constructor} does not support `_allow_empty_param_list`; it may refuse an empty parameter list")
            self.optim = self._optim_constructor(params, **kwargs)
            if not hasattr(self.optim, "param_groups"):
                # Functional optimizers hold one ``param_group``.
                self.optim.param_groups = [self.optim.param_group]
        # The local class may add defaults of its own (betas, ...): make them public.
        sync_hyperparams(self.optim.param_groups, self.param_groups)

    # -- overlap_with_ddp (impl/zero/overlap.py, impl/zero/ddp_hooks.py) --------------

    def _init_zero_for_overlap(self) -> None:
        """The deferred initialization, run by the hook once DDP's buckets are known:
        the bucket assignment becomes the (manual) partition, every assignment gets its
        flat tensor, and the local functional optimizer is built."""
        if not self._overlap_with_ddp:
            raise AssertionError("`_init_zero_for_overlap()` should only be called when `overlap_with_ddp=True`")
        self._overlap_info.status = OverlapStatus.INITIALIZED
        self._clear_cache()
        assignments = self._bucket_assignments_per_rank
        self._partition_parameters(self._overlap_info.params_per_rank)
        build_assignment_tensors(assignments)
        self._init_local_optimizer()

    @property
    def _bucket_assignments_per_rank(self) -> list[dict[int, BucketAssignment]]:
        """``[rank][bucket index]``: the DDP bucket (parts) each rank steps."""
        if not self._overlap_with_ddp:
            raise AssertionError("`_bucket_assignments_per_rank` only be used if `overlap_with_ddp=True`")
        if "bucket_assignments" not in self._cache:
            if self._overlap_info.status is not OverlapStatus.INITIALIZED:
                raise AssertionError("the bucket assignment needs DDP's final buckets")
            self._cache["bucket_assignments"] = assign_buckets(self._overlap_info, self.rank)
        return self._cache["bucket_assignments"]

    def _check_overlap_initialized(self) -> None:
        if self._overlap_with_ddp and self._overlap_info.status is not OverlapStatus.INITIALIZED:
            raise RuntimeError("This method should not be called until this ZeroRedundancyOptimizer instance has been fully initialized")

    # -- partition and the maps derived from it ------------------------------------

    def _trainable_mask(self) -> list[bool]:
        return [p.requires_grad for p in self._all_params]

    def _clear_cache(self) -> None:
        self._cache.clear()

    def _partition_parameters(self, params_per_rank: list[list[torch.Tensor]] | None = None) -> list[list[dict]]:
        """``partition[rank]``: that rank's param groups (see impl/zero/partition.py).

        ``params_per_rank`` sets a manual partition; like torch this is only possible
        before the first partition, i.e. never after construction here.
        """
        if params_per_rank is not None:
            if "partition" in self._cache:
                raise AssertionError("Specifying `params_per_rank` should only be done when the parameters have not been partitioned yet")
            self._cache["partition"] = manual_partition(self.param_groups, params_per_rank, self.world_size)
        elif "partition" not in self._cache:
            self._cache["partition"] = sorted_greedy_partition(self.param_groups, self.world_size)
        return self._cache["partition"]

    partition_parameters = _partition_parameters

    @property
    def _param_to_rank(self) -> dict[torch.Tensor, int]:
        if "param_to_rank" not in self._cache:
            self._cache["param_to_rank"] = {
                p: rank for rank, groups in enumerate(self._partition_parameters()) for g in groups for p in g["params"]
            }
        return self._cache["param_to_rank"]

    @property
    def _param_to_index(self) -> dict[torch.Tensor, int]:
        if "param_to_index" not in self._cache:
            self._cache["param_to_index"] = global_index(self.param_groups)
        return self._cache["param_to_index"]

    @property
    def _index_to_param(self) -> list[torch.Tensor]:
        if "index_to_param" not in self._cache:
            self._cache["index_to_param"] = index_to_param(self.param_groups)
        return self._cache["index_to_param"]

    @property
    def _device_to_params_per_rank(self) -> dict[torch.device, list[list[torch.Tensor]]]:
        assert self.parameters_as_bucket_view, "only used with parameters_as_bucket_view=True"
        if "device_to_params" not in self._cache:
            params_per_rank = [[p for g in groups for p in g["params"]] for groups in self._partition_parameters()]
            self._cache["device_to_params"] = param_buckets.params_per_device(params_per_rank)
        return self._cache["device_to_params"]

    def rank_numels(self) -> list[int]:
        """Parameter elements owned (stepped) by each rank."""
        return rank_numels(self._partition_parameters())

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale this rank's partition's gradients so that the model's gradient norm is at
        most ``max_norm``; return that norm (a collective: [Note: a sharded norm] in
        impl/zero/clip.py). The other ranks' parameters' gradients are left alone: this
        rank does not step them."""
        grads = [p.grad for g in self.optim.param_groups for p in g["params"] if p.grad is not None]
        return clip_grad_norm_(grads, max_norm, group=self.process_group)

    def _build_param_buckets(self) -> None:
        if self.parameters_as_bucket_view and not self._overlap_with_ddp:
            self._buckets = param_buckets.build_bucket_views(self._device_to_params_per_rank)

    # -- step ---------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group on every rank (a collective in effect: all ranks must call it).

        Older groups keep their owners (the partition goes group by group), so the
        local optimizer only ever gains this rank's share of the new group.
        """
        if self._initialized and self._overlap_with_ddp:
            raise RuntimeError("ZeroRedundancyOptimizer with `overlap_with_ddp=True` only supports a single parameter group")
        super().add_param_group(param_group)
        if not self._initialized:
            return
        self._all_params.extend(self.param_groups[-1]["params"])
        self._clear_cache()
        local_groups = self._partition_parameters()[self.rank]
        if len(local_groups) == len(self.optim.param_groups) + 1:
            self.optim.add_param_group(local_groups[-1])
        self._build_param_buckets()
        self._is_trainable_mask = self._trainable_mask()

    def _local_step(
        self,
        gradients: list[torch.Tensor | None] | None = None,
        closure: Callable[[], float] | None = None,
        **kwargs: Any,
    ) -> float | None:
        """Step this rank's shard only; no communication. ``gradients`` (overlap only):
        one entry per local parameter, None for those not in the bucket being stepped."""
        Join.notify_join_context(self)
        mask = self._trainable_mask()
        if mask != self._is_trainable_mask:
            if self._overlap_with_ddp:
                raise RuntimeError(
                    "ZeroRedundancyOptimizer with `overlap_with_ddp=True` does not support changing parameter "
                    "trainability at run time"
                )
            warnings.warn("ZeroRedundancyOptimizer detected that the trainable parameters changed; rebuilding the parameter buckets if enabled")
            self._build_param_buckets()
            self._is_trainable_mask = mask
        # LR schedulers edit the public groups; the local optimizer must see it.
        sync_hyperparams(self.param_groups, self.optim.param_groups)
        if gradients is None:
            loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure=closure, **kwargs)
        else:
            if not self._overlap_with_ddp:
                raise AssertionError("Specifying `gradients` should not be used when `overlap_with_ddp=False`")
            if closure is not None:
                raise AssertionError("`closure` is not supported when using a local functional optimizer")
            loss = self.optim.step(gradients=gradients)
        sync_hyperparams(self.optim.param_groups, self.param_groups)
        return loss

    def _sync_params(self) -> None:
        """Every rank broadcasts the parameters it owns; all broadcasts in flight at once.

        Frozen parameters are broadcast too without bucket views (as torch does),
        and left out with them (they are not in any bucket).
        """
        handles = []
        for rank in range(self.world_size):
            src = dist.get_global_rank(self.process_group, rank)
            if self.parameters_as_bucket_view:
                tensors = [device_buckets[rank] for device_buckets in self._buckets]
            else:
                tensors = [p.data for g in self._partition_parameters()[rank] for p in g["params"]]
            handles.extend(comm.broadcast(t, src=src, group=self.process_group) for t in tensors)
        for handle in handles:
            handle.wait()

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Step this rank's parameters, then bring every rank's parameters up to date.
        With ``overlap_with_ddp`` the hook steps: this warns and returns None."""
        if self._overlap_with_ddp:
            warnings.warn("`step()` should not be included in the training loop when `overlap_with_ddp=True`")
            return None
        loss = self._local_step(closure=closure, **kwargs)
        self._sync_params()
        return loss

    # -- join -----------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Hook for ``torch.distributed.algorithms.Join``; ``kwargs`` are ignored."""
        return _StepOnJoin(self)

    @property
    def join_device(self) -> torch.device:
        return self._default_device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    # -- checkpointing ----------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collect every rank's local state on group rank ``to`` (a collective).

        The target keeps the local dicts on CPU; ``state_dict()`` there then builds the
        global dict. Other ranks drop any earlier consolidation.
        """
        self._check_overlap_initialized()
        sync_hyperparams(self.param_groups, self.optim.param_groups)
        self._all_state_dicts = []
        for rank in range(self.world_size):
            if rank == to:  # the target already holds its own state: nothing to send
                if self.rank == to:
                    self._all_state_dicts.append(copy_to_device(self.optim.state_dict(), torch.device("cpu")))
                continue
            is_src = self.rank == rank
            received = broadcast_object(
                self.optim.state_dict() if is_src else None,
                src=dist.get_global_rank(self.process_group, rank),
                is_src=is_src,
                group=self.process_group,
                device=self._default_device,
            )
            if self.rank == to:
                self._all_state_dicts.append(received)

    def state_dict(self) -> dict[str, Any]:
        """The global state dict as of the last ``consolidate_state_dict`` to this rank.

        Same format as a plain ``torch.optim`` optimizer over all parameters (global
        indices, sorted), so it loads there, or into this class at any world size.
        """
        self._check_overlap_initialized()
        if not self._all_state_dicts:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. "
                f"Please call `consolidate_state_dict(to={self.rank})` on all ranks beforehand "
                "if you meant to save the global state."
            )
        state_dict = super().state_dict()
        state_dict["state"].update(
            local_to_global_state(self._all_state_dicts, self._partition_parameters(), self._param_to_index)
        )
        state_dict["state"] = dict(sorted(state_dict["state"].items()))
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a global state dict: keep the entries this rank owns, and the hyperparameters.

        Unlike torch, the caller's dict is not modified, and the public ``self.state``
        does not keep a second copy of the owned state. See docs/zero.md.
        """
        self._check_overlap_initialized()
        check_param_groups_match(state_dict["param_groups"], self.param_groups)
        for index, value in state_dict["state"].items():
            param = self._index_to_param[index]
            if self._param_to_rank[param] != self.rank:
                continue
            local = copy_to_device(value, param.device)
            for name, item in local.items():
                if torch.is_tensor(item) and item.dim() == 0:
                    local[name] = item.cpu()  # scalar state (Adam's step) lives on CPU
            self.optim.state[param] = local
        sync_hyperparams(state_dict["param_groups"], self.param_groups)
        sync_hyperparams(self.param_groups, self.optim.param_groups)
