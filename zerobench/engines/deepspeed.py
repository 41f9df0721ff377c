"""DeepSpeed ZeRO stages 1, 2 and 3 (``deepspeed.initialize``), one engine per stage.

``deepspeed-zero1`` shards the optimizer state, ``deepspeed-zero2`` the gradients too,
``deepspeed-zero3`` the parameters too (Rajbhandari et al., arXiv 1910.02054). They need
the optional extra ``deepspeed`` (``pip install -e '.[deepspeed]'``); without it they
are listed as unavailable and their cells are skipped, saying so (:func:`deepspeed_unavailable`).

The knobs users tune are matrix axes, named as in DeepSpeed's ``zero_optimization``
section (https://www.deepspeed.ai/docs/config-json/#zero-optimizations-for-fp16-training)
and with DeepSpeed's defaults; each engine declares only the knobs its stage reads
(``allgather_bucket_size`` is stages 1 and 2, the ``stage3_*`` knobs stage 3). What
DeepSpeed ignores on this device is said in the cell's ``note`` (:meth:`notes`).

[Note: DeepSpeed under the harness]
Every cell is run as the other engines' are: the worker's process group, model, batches
and measurements. What it takes to hand those to DeepSpeed 0.19.8:

* Process group: the worker has already initialised torch.distributed (torchrun's
  environment, gloo or NCCL). ``deepspeed.init_distributed(dist_init_required=False)``
  then only builds DeepSpeed's communication backend over it (its ``TorchBackend``).
  DeepSpeed refuses to start without ``LOCAL_RANK`` in the environment (its launcher and
  torchrun set it); ``LOCAL_RANK``, ``RANK`` and ``WORLD_SIZE`` are set from the
  RankContext (:func:`deepspeed_environment`: ``LOCAL_RANK`` is the rank's GPU index,
  which DeepSpeed sets as its device).
* Collectives: ``TorchBackend`` keeps the functions ``torch.distributed.
  all_gather_into_tensor`` and ``reduce_scatter_tensor`` it found when it was built
  (``all_gather_function``, ``reduce_scatter_function``) and calls those for ZeRO's
  parameter all-gathers and ZeRO-3's gradient reduce-scatters. The harness intercepts
  collectives by replacing ``torch.distributed``'s attributes (the emulated link, the
  virtual GPU), possibly after DeepSpeed started: the kept functions would go past it.
  :func:`route_through_torch_distributed` replaces the two with functions that look
  the attribute up at each call (checked on 0.19.8). Every other collective ZeRO
  issues (all-reduce of gradient buckets and norms, broadcast) is looked up at call time
  already (``deepspeed/comm/torch.py``).
* Device: the harness builds the model on the rank's device already, so DeepSpeed's own
  ``module.to(device)`` moves nothing; on fake tensors (estimate, predict) it fails
  ("Couldn't swap Linear.weight"). ``DeepSpeedEngine`` takes ``dont_change_device`` but
  ``deepspeed.initialize`` does not pass it on: :func:`_keeping_the_device` sets it for
  the engine ``initialize`` builds (checked on 0.19.8). On the virtual GPU, DeepSpeed's
  accelerator is zerobench/engines/deepspeed_vgpu.py's, so ZeRO takes its CUDA path.
* Memory roles: ZeRO-3 gathers several parameters with one all-gather into a flat
  buffer (an all-gather output: "unsharded" to the memory pass), then, in
  ``AllGatherCoalescedHandle.wait``, copies each parameter out of it (``torch.cat`` of
  its slices). Those copies are unsharded parameters too, but no collective or phase
  says so: :func:`label_gathered_copies` runs that ``wait`` inside
  ``memory.allocated_as("unsharded")`` (and the virtual GPU's ``label("unsharded")``).
  It changes no behaviour (checked on 0.19.8).
  Where the other tensors live: [Note: DeepSpeed's tensors by role].
* Optimizer: the workload's torch optimizer is handed to ``deepspeed.initialize``, so
  the update is the one every other engine and the single-process reference make
  (``zero_allow_untested_optimizer``: ZeRO refuses torch's SGD without it).
* dtype: ``bf16`` is DeepSpeed's ``bf16`` section: the module's parameters and
  gradients become bf16, the optimizer steps an fp32 master copy of its partition.
  Floating-point inputs are cast to bf16 here, as DeepSpeed users' scripts do
  (``DeepSpeedEngine.forward`` does not cast them). ``fp32`` leaves everything fp32.
* Activation checkpointing: applied to the model before ``wrap`` like for every engine
  (zerobench/spec/checkpointing.py); DeepSpeed's own ``activation_checkpointing``
  section is not used.
* Gradient accumulation: one micro-batch per step (``gradient_accumulation_steps = 1``),
  as in every engine: the matrix has no accumulation axis. ``train_micro_batch_size_per_gpu``
  is required by DeepSpeed but only feeds its data loader and logs, neither used here.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import logging
import os
import re
from typing import Any, ClassVar

import torch

from zerobench.engines.base import Engine
from zerobench.engines.options import Axis, DeepSpeedZero3Options, DeepSpeedZero12Options
from zerobench.instruments.memory import allocated_as
from zerobench.instruments.vgpu import device as vgpu

#: DeepSpeed versions the engines were tested with: [first, last) (pyproject's extra says the same)
TESTED_VERSIONS = ("0.19.8", "0.20")
INSTALL = "pip install -e '.[deepspeed]'"
BUILD_NEEDS = "its first start compiles a C++ op (deepspeed_shm_comm) with g++ and ninja"


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def deepspeed_unavailable() -> str | None:
    """Why the DeepSpeed engines cannot run in this environment, or None.

    Reads the installed distribution's metadata only: no ``import deepspeed`` (seconds,
    and a log line) just to list the engines."""
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return f"DeepSpeed is not installed: {INSTALL} ({BUILD_NEEDS})"
    first, end = TESTED_VERSIONS
    if not _version_tuple(first) <= _version_tuple(version) < _version_tuple(end):
        return (f"DeepSpeed {version} is installed; these engines are tested with >={first},<{end} "
                f"(pip install 'deepspeed>={first},<{end}')")
    return None


#: DeepSpeed's zero_optimization knobs besides overlap_comm (declared with DeepSpeed
#: 0.19.8's defaults in zerobench/engines/options.py), of any stage.
KNOBS: dict[str, Axis] = {k: v for cls in (DeepSpeedZero12Options, DeepSpeedZero3Options)
                          for k, v in cls.axes().items() if k != "overlap_comm"}


def ds_config(stage: int, options: dict[str, Any], dtype: str, max_grad_norm: float = 0.0) -> dict[str, Any]:
    """The DeepSpeed config dict of one cell: the stage, the cell's knobs, the dtype, and
    ``gradient_clipping`` (the workload's optimizer.max_grad_norm; 0: none)."""
    zero = {"stage": stage}
    zero.update({k: v for k, v in options.items() if k == "overlap_comm" or k in KNOBS})
    config = {
        "train_micro_batch_size_per_gpu": 1,  # see [Note: DeepSpeed under the harness]
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": float(max_grad_norm),
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def route_through_torch_distributed(backend) -> None:
    """Make DeepSpeed's ``TorchBackend`` look up its all-gather and reduce-scatter in
    ``torch.distributed`` at each call, so that whatever wraps those attributes sees them.
    See [Note: DeepSpeed under the harness]; checked on DeepSpeed 0.19.8."""

    def all_gather_into_tensor(*args, **kwargs):
        return torch.distributed.all_gather_into_tensor(*args, **kwargs)

    def reduce_scatter_tensor(*args, **kwargs):
        return torch.distributed.reduce_scatter_tensor(*args, **kwargs)

    backend.all_gather_function = all_gather_into_tensor
    backend.reduce_scatter_function = reduce_scatter_tensor


def label_gathered_copies() -> None:
    """Run ZeRO-3's ``AllGatherCoalescedHandle.wait`` inside ``allocated_as("unsharded")``
    (once per process). See [Note: DeepSpeed under the harness]; checked on 0.19.8."""
    from deepspeed.runtime.zero.partition_parameters import AllGatherCoalescedHandle

    wait = AllGatherCoalescedHandle.wait
    if getattr(wait, "__zerobench_labelled__", False):
        return

    @functools.wraps(wait)
    def labelled_wait(self, *args, **kwargs):
        gpu = vgpu.current()
        with allocated_as("unsharded"), (gpu.label("unsharded") if gpu is not None else contextlib.nullcontext()):
            return wait(self, *args, **kwargs)

    labelled_wait.__zerobench_labelled__ = True
    AllGatherCoalescedHandle.wait = labelled_wait


class DeepSpeedZeroEngine(Engine):
    """One ZeRO stage of DeepSpeed. See [Note: DeepSpeed under the harness]."""

    stage: ClassVar[int]

    @classmethod
    def unavailable(cls):
        return deepspeed_unavailable()

    @classmethod
    def unsupported(cls, options, dtype, world_size, device_type):
        size = options.get("allgather_bucket_size")
        if size is not None and size % 2:
            # DeepSpeedZeroOptimizer asserts it (4-byte alignment of 2-byte elements)
            return f"{cls.name}: allgather_bucket_size {size} is not allowed (allowed: an even int >= 2)"
        return super().unsupported(options, dtype, world_size, device_type)

    @classmethod
    def notes(cls, options, dtype, world_size, device_type, optimizer=None):
        """What DeepSpeed 0.19.8 ignores of the cell (measured: tests/test_deepspeed_engines.py),
        and what it does that reads as a bug ([Note: say what surprises] in base.py)."""
        out = [note for note in [super().notes(options, dtype, world_size, device_type, optimizer)] if note]
        if device_type == "cpu" and options.get("overlap_comm"):
            out.append("overlap_comm: no side stream on CPU (a synchronous device), no overlap"
                       + ("; its second bucket is still allocated" if cls.stage < 3 else ""))
        default = KNOBS["allgather_bucket_size"].default
        if options.get("allgather_bucket_size", default) != default:
            out.append("allgather_bucket_size: unused (one all_gather_into_tensor per parameter group)")
        bucket = options.get("reduce_bucket_size", KNOBS["reduce_bucket_size"].default)
        itemsize = 2 if dtype == "bf16" else 4  # the gradients' dtype: bf16 under DeepSpeed's bf16
        out.append(f"reduce_bucket_size {bucket:,}: DeepSpeed allocates the gradient bucket whole "
                   f"({bucket * itemsize / 2**30:.2f} GiB in {dtype}) whatever the model's size, which can put a "
                   f"small model's peak above DDP's; a smaller reduce_bucket_size lowers it")
        return "; ".join(out) or None

    def wrap(self, model, blocks):
        """The bare model; ``deepspeed.initialize`` needs the optimizer too, so it runs in
        :meth:`build_optimizer`. ``blocks`` are not needed: ZeRO-3 gathers each submodule's
        parameters by hooks, whatever the module structure."""
        self.module = model
        return model

    def build_optimizer(self, spec):
        deepspeed = _start_deepspeed(self.ctx)
        model = self.module
        optimizer = spec.build(model.parameters())
        config = ds_config(self.stage, self.opts, self.dtype, self.max_grad_norm)
        with _keeping_the_device():
            self.module, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                                     config=config, dist_init_required=False)
        return self.optimizer

    def clip_every_step(self):
        """Nothing to add: DeepSpeed clips in its own step (``gradient_clipping`` in its config)."""

    def train_step(self, inputs, targets, loss_fn):
        if self.dtype == "bf16" and inputs.is_floating_point():
            inputs = inputs.to(torch.bfloat16)
        with self.phase("forward"):
            loss = loss_fn(self.module(inputs), targets)
        with self.phase("backward"):
            self.module.backward(loss)
        with self.phase("optimizer"):
            self.module.step()  # zeroes the gradients too
        return loss.detach().float()

    # -- what the memory pass tells apart: [Note: DeepSpeed's tensors by role] ------

    def parameter_tensors(self):
        params = list(self.module.module.parameters())
        # ZeRO-3: each parameter's partition, and the whole of those it never shards
        # (stage3_param_persistence_threshold); stages 1-2: the parameters themselves
        persistent = [p.data for p in params if getattr(p, "ds_persist", False)]
        return _tensors(self.optimizer, _PARAMS[self.stage]) + [getattr(p, "ds_tensor", p) for p in params] + persistent

    def gradient_tensors(self):
        full = [p.grad for p in self.module.module.parameters() if p.grad is not None]
        return full + _tensors(self.optimizer, _GRADS[self.stage])

    def optimizer_state_tensors(self):
        inner = self.optimizer.optimizer  # the workload's torch optimizer, stepping the fp32 partitions
        state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
        return state + _tensors(self.optimizer, _MASTER[self.stage])


class DeepSpeedZero1Engine(DeepSpeedZeroEngine):
    name = "deepspeed-zero1"
    stage = 1
    Options = DeepSpeedZero12Options


class DeepSpeedZero2Engine(DeepSpeedZeroEngine):
    name = "deepspeed-zero2"
    stage = 2
    Options = DeepSpeedZero12Options


class DeepSpeedZero3Engine(DeepSpeedZeroEngine):
    name = "deepspeed-zero3"
    stage = 3
    Options = DeepSpeedZero3Options  # overlap_comm on by default: DeepSpeed's, for stage 3 only


# [Note: DeepSpeed's tensors by role]
# Where each stage of DeepSpeed 0.19.8 keeps what the memory pass classifies (the
# attributes of DeepSpeedZeroOptimizer, stages 1-2, and DeepSpeedZeroOptimizer_Stage3):
# * parameters: the flat buffers the module's parameters are views of
#   (``bit16_groups_flat``), or under stage 3 this rank's partitions
#   (``fp16_partitioned_groups_flat``, of which each ``param.ds_tensor`` is a view) and
#   the whole parameters it never shards (``param.ds_persist``);
# * gradients: the reduced partition (``averaged_gradients``; stage 2's
#   ``grads_in_partition``, sized to the whole parameters overlapping the partition;
#   stage 3's ``grad_partitions_flat_buffer``) and the full ``param.grad`` not reduced
#   yet (stage 1 without overlap_comm reduces them all at the end of backward);
# * optimizer state: the torch optimizer's state and the fp32 master partition it steps
#   (``single_partition_of_fp32_groups``; stage 3's ``fp32_partitioned_groups_flat``).
#   Every stage keeps that master as a copy of its parameter partition, in fp32 cells
#   too (measured: Adam's optimizer state is 3x the partition's fp32 bytes, not 2x), as
#   the ZeRO paper counts it (K = 12 bytes per parameter with Adam);
# * the gradient buckets (``ipg_buckets``, stage 3's ``ipg_buckets`` flat buffers) are
#   communication buffers and stay "other", as DDP's buckets do; stage 3's unsharded
#   parameters are all-gather outputs, "unsharded".
_PARAMS = {1: ("bit16_groups_flat",), 2: ("bit16_groups_flat",), 3: ("fp16_partitioned_groups_flat",)}
_GRADS = {1: ("averaged_gradients", "grads_in_partition"), 2: ("averaged_gradients", "grads_in_partition"),
          3: ("averaged_gradients", "grad_partitions_flat_buffer")}
_MASTER = {1: ("single_partition_of_fp32_groups",), 2: ("single_partition_of_fp32_groups",),
           3: ("fp32_partitioned_groups_flat",)}


def _tensors(owner, names) -> list[torch.Tensor]:
    """Every tensor held by ``owner``'s attributes ``names`` (tensors, or lists and dicts of them)."""
    out = []

    def visit(value):
        if torch.is_tensor(value):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)

    for name in names:
        visit(getattr(owner, name, None))
    return out


@contextlib.contextmanager
def _keeping_the_device():
    """``deepspeed.initialize`` inside: the engine it builds leaves the module where it is
    (``dont_change_device``). See [Note: DeepSpeed under the harness]; checked on 0.19.8."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    init = DeepSpeedEngine.__init__

    @functools.wraps(init)
    def keeping(self, *args, **kwargs):
        kwargs["dont_change_device"] = True
        init(self, *args, **kwargs)

    DeepSpeedEngine.__init__ = keeping
    try:
        yield
    finally:
        DeepSpeedEngine.__init__ = init


#: the default process group DeepSpeed last started on, while it lives (see _forget_an_earlier_world)
_started_on = None


def _forget_an_earlier_world() -> None:
    """Drop the process groups DeepSpeed keeps (``deepspeed.utils.groups``: its clone of
    WORLD, data-parallel groups) when the default group is not the one it started on:
    ``zerobench predict`` and ``estimate`` run one fake world per world size in one
    process, each destroyed by ``torch.distributed``, which DeepSpeed does not hear of.
    It is what ``deepspeed.comm.destroy_process_group`` does after a WORLD teardown
    (checked on 0.19.8)."""
    global _started_on
    import weakref

    from deepspeed.utils import groups

    default = torch.distributed.distributed_c10d._get_default_group()
    if _started_on is not None and _started_on() is not default:
        groups._release_process_group_references(group=None)
    _started_on = weakref.ref(default)


def deepspeed_environment(ctx) -> dict[str, str]:
    """What DeepSpeed is told through the environment: ``RANK``, ``WORLD_SIZE`` and
    ``LOCAL_RANK`` from the RankContext (torchrun's values under torchrun; a fake world's,
    one per world size in a process, otherwise).

    DeepSpeed reads ``LOCAL_RANK`` as the index of its GPU (``DeepSpeedEngine`` calls
    ``set_device(LOCAL_RANK)``, ZeRO-3 puts its parameters on ``cuda:LOCAL_RANK``), so on
    a GPU it is the rank's device index, not its place on the node: the two differ where
    ranks share GPUs (``ZEROBENCH_CUDA_SHARED_BACKEND=gloo``: rank r on ``cuda:(r % count)``)
    and under Slurm's ``--gpus-per-task`` (every rank on its own ``cuda:0``)."""
    local = ctx.device.index if ctx.device.type == "cuda" and ctx.device.index is not None else ctx.local_rank
    return {"LOCAL_RANK": str(local), "RANK": str(ctx.rank), "WORLD_SIZE": str(ctx.world_size)}


@contextlib.contextmanager
def torch_as_found():
    """Inside, what DeepSpeed changes of torch for the life of its process is put back on
    leaving: 0.19.8's ZeRO-3 replaces ``torch.nn.functional.linear`` with its own
    (``zero3_linear_wrap``) when an engine is built, and leaves it. A process that runs
    other programs after a ZeRO-3 cell (predict's jobs, calibrate's host programs) would
    run theirs: a plain MLP's step then dispatched 144 operators instead of 175."""
    import torch.nn.functional as F

    linear = F.linear
    try:
        yield
    finally:
        F.linear = linear


def _start_deepspeed(ctx):
    """Import DeepSpeed and build its communication backend over the worker's process
    group (see [Note: DeepSpeed under the harness])."""
    os.environ.update(deepspeed_environment(ctx))
    if ctx.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # chosen, not guessed: no "Setting accelerator" warning
    import deepspeed
    import deepspeed.comm.comm as ds_comm

    from zerobench.engines import deepspeed_vgpu

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed_vgpu.install()  # before DeepSpeed builds anything
    _forget_an_earlier_world()
    deepspeed.init_distributed(dist_backend=ctx.backend, dist_init_required=False, verbose=False)
    route_through_torch_distributed(ds_comm.cdb)
    label_gathered_copies()
    return deepspeed
