"""A reference FSDP (ZeRO stage 3) with PyTorch 2.x FSDP1's API, on CPU/gloo and CUDA/NCCL.

Read in this order: api.py (policies), flat_param.py (one flat parameter's tensors),
orig_params.py (use_orig_params: the original parameters as views of the shard),
collectives.py (the collectives), unit.py (unshard / wait_for_unshard / reshard),
rate_limiter.py ([Note: rate limiter]), exec_order.py (prefetch order and its check),
state.py (what each instance and each root's tree keep), traversal.py (finding the
instances of a tree), runtime.py (the hooks), fully_sharded.py (the constructor),
wrap.py, utils.py, state_dict.py, optim_state.py. docs/fsdp.md explains how they fit
together.
"""

from impl.fsdp.api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    TrainingState,
)
from impl.fsdp.flat_param import ShardedState
from impl.fsdp.fully_sharded import FullyShardedDataParallel
from impl.fsdp.optim_state import (
    flatten_sharded_optim_state_dict,
    full_optim_state_dict,
    rekey_optim_state_dict,
    scatter_full_optim_state_dict,
    shard_full_optim_state_dict,
    sharded_optim_state_dict,
)
from impl.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

__all__ = [
    "FullyShardedDataParallel",
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "TrainingState",
    "StateDictType",
    "FullStateDictConfig",
    "LocalStateDictConfig",
    "ShardedStateDictConfig",
    "StateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "StateDictSettings",
    "OptimStateKeyType",
    "full_optim_state_dict",
    "sharded_optim_state_dict",
    "shard_full_optim_state_dict",
    "flatten_sharded_optim_state_dict",
    "scatter_full_optim_state_dict",
    "rekey_optim_state_dict",
    "ShardedState",
    "ModuleWrapPolicy",
    "CustomPolicy",
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
]
