"""The rank session: one cell on one rank, in any world.

[Note: the rank session]
Every tool that runs a cell's engine runs it here: the harness's worker (real ranks,
its timing, profiling and memory passes), ``estimate`` (one rank of a fake world under
the storage tracker), ``predict`` (one rank of a fake world on the virtual GPU). A
:class:`Session` builds the cell's model and engine (zerobench/spec/models.py,
zerobench/engines), makes the rank's batches (zerobench/spec/data.py), warms up, and
runs a measured step (:meth:`Session.measured_step`): the host clock from issue to the
device being done, the storage tracker restarted at its start and told each phase, the
gradients noted when the optimizer phase starts (before ``zero_grad`` drops them). The
world (zerobench/rank/worlds.py, [Note: two worlds]) says where: which process group,
which device and device module, real or fake tensors. The instruments are entered by
the driver around the session: the emulated link and the profiler by the worker, the
storage tracker by whoever measures memory (:meth:`Session.tracker`), the virtual GPU
by its fake world.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerobench.engines import get_engine
from zerobench.engines.base import OptimizerSpec
from zerobench.instruments.memory import StorageTracker
from zerobench.instruments.storages import distinct_nbytes
from zerobench.rank.worlds import World
from zerobench.schema.columns import allocator_columns, state_columns
from zerobench.spec import data as data_mod
from zerobench.spec.cell import Cell
from zerobench.spec.models import build_for_cell, loss_fn
from zerobench.spec.workload import Workload


@dataclass
class StepResult:
    """What one measured step gave."""

    seconds: float
    """host clock from the step's issue to the device being done with it"""
    loss: torch.Tensor
    state: dict[str, int]
    """with a tracker: ``state_{params,grads,optim}_{bytes,numel}``, the model states the
    engine holds (distinct storages; gradients as the optimizer phase started)"""


class Session:
    """One cell on one rank; see [Note: the rank session]."""

    def __init__(self, workload: Workload, cell: Cell, world: World):
        self.workload = workload
        self.cell = cell
        self.world = world
        self.ctx = world.context()
        self.engine_cls = get_engine(cell.engine)
        self.loss = loss_fn(workload.model)
        o = workload.optimizer
        self.optimizer_spec = OptimizerSpec.of(o)

    # -- building ---------------------------------------------------------------------

    def build(self):
        """The cell's engine around its freshly built, seeded model, with its optimizer.
        The world decides what building costs its device (``World.building``: on the
        virtual GPU, only what the rank holds once wrapped, as a meta-device build)."""
        with self.world.building():
            engine = self.engine_cls(self.cell.opts, self.ctx, self.cell.dtype)
            device = None if self.world.backend == "fake" else self.ctx.device
            model, units = build_for_cell(self.workload.model, self.workload.seed, device,
                                          self.cell.opts.get("activation_checkpointing", "none"))
            engine.wrap(model, units)
        self.world.materialize()
        engine.max_grad_norm = self.optimizer_spec.max_grad_norm
        engine.build_optimizer(self.optimizer_spec)
        if engine.max_grad_norm:
            engine.clip_every_step()
        return engine

    def tracker(self, timeline: bool = True) -> StorageTracker:
        """A storage tracker for this world's tensors (meta storages under fake tensors);
        enter it before :meth:`build` so that it sees the model being made."""
        return StorageTracker("meta" if self.world.fake_tensors else self.ctx.device.type, timeline=timeline)

    # -- running ----------------------------------------------------------------------

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) at ``step``: its slice of the global batch
        (zerobench/spec/data.py); under fake tensors, tensors of the same shapes."""
        d, m = self.workload.data, self.workload.model
        if self.world.fake_tensors:
            with self.world.on_device():  # where a real rank makes its batch
                if getattr(m, "batch", ""):
                    return data_mod.global_batch(m, d.batch_size, d.seed, step)
                if m.kind == "mlp":
                    return torch.randn(d.batch_size, m.width), torch.randn(d.batch_size, m.width)
                return (torch.randint(0, m.vocab, (d.batch_size, m.seq_len)),
                        torch.randint(0, m.vocab, (d.batch_size, m.seq_len)))
        inputs, targets = data_mod.rank_batch(m, d.batch_size, self.ctx.world_size, self.ctx.rank, d.seed, step,
                                              self.ctx.device)
        if self.world.backend == "fake":  # own storages, not views of the global batch
            return inputs.clone(), targets.clone()
        return inputs, targets

    def step(self, engine, step: int) -> torch.Tensor:
        """One training step on the batch of ``step``; returns the detached loss."""
        return engine.train_step(*self.batch(step), self.loss)

    def warm_up(self, engine, steps: int, first: int = 0) -> None:
        for step in range(first, first + steps):
            self.step(engine, step)

    def measured_step(self, engine, step: int, tracker: StorageTracker | None = None) -> StepResult:
        """Run the step of ``step`` and measure it: the world's host clock from issue to
        the device being done (it synchronises at both ends, as a timed step must, while
        streams overlap freely inside the step); the tracker, if given, restarts its
        peak at the start, follows the phases and classifies what it saw at the end."""
        inputs, targets = self.batch(step)
        grads = (0, 0)  # (bytes, elements) of the gradients as the optimizer phase starts

        def on_phase(name: str) -> None:
            nonlocal grads
            tracker.set_phase(name)
            if name == "optimizer":  # gradients are complete and not yet zeroed
                found = engine.gradient_tensors()
                tracker.note_roles("grads", found)
                grads = distinct_nbytes(found)

        world = self.world
        if tracker is not None:  # a timed step runs with nothing of the tracker's in it
            engine.on_phase = on_phase
        try:
            world.synchronize()
            if tracker is not None:
                tracker.reset_peak()
            start = world.clock()
            loss = engine.train_step(inputs, targets, self.loss)
            world.synchronize()
            seconds = world.clock() - start
        finally:
            engine.on_phase = None
        state: dict[str, int] = {}
        if tracker is not None:
            params, optim = engine.parameter_tensors(), engine.optimizer_state_tensors()
            tracker.set_phase("after")
            tracker.classify(params=params, optim=optim)
            for role, counts in (("params", distinct_nbytes(params)), ("grads", grads),
                                 ("optim", distinct_nbytes(optim))):
                state.update(zip(state_columns(role), counts))
        return StepResult(seconds, loss, state)

    def allocator_metrics(self) -> dict:
        """The device's caching-allocator figures as result columns ({} on a CPU)."""
        return allocator_columns(self.world.memory_stats()) if self.world.module is not None else {}
