"""predict.png: step time and peak active memory per configuration and world size."""

from __future__ import annotations

from pathlib import Path


def plot_predict(frame, path: Path) -> None:
    from zerobench.analysis.figures import save_figure
    import matplotlib.pyplot as plt

    ok = frame[frame["status"] == "ok"]
    if ok.empty:
        return
    sizes = sorted(ok["world_size"].unique())
    configs = list(dict.fromkeys(ok["config"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.35 * len(configs) * len(sizes) + 2.5))
    labels, steps, exposed, active, reserved = [], [], [], [], []
    for config in configs:
        for ws in sizes:
            row = ok[(ok["config"] == config) & (ok["world_size"] == ws)]
            if row.empty:
                continue
            r = row.iloc[0]
            labels.append(f"{config} ws{ws}")
            steps.append(r["step_time_s"] * 1e3)
            exposed.append(r["exposed_comm_s"] * 1e3)
            active.append(r["peak_active_bytes"] / 2**30)
            reserved.append(r["peak_reserved_bytes"] / 2**30)
    y = range(len(labels))
    axes[0].barh(y, steps, color="tab:blue", label="step")
    axes[0].barh(y, exposed, color="tab:red", label="exposed communication")
    axes[0].set_xlabel("ms per step")
    axes[0].set_yticks(list(y), labels)
    axes[0].invert_yaxis()
    axes[0].legend(loc="lower right")
    axes[1].barh(y, reserved, color="tab:gray", label="peak reserved")
    axes[1].barh(y, active, color="tab:green", label="peak active")
    axes[1].set_xlabel("GiB per rank")
    axes[1].set_yticks(list(y), [])
    axes[1].invert_yaxis()
    axes[1].legend(loc="lower right")
    fig.suptitle("zerobench predict (virtual GPU)")
    fig.tight_layout()
    save_figure(fig, path)
