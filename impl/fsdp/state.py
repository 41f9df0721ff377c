"""What one FSDP instance knows (``FSDPState``) and what every instance under a root shares (``RootState``).

The constructor (fully_sharded.py) fills an ``FSDPState`` and keeps it on the module as
``_fsdp_state``; that attribute is also how traversal.py recognises an FSDP instance.
The hooks (runtime.py) and the utilities over a tree (utils.py, state_dict.py,
optim_state.py) read and update these objects rather than the module's attributes, so
none of them needs the module class. The module's public attributes of PyTorch 1.13
(``training_state``, ``sharding_strategy``, ...) are properties reading this state.

This module is a leaf of the package: it imports only the policies and the machinery
below the hooks (unit, rate limiter, execution order, streams), never the modules that
use it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from impl.fsdp.api import (
    DEFAULT_LIMITER_DEPTH,
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
    TrainingState,
)
from impl.fsdp.exec_order import ExecutionOrder
from impl.fsdp.rate_limiter import RateLimiter
from impl.fsdp.unit import FlatParamUnit
from impl.streams import Streams


@dataclass(eq=False)  # identity, not field equality: states are keys and list members
class FSDPState:
    """The state of one FSDP instance: its unit, the policies it applies, and where it is
    in the iteration. Built at construction; the root's lazy init fills the last group."""

    compute_device: torch.device
    """Where the unit's parameters live and compute (the root moves inputs here)."""
    sharding_strategy: ShardingStrategy
    """The effective strategy: NO_SHARD when the shard group has a single rank."""
    unit: FlatParamUnit | None = None
    """This instance's flat parameter and its collectives; None if it manages no parameter."""

    # -- policies, as given to the constructor --------------------------------------
    mixed_precision: MixedPrecision | None = None
    cpu_offload: CPUOffload = field(default_factory=CPUOffload)
    backward_prefetch: BackwardPrefetch | None = None
    forward_prefetch: bool = False
    limit_all_gathers: bool = False
    """Read from the root only, at lazy init: one limiter serves the whole tree."""
    limiter_depth: int = DEFAULT_LIMITER_DEPTH
    """As ``limit_all_gathers``: the root's value applies."""
    ignored_modules: set[nn.Module] = field(default_factory=set)
    """Modules whose parameters stay unmanaged, expanded over subtrees and nested instances."""
    ignored_params: set[int] = field(default_factory=set)
    """id() of every parameter left unmanaged (of ignored modules, or given in ``ignored_states``)."""
    use_orig_params: bool = False
    """Whether the original parameters stay the module's parameters ([Note: use_orig_params])."""
    full_precision_in_eval: bool = False
    """``FSDP_USE_FULL_PREC_IN_EVAL=1`` at construction: evaluation ignores mixed precision
    (unit.py, [Note: full precision in evaluation])."""
    device_mesh: Any = None
    """The DeviceMesh given to the constructor, if any (SHARDED state dicts are DTensors on it)."""

    # -- where the instance is in the iteration --------------------------------------
    training_state: TrainingState = TrainingState.IDLE
    """Checked by the hooks and utilities so that each runs only where it may."""
    ran_pre_backward: bool = False
    """Whether this backward already ran the pre-backward hook (one per instance and backward)."""
    grads_ready: int = 0
    """Parameters of the unit whose gradient has landed; post-backward runs when all have."""
    recomputing: bool = False
    """Between pre- and post-forward of a forward run inside backward (activation
    checkpointing's recomputation; runtime.py, [Note: recomputed forward])."""

    # -- set at the root's lazy init ---------------------------------------------------
    is_root: bool | None = None
    """Whether this instance is the root of its tree; None until lazy init."""
    root_state: RootState | None = None
    """What every instance under the root shares; None until lazy init."""

    # -- state dicts (state_dict.py) ----------------------------------------------------
    state_dict_type: StateDictType = StateDictType.FULL_STATE_DICT
    """What ``state_dict()`` returns; set with ``FSDP.state_dict_type``."""
    state_dict_config: Any = field(default_factory=FullStateDictConfig)
    """The config matching ``state_dict_type``."""
    optim_state_dict_config: Any = field(default_factory=FullOptimStateDictConfig)
    """The optimizer config matching ``state_dict_type`` (``FSDP.optim_state_dict`` reads it)."""
    load_summon: Any = None
    """While a plain parent's ``load_state_dict`` walks this instance: the summon context
    its load pre-hook entered and its post-hook leaves (state_dict.py)."""
    original_buffer_dtypes: dict[tuple[int, str], torch.dtype] = field(default_factory=dict)
    """(id(module), buffer name) -> dtype before mixed precision cast it: FULL state dicts
    save buffers in their original dtype."""
    cast_buffers: list[tuple[nn.Module, str]] = field(default_factory=list)
    """The (module, buffer name) pairs mixed precision cast, to cast back and forth for
    full-precision evaluation ([Note: full precision in evaluation])."""


class RootState:
    """What every FSDP instance under one root shares, created at the root's lazy init."""

    def __init__(self, states: list[FSDPState], limiter: RateLimiter, streams: Streams):
        # Every instance in the tree, root first: end of backward visits each of them.
        self.states = states
        # One limiter for the tree, so that its bound counts every unit's gathers.
        self.limiter = limiter
        # Compute/unshard/post-backward streams of the units' device. See [Note: streams].
        self.streams = streams
        # Recorded unit order: prefetch targets and the first-iteration order check.
        self.exec_order = ExecutionOrder()
        # Reductions in flight, oldest first. See [Note: reductions in flight] (runtime.py).
        self.pending_reductions: deque = deque()
        # CPU offload: (unit, pinned host shard) whose copies are queued, read at the end
        # of backward. See [Note: offloaded gradients] (runtime.py).
        self.offloaded_reductions: list = []
        # False inside no_sync(): gradients accumulate unsharded and are not reduced.
        self.sync_gradients = True
        # Whether this backward's end-of-backward callback is already queued.
        self.end_of_backward_queued = False
