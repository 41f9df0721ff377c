"""The tiny-Llama validation table of docs/models.md, from a run and an estimate of llama-tiny.toml.

    zerobench run workloads/llama-tiny.toml
    zerobench estimate workloads/llama-tiny.toml --world-sizes 2,4 --backend gloo
    python scripts/models_table.py RUN_DIR ESTIMATE_DIR
    python scripts/models_table.py --recompute-cost workloads/llama-tiny.toml

prints one markdown row per engine, checkpointing mode and world size (rank 0): the real
peak and its activations (memory pass), the median step time, the estimated peak and its
difference from the real one, and the loss deviation from single-process training; then
checkpointing's saving per engine and world size, against "none".
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

MiB = 2**20
MODES = ["none", "full", "every:2", "ops"]


def table(run_dir: Path, estimate_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    real = pd.read_csv(run_dir / "results.csv")
    real = real[(real["status"] == "ok") & (real["rank"] == 0)].copy()
    est = pd.read_csv(estimate_dir / "estimate.csv")
    est = est[est["status"] == "ok"][["engine", "world_size", "activation_checkpointing", "peak_mem_bytes"]]
    both = real.merge(est.rename(columns={"peak_mem_bytes": "estimate_bytes"}),
                      on=["engine", "world_size", "activation_checkpointing"], how="left")
    both["diff_pct"] = 100 * (both["estimate_bytes"] - both["peak_mem_bytes"]) / both["peak_mem_bytes"]
    both["mode_order"] = both["activation_checkpointing"].map(MODES.index)
    both = both.sort_values(["world_size", "engine", "mode_order"], key=lambda s: s if s.name != "engine" else
                            s.map(list(dict.fromkeys(real["engine"])).index))
    saving = []
    for (engine, ws), group in both.groupby(["engine", "world_size"], sort=False):
        by_mode = group.set_index("activation_checkpointing")
        if "none" not in by_mode.index:
            continue
        base = by_mode.loc["none"]
        for mode in MODES[1:]:
            if mode in by_mode.index:
                row = by_mode.loc[mode]
                saving.append({"engine": engine, "world_size": ws, "mode": mode,
                               "activations_saved_pct": 100 * (1 - row["peak_mem_activations_bytes"]
                                                               / base["peak_mem_activations_bytes"]),
                               "peak_saved_pct": 100 * (1 - row["peak_mem_bytes"] / base["peak_mem_bytes"]),
                               "step_time_ratio": row["step_time_s"] / base["step_time_s"]})
    return both, pd.DataFrame(saving)


def recompute_cost(workload_path: str, rounds: int = 15) -> dict[str, float]:
    """Median single-process forward+backward time of each checkpointing mode relative to
    "none", the modes interleaved round by round so that a busy machine slows them alike."""
    import statistics
    import time

    import torch

    from zerobench.spec import data
    from zerobench.spec.models import build_for_cell, loss_fn
    from zerobench.spec.workload import load_workload

    torch.set_num_threads(1)
    w = load_workload(workload_path)
    inputs, targets = data.global_batch(w.model, w.data.batch_size, 0, 0)
    models = {mode: build_for_cell(w.model, w.seed, "cpu", mode)[0] for mode in MODES}
    times = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode, model in models.items():
            start = time.perf_counter()
            loss_fn(w.model)(model(inputs), targets).backward()
            times[mode].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    base = statistics.median(times["none"])
    return {mode: statistics.median(t) / base for mode, t in times.items()}


def main(argv: list[str]) -> None:
    if argv[0] == "--recompute-cost":
        for mode, ratio in recompute_cost(argv[1]).items():
            print(f"{mode}: {ratio:.2f} x none")
        return
    both, saving = table(Path(argv[0]), Path(argv[1]))
    print("| engine | AC | ws | peak MiB | activations MiB | step ms | estimate MiB | est. vs real | loss dev |")
    print("|---|---|---|---|---|---|---|---|---|")
    for _, r in both.iterrows():
        print(f"| {r['engine']} | {r['activation_checkpointing']} | {r['world_size']} | {r['peak_mem_bytes'] / MiB:.2f} "
              f"| {r['peak_mem_activations_bytes'] / MiB:.2f} | {1000 * r['step_time_s']:.0f} "
              f"| {r['estimate_bytes'] / MiB:.2f} | {r['diff_pct']:+.2f} % | {r['loss_max_abs_diff_ref']:.1e} |")
    print()
    print("| ws | AC | activations saved, min-max over engines | peak saved | step time x none, median over engines |")
    print("|---|---|---|---|---|")
    for (ws, mode), g in saving.groupby(["world_size", "mode"], sort=False):
        print(f"| {ws} | {mode} | {g['activations_saved_pct'].min():.0f}-{g['activations_saved_pct'].max():.0f} % "
              f"| {g['peak_saved_pct'].min():.0f}-{g['peak_saved_pct'].max():.0f} % "
              f"| {g['step_time_ratio'].median():.2f} |")
    worst = both["diff_pct"].abs().max()
    print(f"\ncells: {len(both)}, worst |estimate - real|: {worst:.2f} %, "
          f"worst loss deviation: {both['loss_max_abs_diff_ref'].max():.1e}")


if __name__ == "__main__":
    main(sys.argv[1:])
