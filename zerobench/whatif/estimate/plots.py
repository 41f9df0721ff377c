"""Peak memory per rank vs world size (log x), one line per configuration, with the
analytic model-state lower bound of each engine drawn dashed in the same colour."""

from __future__ import annotations

from pathlib import Path


def plot_estimate(frame, path: Path) -> Path | None:
    from zerobench.analysis.figures import plt, save_figure  # matplotlib on first plot: `estimate` is often run without one

    ok = frame[frame["status"] == "ok"]
    if ok.empty:
        return None
    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (config, group) in enumerate(ok.groupby("config", sort=False)):
        group = group.sort_values("world_size")
        color = colors[i % len(colors)]
        ax.plot(group["world_size"], group["peak_mem_bytes"] / 2**20, marker="o", color=color, label=config)
        # The bar marker keeps the bound visible where a line has one point (a single world size).
        ax.plot(group["world_size"], group["analytic_model_states_bytes"] / 2**20, ls="--", marker="_", ms=16,
                color=color, alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world size")
    ax.set_ylabel("per-rank peak (MiB)")
    ax.set_title("Estimated per-rank peak (solid) and analytic model states, the lower bound (dashed)")
    ax.legend(fontsize=7, loc="best")
    return save_figure(fig, path, dpi=110)
