"""Plots keep their layout at 1, 3, 20 and 60 cells: no text overlaps other text or a
legend, and nothing is cut by the figure's edge (tests/helpers/layout.py reads
matplotlib's own text extents). Every plot of a run, an estimate and a prediction is
drawn from folders made here, with cell ids as long as real ones."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pandas as pd
import pytest

from tests.helpers.layout import layout_problems
from zerobench.commands.plot import plot_folder
from zerobench.runs.folder import RunFolder

#: Cells per folder; the larger two draw for tens of seconds, so they run with the slow tests.
SIZES = (1, 3, pytest.param(20, marks=pytest.mark.slow), pytest.param(60, marks=pytest.mark.slow))

#: (engine, options) in the order a matrix lists them; ids as the matrix names them.
CONFIGS = [("ddp", {}), ("torch-zero1", {}), ("impl-zero1", {}), ("impl-zero2", {}), ("torch-fsdp2", {}),
           ("torch-fsdp2", {"reshard_after_forward": False}),
           *(("torch-fsdp1", {"sharding_strategy": s, "backward_prefetch": p, "limit_all_gathers": True})
             for s in ("FULL_SHARD", "SHARD_GRAD_OP") for p in ("pre", "post")),
           *(("impl-fsdp", {"sharding_strategy": s, "backward_prefetch": p, "limit_all_gathers": lim})
             for s in ("FULL_SHARD", "SHARD_GRAD_OP") for p in ("pre", "none") for lim in (True, False))]


def _cell_id(engine: str, ws: int, dtype: str, options: dict) -> str:
    parts = [f"{k}={'on' if v is True else 'off' if v is False else v}" for k, v in options.items()
             if (k, v) not in (("sharding_strategy", "FULL_SHARD"), ("backward_prefetch", "pre"),
                               ("limit_all_gathers", True))]
    return "-".join([engine, f"ws{ws}", dtype, *parts])


def _cells(n: int) -> list[tuple[str, str, int, str, dict]]:
    combos = itertools.product((2, 4), ("fp32", "bf16"), CONFIGS)
    out = []
    for ws, dtype, (engine, options) in combos:
        cell = _cell_id(engine, ws, dtype, options)
        if cell not in {c[0] for c in out}:
            out.append((cell, engine, ws, dtype, options))
    assert len(out) >= 60
    return out[:n]


def _record(i: int, cell: str, engine: str, ws: int, dtype: str, options: dict) -> dict:
    scale = 1.0 / (1 + (i % 7) * 0.3)
    ranks = []
    for rank in range(ws):
        metrics = {"step_time_s": 0.02 * (1 + (i % 5) * 0.4), "step_time_p10_s": 0.018, "step_time_p90_s": 0.05,
                   "peak_mem_bytes": int(30e6 * scale), "peak_mem_params_bytes": int(5e6 * scale),
                   "peak_mem_grads_bytes": int(5e6 * scale), "peak_mem_optim_bytes": int(1e7 * scale),
                   "peak_mem_activations_bytes": int(6e6 * scale), "peak_mem_other_bytes": int(4e6 * scale),
                   "comm_total_bytes": 5_000_000, "comm_calls": 4}
        if engine == "impl-fsdp":
            metrics["max_inflight_all_gathers"] = 2 if options.get("limit_all_gathers") else 5
        n = 40
        timeline = {"t_s": [k * 0.001 for k in range(n)], "params": [5e6 * scale] * n,
                    "grads": [min(k, 20) * 2.5e5 * scale for k in range(n)], "optim": [1e7 * scale] * n,
                    "activations": [max(0, 20 - abs(k - 20)) * 2e5 for k in range(n)]}
        losses = [2.0 - 0.05 * s + (3e-2 if dtype == "bf16" and engine != "ddp" else 1e-7) * (s % 2) for s in range(20)]
        ranks.append({"rank": rank, "metrics": metrics, "step_times": [0.02] * 20, "losses": losses,
                      "timeline": timeline})
    config = {"engine": engine, "world_size": ws, "dtype": dtype, **options}
    return {"cell_id": cell, "status": "ok", "config": config, "ranks": ranks, "cell_wall_s": 3.0,
            "loss_max_abs_diff_ref": 3e-2 if dtype == "bf16" and engine != "ddp" else 1e-7}


def _run_folder(tmp_path: Path, n: int) -> Path:
    run = tmp_path / f"20261124-120000-layout{n}"
    (run / "cells").mkdir(parents=True)
    cells = _cells(n)
    for i, cell in enumerate(cells):
        (run / "cells" / f"{cell[0]}.json").write_text(json.dumps(_record(i, *cell)))
    sizes = sorted({c[2] for c in cells})
    (run / "meta.json").write_text(json.dumps({"workload": f"layout{n}", "backend": "gloo", "cpu_model": "Test CPU",
                                               "cells": [c[0] for c in cells], "world_sizes": sizes}))
    (run / "workload.json").write_text(json.dumps({"name": f"layout{n}", "data": {"warmup_steps": 2}}))
    (run / "reference.json").write_text(json.dumps({str(ws): [2.0 - 0.05 * s for s in range(22)] for ws in sizes}))
    RunFolder(run).write_tables()
    return run


def _whatif_folder(tmp_path: Path, n: int, kind: str) -> Path:
    folder = tmp_path / f"20261124-120000-layout{n}-{kind}"
    folder.mkdir()
    rows = []
    for i, (cell, engine, _, dtype, options) in enumerate(_cells(n)):
        config = cell.replace("-ws2", "").replace("-ws4", "")
        for ws in (8, 64, 1024):
            shrink = 1.0 if engine == "ddp" else (0.4 + (i % 5) * 0.1) ** (1 + ws / 1024)
            row = {"config": config, "engine": engine, "dtype": dtype, "world_size": ws, "status": "ok", **options}
            if kind == "estimate":
                row.update(backend="nccl", fake_tensors=True, peak_mem_bytes=2**34 * shrink,
                           analytic_model_states_bytes=2**33 * shrink)
            else:
                row.update(gpu="h100-sxm", host="fast", link="nvlink4-8gpu", step_time_s=0.2 * (1 + (i % 7) / 10),
                           exposed_comm_s=0.01, peak_active_bytes=2**34 * shrink * 0.9,
                           peak_reserved_bytes=2**34 * shrink)
            rows.append(row)
    frame = pd.DataFrame(rows).drop_duplicates(["config", "world_size"])
    frame.to_csv(folder / f"{kind}.csv", index=False)
    (folder / "workload.json").write_text(json.dumps({"name": f"layout{n}"}))
    return folder


@pytest.fixture()
def kept(monkeypatch):
    """Every figure the plots draw, kept open past save_figure (which lays it out)."""
    import matplotlib.pyplot as plt

    from zerobench.analysis import figures as module

    figures, real_save, real_close = {}, module.save_figure, plt.close

    def keep(fig, path, *args, **kwargs):
        figures[Path(path).name] = fig
        plt.close = lambda *a: None
        try:
            return real_save(fig, path, *args, **kwargs)
        finally:
            plt.close = real_close

    import sys

    for name, module_ in list(sys.modules.items()):
        if name.startswith("zerobench.") and getattr(module_, "save_figure", None) is real_save:
            monkeypatch.setattr(module_, "save_figure", keep)
    yield figures
    for fig in figures.values():
        real_close(fig)


def _import_every_plot_module():
    import zerobench.analysis.pareto  # noqa: F401
    import zerobench.analysis.plots  # noqa: F401
    import zerobench.whatif.estimate.plots  # noqa: F401
    import zerobench.whatif.predict.plots  # noqa: F401


_import_every_plot_module()


@pytest.mark.parametrize("kind", ["run", "estimate", "predict"])
@pytest.mark.parametrize("n", SIZES)
def test_every_plot_keeps_its_layout(tmp_path, kept, n, kind):
    folder = _run_folder(tmp_path, n) if kind == "run" else _whatif_folder(tmp_path, n, kind)
    drawn = plot_folder(folder)
    assert drawn and set(kept) == {Path(p).name for p in drawn}
    problems = {name: layout_problems(fig) for name, fig in kept.items()}
    assert {name: p for name, p in problems.items() if p} == {}


def test_the_layout_check_sees_an_overlap_and_a_clipped_legend():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1], label="a line")
    ax.text(0.5, 0.5, "a label", transform=ax.transAxes)
    ax.text(0.52, 0.5, "another label", transform=ax.transAxes)
    ax.legend(loc="upper left", bbox_to_anchor=(0.9, 1.0))
    problems = layout_problems(fig)
    plt.close(fig)
    assert any("overlaps" in p for p in problems), problems
    assert any("legend cut" in p for p in problems), problems


def test_one_unit_for_memory_in_a_runs_table_and_plots(tmp_path, kept):
    """[Note: one unit a folder]: a cell of 3 GiB beside DDP's 30 MB keeps the table and
    every plot in MiB, DDP's unit, as the same run without that cell would show it."""
    from zerobench.analysis.render import memory_unit
    from zerobench.analysis.summary import summary_table

    assert memory_unit([300 * 2**20, 3 * 2**30], reference=[300 * 2**20]) == ("MiB", 2**20)
    assert memory_unit([300 * 2**20, 3 * 2**30, 2 * 2**30]) == ("GiB", 2**30)  # no reference: the median's
    run = _run_folder(tmp_path, 3)
    big = json.loads((run / "cells" / "impl-zero1-ws2-fp32.json").read_text())
    for rank in big["ranks"]:
        rank["metrics"]["peak_mem_bytes"] = 3 * 2**30
    (run / "cells" / "impl-zero1-ws2-fp32.json").write_text(json.dumps(big))
    RunFolder(run).write_tables()
    headers = [c.header for c in summary_table(run).columns]
    assert "peak MiB" in headers, headers
    plot_folder(run)
    labels = [ax.get_xlabel() + ax.get_ylabel() for fig in kept.values() for ax in fig.axes]
    memory = [text for text in labels if "memory" in text or "MiB" in text or "GiB" in text]
    assert memory and all("GiB" not in text for text in memory), memory
