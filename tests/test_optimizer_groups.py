"""``optimizer.no_decay = "norms_and_biases"``: two parameter groups, weight decay off for
norm modules' parameters and for biases, told apart by module and name (not by shape,
which use_orig_params flattens); refused where the optimizer sees flat parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from zerobench.engines.base import OptimizerSpec, no_decay_groups
from zerobench.spec.workload import OptimizerConfig, WorkloadError


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2, bias=False)


def test_norms_and_biases_get_no_weight_decay():
    model = Tiny()
    decay, no_decay = no_decay_groups(model)
    assert {id(p) for p in decay["params"]} == {id(model.proj.weight), id(model.out.weight)}
    assert {id(p) for p in no_decay["params"]} == {id(model.norm.weight), id(model.norm.bias), id(model.proj.bias)}
    assert no_decay["weight_decay"] == 0.0 and "weight_decay" not in decay
    optim = OptimizerSpec("adamw", 1e-3, {"weight_decay": 0.1}, "norms_and_biases").build_for(model)
    assert [g["weight_decay"] for g in optim.param_groups] == [0.1, 0.0]


def test_one_group_by_default_and_flat_parameters_refused():
    model = Tiny()
    assert len(OptimizerSpec("adamw", 1e-3, {"weight_decay": 0.1}).build_for(model).param_groups) == 1
    flat = nn.Parameter(torch.zeros(8))
    flat._impl_fsdp_flat = True  # what impl.fsdp marks its flat shards with
    model.register_parameter("_flat_param", flat)
    with pytest.raises(ValueError, match="set the engine option use_orig_params = true"):
        no_decay_groups(model)
    with pytest.raises(ValueError, match="not supported by impl-zero1"):
        OptimizerSpec("adamw", 1e-3, {}, "norms_and_biases").refuse_groups("impl-zero1")


def test_workload_checks_no_decay():
    OptimizerConfig(no_decay="norms_and_biases").check()
    with pytest.raises(WorkloadError, match="optimizer.no_decay: 'biases' is not allowed"):
        OptimizerConfig(no_decay="biases").check()
