"""Models, data and the single-process reference for the impl FSDP tests.

The test_impl_fsdp*.py files import the helpers from here. Every distributed
test compares against single-process training on the same global batch: each rank
trains on its slice, so the averaged gradient equals the full batch's.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from impl.fsdp import FullyShardedDataParallel as FSDP
from impl.fsdp import lambda_auto_wrap_policy

WIDTH = 30  # 30*30+30 = 930 parameters per block: not a multiple of 4, so padding is exercised
GLOBAL_BATCH = 8
STEPS = 3
TOL = 1e-5


def warm_up_imports() -> None:
    """Build an optimizer once in the parent: the first ``torch.optim`` constructor
    imports ~4 s of modules, which forked ranks then inherit instead of repeating."""
    p = nn.Parameter(torch.zeros(1))
    for cls in (torch.optim.SGD, torch.optim.Adam):
        cls([p], lr=0.1)


class MLP(nn.Module):
    """Four blocks and a head; the blocks are the units, the head is the root's leftover."""

    def __init__(self, width: int = WIDTH, depth: int = 4, out: int = 5):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.head = nn.Linear(width, out)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    def units(self):
        return list(self.blocks)


class Block(nn.Module):
    """A tiny transformer-ish block: pre-norm, a mixing linear and an MLP, residuals."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        x = x + self.mix(self.norm(x))
        return x + self.mlp(x)


class OrderedModel(nn.Module):
    """Registration order differs from forward order (blocks run 2, 0, 1), the
    embedding and the output head share one weight (tied, kept in the root), and each
    block's MLP can be wrapped inside the block's own unit (three nesting levels)."""

    forward_order = (2, 0, 1)

    def __init__(self, vocab: int = 11, width: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.embed = nn.Embedding(vocab, width)
        self.out_norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for i in self.forward_order:
            x = self.blocks[i](x)
        return self.head(self.out_norm(x)).flatten(0, 1)

    def units(self):
        return [m for b in self.blocks for m in (b, b.mlp)]


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {"mlp": MLP, "ordered": OrderedModel}[kind]()


def batches(kind: str, steps: int = STEPS, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if kind == "mlp":
            out.append((torch.randn(GLOBAL_BATCH, WIDTH, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)))
        else:
            tokens = torch.randint(0, 11, (GLOBAL_BATCH, 6), generator=g)
            out.append((tokens, torch.randint(0, 11, (GLOBAL_BATCH * 6,), generator=g)))
    return out


def loss_fn(kind: str, output, target):
    output = output.float()
    return F.mse_loss(output, target) if kind == "mlp" else F.cross_entropy(output, target)


def rank_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    n = t.shape[0] // world_size
    return t[rank * n : (rank + 1) * n]


LR, MOMENTUM = 0.05, 0.9

DEFAULTS_1_13 = {"backward_prefetch": None, "limit_all_gathers": False}
"""PyTorch 1.13's constructor defaults (2.x, and impl now, use BACKWARD_PRE and
limit_all_gathers=True): the tests written against them pass these explicitly."""


def make_optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def unit_policy(model):
    """Auto-wrap policy that makes each of ``model.units()`` its own unit."""
    ids = {id(m) for m in model.units()}
    return functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in ids)


def torch_fsdp1(raw: nn.Module, strategy: str = "FULL_SHARD", mesh: bool = False) -> nn.Module:
    """``raw`` wrapped by PyTorch's own FSDP1 the way ``unit_policy`` wraps it for impl
    (same units, flat parameters), on the CPU: what impl is a drop-in for. With ``mesh``
    it is given a 1-D device mesh, which makes its SHARDED state dicts DTensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy as torch_lambda_policy

    ids = {id(m) for m in raw.units()}
    return TorchFSDP(
        raw,
        auto_wrap_policy=functools.partial(torch_lambda_policy, lambda_fn=lambda m: id(m) in ids),
        sharding_strategy=TorchStrategy[strategy],
        device_id=torch.device("cpu"),  # without it FSDP1 refuses a machine with no accelerator
        **({"device_mesh": init_device_mesh("cpu", (dist.get_world_size(),))} if mesh else {}),
    )


def reference_train(kind: str, steps: int = STEPS, param_dtype: torch.dtype | None = None):
    """Single-process training on the global batch: (losses, {name: parameter}, the
    largest gradient element seen).

    With ``param_dtype`` the forward and backward run on a copy of the parameters cast
    to it (inputs too), gradients flowing back into the fp32 parameters: what FSDP's
    mixed precision computes, less the cross-rank reduction order."""
    model = make_model(kind)
    opt = make_optimizer(model.parameters())
    losses, grad_max = [], 0.0
    for x, y in batches(kind, steps):
        if param_dtype is None:
            out = model(x)
        else:
            params = {n: p.to(param_dtype) for n, p in model.named_parameters()}
            xin = x.to(param_dtype) if x.is_floating_point() else x
            out = torch.func.functional_call(model, params, (xin,))
        loss = loss_fn(kind, out, y)
        loss.backward()
        grad_max = max(grad_max, max(p.grad.abs().max().item() for p in model.parameters()))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, grad_max


def get_by_name(model: nn.Module, name: str) -> torch.Tensor:
    """Resolve ``blocks.0.mix.weight`` on a model that may contain FSDP wrappers."""
    obj = model
    for part in name.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def full_params(fsdp_model: nn.Module, names) -> dict[str, torch.Tensor]:
    with FSDP.summon_full_params(fsdp_model, writeback=False):
        return {n: get_by_name(fsdp_model, n).detach().clone() for n in names}


def max_param_diff(fsdp_model: nn.Module, reference: dict[str, torch.Tensor]) -> float:
    full = full_params(fsdp_model, reference)
    return max((full[n].float() - p.float()).abs().max().item() for n, p in reference.items())


def train(model, kind: str, rank: int, world_size: int, steps: int = STEPS, opt=None, between=None):
    """Train the wrapped model on this rank's slices; returns the rank-averaged losses."""
    import torch.distributed as dist

    opt = opt or make_optimizer(model.parameters())
    losses = []
    for step, (x, y) in enumerate(batches(kind, steps)):
        loss = loss_fn(kind, model(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size))
        loss.backward()
        if between is not None:
            between(step)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return losses
