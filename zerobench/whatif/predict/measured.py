"""Predicted beside measured: a GPU run's cells next to ``zerobench predict``'s rows for
the same configurations (what ``scripts/gpu-check`` prints on a GPU machine).

``python -m zerobench.whatif.predict.measured RUN_DIR PREDICT_DIR OUT.md``
"""

from __future__ import annotations

import sys
from pathlib import Path

#: (measured column in results.csv, predicted column in predict.csv, label, scale, unit)
PAIRS = (
    ("step_time_s", "step_time_s", "step", 1e3, "ms"),
    ("peak_allocated_bytes", "peak_allocated_bytes", "peak allocated", 2**-20, "MiB"),
    ("peak_active_bytes", "peak_active_bytes", "peak active", 2**-20, "MiB"),
    ("peak_reserved_bytes", "peak_reserved_bytes", "peak reserved", 2**-20, "MiB"),
)


def gpu_preset_for(device_name: str) -> str:
    """The virtual GPU preset closest to a CUDA device name (presets.preset_for_device)."""
    from zerobench.instruments.vgpu.presets import preset_for_device

    return preset_for_device(device_name)


def side_by_side(run_dir: Path, predict_dir: Path):
    """One row per measured cell (rank 0) that has a prediction: each figure measured,
    predicted, and predicted / measured - 1."""
    import pandas as pd

    from zerobench.runs.folder import RunFolder
    from zerobench.runs.whatif import PredictFolder
    from zerobench.spec.cell import CellId

    measured = RunFolder(run_dir).results()
    predicted = PredictFolder(predict_dir).table()
    if "rank" in measured.columns:
        measured = measured[measured["rank"] == 0]
    rows = []
    for _, m in measured.iterrows():
        config = CellId.parse(m["cell_id"]).config
        match = predicted[(predicted["config"] == config) & (predicted["world_size"] == m["world_size"])]
        if match.empty:
            continue
        p = match.iloc[0]
        row = {"cell": m["cell_id"], "predicted_status": p["status"]}
        for mcol, pcol, label, scale, unit in PAIRS:
            mv = m.get(mcol)
            pv = p.get(pcol) if p["status"] == "ok" else None
            row[f"{label} measured ({unit})"] = None if pd.isna(mv) else mv * scale
            row[f"{label} predicted ({unit})"] = None if pv is None or pd.isna(pv) else pv * scale
            row[f"{label} error"] = (pv / mv - 1) if pv is not None and not pd.isna(pv) and mv and not pd.isna(mv) else None
        rows.append(row)
    return pd.DataFrame(rows)


def to_markdown(frame) -> str:
    if frame.empty:
        return "no measured cell has a prediction\n"
    cols = list(frame.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in frame.iterrows():
        cells = []
        for c in cols:
            v = r[c]
            if isinstance(v, float):
                cells.append("" if v != v else (f"{v:+.1%}" if c.endswith("error") else f"{v:.2f}"))
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m zerobench.whatif.predict.measured RUN_DIR PREDICT_DIR OUT.md", file=sys.stderr)
        return 2
    from zerobench.runs.whatif import PredictFolder

    run_root, predict_root, out = (Path(a) for a in argv)
    runs = sorted(p for p in run_root.iterdir() if (p / "results.csv").exists()) if not (run_root / "results.csv").exists() else [run_root]
    preds = sorted(p for p in predict_root.iterdir() if PredictFolder(p).exists()) if not PredictFolder(predict_root).exists() else [predict_root]
    if not runs or not preds:
        print(f"no results.csv under {run_root} or no predict.csv under {predict_root}", file=sys.stderr)
        return 1
    from zerobench.runs.files import write_atomic

    text = to_markdown(side_by_side(runs[-1], preds[-1]))
    write_atomic(out, lambda f: f.write(text))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
