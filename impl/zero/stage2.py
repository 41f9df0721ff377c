"""ZeRO stage 2: ``impl.zero.ZeroStage2Optimizer``, optimizer state *and* gradients sharded.

As in ZeRO (arXiv 1910.02054) stage 2, "P_os+g". Usage, with no DDP wrapper::

    opt = ZeroStage2Optimizer(model.parameters(), torch.optim.Adam, bucket_cap_mb=25, lr=1e-3)
    for micro_batch in micro_batches[:-1]:
        with opt.no_sync():                      # accumulate locally, no communication
            loss_fn(model(micro_batch)).backward()
    loss_fn(model(micro_batches[-1])).backward() # gradients reduce-scattered during backward
    opt.step()                                   # step the shard, all-gather parameters
    opt.zero_grad()

Constructing the optimizer registers a post-accumulate-grad hook on every trainable
parameter. Parameters must be equal on all ranks before the first step (broadcast
them, as DDP's constructor does). See [Note: stage-2 layout].

[Note: stage-2 layout]
Each parameter is split into ``world_size`` equal chunks (padded); rank ``r`` owns
chunk ``r`` of *every* parameter (sharded_param.py). When a parameter's gradient is
ready in backward, its hook hands the ``world_size`` chunks to the
:class:`ReduceScatterBucketer`, which batches small gradients into buckets of
``bucket_cap_mb`` and sends large ones alone, all asynchronously, so the reduction
overlaps the rest of backward. The full gradient is dropped at once (``p.grad =
None``); the reduced chunk lands as the ``.grad`` of the shard view. At the end of
backward (an autograd engine callback) the bucketer is flushed. The local optimizer
steps the shard views in place — they alias the parameters, so no master copy — and
``step`` then all-gathers every parameter in buckets of ``bucket_cap_mb``.

Why per-parameter chunks rather than one flat buffer cut into ``world_size`` slices,
or whole-parameter ownership as in stage 1: every rank's load is ``1/world_size`` of
every parameter, whatever the sizes (one parameter larger than all the others
together is still split evenly); the reduction is a true reduce-scatter; and a shard
never spans two param groups, so per-group hyperparameters, LR schedulers and a
per-parameter state dict work as in ``torch.optim``. The cost is up to
``world_size - 1`` padding elements per parameter.

Per rank, in steady state: full parameters, ``1/world_size`` of the gradients (plus
the bucket buffers in flight) and ``1/world_size`` of the optimizer state. Under
``no_sync`` the accumulated gradients are full-size until the synchronizing backward,
as in FSDP and fairscale.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from impl import comm
from impl.zero.bucketer import ReduceScatterBucketer
from impl.zero.clip import clip_grad_norm_
from impl.zero.sharded_param import ShardedParam
from impl.zero.state_dict import (
    check_param_groups_match,
    index_to_param,
    sync_hyperparams,
)
from impl.zero.transport import copy_to_device
from impl.zero.validation import (
    check_optimizer_class,
    check_same_dense_type,
    materialize_params,
)


def plan_gather_buckets(shards: list[ShardedParam], bucket_cap_mb: float) -> list[list[ShardedParam]]:
    """Consecutive runs of shards whose all-gather output fits ``bucket_cap_mb`` (at least one each)."""
    cap_bytes = bucket_cap_mb * 2**20
    buckets: list[list[ShardedParam]] = []
    current, current_bytes = [], 0
    for shard in shards:
        nbytes = shard.world_size * shard.chunk_numel * shard.param.element_size()
        if current and current_bytes + nbytes > cap_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(shard)
        current_bytes += nbytes
    if current:
        buckets.append(current)
    return buckets


class ZeroStage2Optimizer(Optimizer):
    """Shard ``optimizer_class``'s state and the gradients over ``process_group``.

    Args:
        params: tensors or param-group dicts. Trainable ones must be contiguous.
        optimizer_class: the local optimizer's class; it must keep elementwise state
            (SGD, Adam, AdamW, ...), since it steps 1-D shards.
        process_group: defaults to the world.
        bucket_cap_mb: reduce-scatter bucket size (0 sends every gradient alone), also
            the all-gather bucket size after the step.
        max_in_flight: reduce-scatters allowed in flight at once (see bucketer.py).
        **defaults: the local optimizer's keyword arguments.

    Public ``param_groups`` hold the original parameters (schedulers edit them);
    ``self.optim`` holds the shard views. Trainability is fixed at construction and
    ``add_param_group`` after construction is not supported.
    """

    def __init__(
        self,
        params,
        optimizer_class: type[Optimizer],
        process_group: Any | None = None,
        bucket_cap_mb: float = 25.0,
        max_in_flight: int = 2,
        **defaults: Any,
    ):
        params = materialize_params(params, "ZeroStage2Optimizer")
        check_optimizer_class(optimizer_class)
        self._initialized = False
        Optimizer.__init__(self, params, defaults)
        check_same_dense_type(index_to_param(self.param_groups), "ZeroStage2Optimizer")
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size: int = dist.get_world_size(self.process_group)
        self.rank: int = dist.get_rank(self.process_group)
        self.bucket_cap_mb = bucket_cap_mb

        # One ShardedParam per parameter trainable at construction, in global order.
        self._shards: dict[torch.Tensor, ShardedParam] = {
            p: ShardedParam(p, self.rank, self.world_size) for p in index_to_param(self.param_groups) if p.requires_grad
        }
        local_groups = [{**g, "params": [self._shards[p].sharded for p in g["params"] if p in self._shards]} for g in self.param_groups]
        self.optim: Optimizer = optimizer_class(local_groups, **defaults)
        sync_hyperparams(self.optim.param_groups, self.param_groups)

        # A reduce-scatter bucket is allocated whole, (world_size, cap / world_size), when its
        # first gradient arrives. It never needs to be larger than every gradient it could
        # hold: with the default 25 MB and a 5 MB model that would be 20 MB of nothing at the
        # peak (measured: the step's peak was 1.57x DDP's before this clamp).
        gradient_mb = sum(s.chunk_numel * self.world_size * s.param.element_size()
                          for s in self._shards.values()) / 2**20
        # one byte more than the gradients: a tensor is buffered only if strictly under the cap
        self.bucketer = ReduceScatterBucketer(min(bucket_cap_mb, gradient_mb + 2**-20), max_in_flight)
        self._gather_buckets = plan_gather_buckets(list(self._shards.values()), bucket_cap_mb)
        # False inside no_sync(): gradients then accumulate, full-size, in p.grad.
        self._sync_gradients = True
        # Whether this backward already queued its end-of-backward flush.
        self._flush_queued = False
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._shards]
        # Consolidated global state (global index -> state), only on the target rank.
        self._consolidated: dict[int, Any] | None = None
        self._initialized = True

    # -- backward: gradients reduce-scattered as they become ready ---------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate into full ``p.grad`` without communicating; the
        next backward outside reduce-scatters the sum."""
        previous, self._sync_gradients = self._sync_gradients, False
        try:
            yield
        finally:
            self._sync_gradients = previous

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync_gradients:
            return
        if not self._flush_queued:
            self._flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        shard = self._shards[param]
        grad, param.grad = param.grad, None  # the full gradient is not kept: see [Note: stage-2 layout]
        self.bucketer.reduce_scatter_async(
            shard.reduce_scatter_inputs(grad), group=self.process_group, callback_fn=shard.accumulate_reduced
        )

    def _on_backward_end(self) -> None:
        self._flush_queued = False
        self.bucketer.flush()

    def rank_numels(self) -> list[int]:
        """Parameter elements each rank steps (its chunks, without padding)."""
        numels = [0] * self.world_size
        for shard in self._shards.values():
            for rank in range(self.world_size):
                start = min(rank * shard.chunk_numel, shard.numel)
                numels[rank] += min(start + shard.chunk_numel, shard.numel) - start
        return numels

    def gradient_shards(self) -> list[torch.Tensor]:
        """This rank's reduced gradient shards (views of the reduce-scatter outputs)."""
        return [s.sharded.grad for s in self._shards.values() if s.sharded.grad is not None]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale this rank's reduced gradient shards so that the model's gradient norm is at
        most ``max_norm``; return that norm (a collective: [Note: a sharded norm] in
        impl/zero/clip.py). Call it after backward, before :meth:`step`."""
        self.bucketer.flush()  # normally a no-op: the end of backward flushed already
        return clip_grad_norm_(self.gradient_shards(), max_norm, group=self.process_group)

    def remove_hooks(self) -> None:
        """Detach from the parameters (the optimizer is unusable afterwards)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    # -- step ----------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._initialized:
            raise NotImplementedError("ZeroStage2Optimizer does not support add_param_group after construction")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)  # full grads left by no_sync
        self.optim.zero_grad(set_to_none=set_to_none)  # the gradient shards

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Step this rank's shards, then all-gather every parameter."""
        self.bucketer.flush()  # normally a no-op: the end of backward flushed already
        sync_hyperparams(self.param_groups, self.optim.param_groups)
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure=closure, **kwargs)
        sync_hyperparams(self.optim.param_groups, self.param_groups)
        self._all_gather_params()
        return loss

    @torch.no_grad()
    def _all_gather_params(self) -> None:
        """One all-gather per bucket; the next bucket is issued before the current one is
        unpacked, so at most two all-gather outputs exist at once."""
        pending = None
        for bucket in [*self._gather_buckets, None]:
            started = self._start_gather(bucket) if bucket is not None else None
            if pending is not None:
                self._finish_gather(*pending)
            pending = started

    def _start_gather(self, bucket: list[ShardedParam]):
        widths = [s.chunk_numel for s in bucket]
        first = bucket[0].param
        all_gather_input = torch.empty(sum(widths), dtype=first.dtype, device=first.device)  # 1D, this rank's chunks
        for shard, chunk in zip(bucket, all_gather_input.split(widths)):
            shard.write_all_gather_input(chunk)
        all_gather_output = all_gather_input.new_empty(self.world_size * all_gather_input.numel())  # 1D, rank-major
        handle = comm.all_gather(all_gather_output, all_gather_input, group=self.process_group)
        return bucket, widths, all_gather_output, handle

    @staticmethod
    def _finish_gather(bucket, widths, all_gather_output, handle) -> None:
        handle.wait()
        per_rank = all_gather_output.view(-1, sum(widths))  # 2D, world_size x sum(widths)
        for shard, chunks in zip(bucket, per_rank.split(widths, dim=1)):
            shard.read_all_gather_output(chunks)

    # -- checkpointing: same protocol as stage 1 ----------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """All-gather every state shard; group rank ``to`` keeps the full state (a collective)."""
        sync_hyperparams(self.param_groups, self.optim.param_groups)
        consolidated: dict[int, Any] = {}
        for index, param in enumerate(index_to_param(self.param_groups)):
            shard = self._shards.get(param)
            state = self.optim.state.get(shard.sharded) if shard is not None else None
            if not state:  # the same on every rank: a shard is stepped iff its parameter got a gradient
                continue
            full = {}
            for name, value in state.items():  # same order on every rank
                if torch.is_tensor(value) and value.dim() > 0:
                    full[name] = shard.gather_full(value, self.process_group)
                else:
                    full[name] = value
            if self.rank == to:
                consolidated[index] = copy_to_device(full, torch.device("cpu"))
        self._consolidated = consolidated if self.rank == to else None

    def state_dict(self) -> dict[str, Any]:
        """Global state dict (plain ``torch.optim`` format) as of the last consolidation here."""
        if self._consolidated is None:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. "
                f"Please call `consolidate_state_dict(to={self.rank})` on all ranks beforehand "
                "if you meant to save the global state."
            )
        state_dict = super().state_dict()
        state_dict["state"] = dict(sorted({**state_dict["state"], **self._consolidated}.items()))
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a global state dict (from any world size, or a plain ``torch.optim``)."""
        check_param_groups_match(state_dict["param_groups"], self.param_groups)
        params = index_to_param(self.param_groups)
        for index, value in state_dict["state"].items():
            shard = self._shards.get(params[index])
            if shard is None:
                continue  # frozen at construction: never stepped here
            local = {}
            for name, item in value.items():
                if torch.is_tensor(item) and item.dim() > 0:
                    local[name] = shard.shard_of(item)
                elif torch.is_tensor(item):
                    local[name] = item.detach().to("cpu", copy=True)  # scalar state lives on CPU
                else:
                    local[name] = item
            self.optim.state[shard.sharded] = local
        sync_hyperparams(state_dict["param_groups"], self.param_groups)
        sync_hyperparams(self.param_groups, self.optim.param_groups)
