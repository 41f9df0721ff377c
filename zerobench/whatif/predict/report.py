"""What ``zerobench predict`` prints, and ``zerobench show`` of a predict folder: one row
per configuration and world size ([Note: predicted columns] in
zerobench/whatif/predict/job.py), through zerobench/analysis/render.py ([Note: tables
at any width]). Memory in one binary unit that fits its numbers (MiB for a small model,
GiB for a large one); ``units`` a count where it is whole; MFU where the model has a
FLOP count, and under the table why not, or over which peak, where that needs saying."""

from __future__ import annotations

import math
from pathlib import Path

from zerobench.analysis.render import Column, Table, format_column, memory_unit, print_table
from zerobench.runs.tables import REFERENCE_ENGINE
from zerobench.whatif.cells import ran_notes


def _values(frame, column) -> list:
    return list(frame[column]) if column in frame else [None] * len(frame)


def _whole(values) -> bool:
    return all(v is None or not math.isfinite(float(v)) or float(v) == int(float(v)) for v in values)


def setting_line(frame) -> str:
    """Which presets the prediction ran on, from its rows."""
    def one(column, default=""):
        values = [str(v) for v in dict.fromkeys(frame[column].dropna())] if column in frame else []
        return ", ".join(v for v in values if v) or default

    inter = one("inter_link")
    return (f"predicted on the virtual GPU ({one('gpu', '?')}, {one('host', '?')} host, link {one('link', '?')}"
            + (f", inter-node {inter}" if inter else "") + "):")


def mfu_notes(frame, model_kind: str | None = None) -> list[str]:
    """Why MFU is not shown, or over which peak an fp32 cell's is: from the rows
    (``tflops_per_gpu`` / ``mfu`` is the peak the preset gave the cell's dtype)."""
    ok = frame[frame["status"] == "ok"] if "status" in frame else frame
    mfu = [v for v in _values(ok, "mfu") if v is not None and math.isfinite(float(v))]
    tflops = [v for v in _values(ok, "tflops_per_gpu") if v is not None and math.isfinite(float(v))]
    if ok.empty:
        return []
    if not mfu:
        if not tflops:
            model = f"the model ({model_kind})" if model_kind else "the model"
            return [f"MFU: not shown: {model} has no FLOP count per token (MFU is defined for gpt and llama "
                    f"models: [Note: model FLOPs] in zerobench/spec/flops.py)"]
        return ["MFU: not shown: the GPU preset has no peak FLOP/s for these cells' dtype"]
    peaks = {}
    for _, r in ok.iterrows():
        m, t = r.get("mfu"), r.get("tflops_per_gpu")
        if m is not None and t is not None and math.isfinite(float(m)) and float(m) > 0:
            peaks.setdefault(str(r["dtype"]), float(t) / float(m))
    if "fp32" in peaks:
        others = ", ".join(f"{d} {p:.0f}" for d, p in peaks.items() if d != "fp32")
        gpu = ", ".join(str(g) for g in dict.fromkeys(ok["gpu"])) if "gpu" in ok else "the GPU"
        return [f"MFU of fp32 cells is over {gpu}'s fp32 peak, {peaks['fp32']:.0f} TFLOP/s, without tensor cores"
                + (f" (the other dtypes' peaks: {others} TFLOP/s)" if others else "")]
    return []


def folder_unit(frame) -> tuple[str, int]:
    """The unit every table and plot of a prediction shows memory in ([Note: one unit a
    folder] in zerobench/analysis/render.py): DDP's reserved peaks decide, else the median."""
    ok = frame[frame["status"] == "ok"]
    values = _values(ok, "peak_reserved_bytes")
    reference = _values(ok[ok["engine"] == REFERENCE_ENGINE], "peak_reserved_bytes") if "engine" in ok else []
    return memory_unit(values, reference)
#: The shares of the host's time predict.csv gives (host.py's HOST_SHARES, and the work on
#: host memory), by the word the table uses for each.
HOST_SHARE_COLUMNS = {"operators": "host_operators_s", "python": "host_python_s", "streams": "host_streams_s",
                      "collectives": "host_collectives_s", "host memory": "host_cpu_s"}


def host_bound(row) -> str:
    """``host-bound (python 61 %)`` when the host was busy longer than the device in the
    step, naming the largest share of the host's time; else empty (or a folder made before
    these columns)."""
    def value(name):
        v = row.get(name) if hasattr(row, "get") else None
        return float(v) if v is not None and v == v else None

    host, device = value("host_busy_s"), value("device_busy_s")
    if host is None or device is None or host <= device or host <= 0:
        return ""
    shares = {word: value(column) or 0.0 for word, column in HOST_SHARE_COLUMNS.items()}
    word, seconds = max(shares.items(), key=lambda kv: kv[1])
    return f"host-bound ({word} {seconds / host:.0%})"


def predict_table(frame, model_kind: str | None = None) -> Table:
    """The prediction of every configuration and world size."""
    ok_mask = (frame["status"] == "ok").tolist()
    ok = frame[frame["status"] == "ok"]
    unit, size = folder_unit(frame)
    columns = [Column("config", "left", "parts", role="key"), Column("ws"), Column("step ms"), Column("exposed ms"),
               Column("overlap"), Column(f"active {unit}"), Column(f"reserved {unit}"), Column("units"),
               Column("lead ms"), Column("host ms"), Column("device ms"), Column("retries"), Column("MFU %"),
               Column("status", "left", "words", role="note")]
    table = Table(columns, title=setting_line(frame))

    def column(name, scale=1.0, decimals=None):
        values = [v if keep else None for v, keep in zip(_values(frame, name), ok_mask)]
        return format_column(values, scale, decimals)

    both = format_column([v if k else None for v, k in zip(_values(frame, "peak_active_bytes"), ok_mask)]
                         + [v if k else None for v, k in zip(_values(frame, "peak_reserved_bytes"), ok_mask)],
                         1 / size)
    units = _values(ok, "max_unsharded_units")
    retries = [v for v in _values(ok, "num_alloc_retries") if v is not None and math.isfinite(float(v))]
    figures = list(zip(column("step_time_s", 1e3), column("exposed_comm_s", 1e3), column("overlap_ratio", 1, 2),
                       both[:len(frame)], both[len(frame):],
                       column("max_unsharded_units", 1, 0 if _whole(units) else 1),
                       column("host_lead_max_s", 1e3), column("host_busy_s", 1e3), column("device_busy_s", 1e3),
                       # retries only where some cell had one: a column of zeros says nothing
                       column("num_alloc_retries", 1, 0) if any(retries) else [""] * len(frame),
                       column("mfu", 100, 1)))
    for k, (_, r) in enumerate(frame.iterrows()):
        if ok_mask[k]:
            table.add_row(r["config"], int(r["world_size"]), *figures[k], host_bound(r))
        else:  # a capped cell's figures are a full card's, not a prediction
            reason = r.get("reason")
            reason = "" if reason is None or reason != reason else f": {reason}"
            table.add_row(r["config"], int(r["world_size"]), *[""] * 11, f"{r['status']}{reason}",
                          style="yellow")
    if any(host_bound(r) for _, r in frame.iterrows()):
        table.notes.append("host-bound: the host was busy longer than the device in the step (host ms against "
                           "device ms), with the largest share of the host's time (predict.csv: host_operators_s, "
                           "host_python_s, host_streams_s, host_collectives_s, host_cpu_s)")
    table.notes += ran_notes(frame) + mfu_notes(frame, model_kind)
    return table


def print_predict(frame, console=None, model_kind: str | None = None) -> None:
    print_table(predict_table(frame, model_kind), console)


def model_kind(folder: Path) -> str | None:
    """The kind of model (mlp, gpt, llama, ...) of a results folder's workload.json."""
    import json

    try:
        return str(json.loads((Path(folder) / "workload.json").read_text())["model"]["kind"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def show_predict(folder: Path, console=None) -> None:
    """``zerobench show`` of a predict folder: its table, from predict.csv."""
    from zerobench.runs.whatif import PredictFolder

    print_predict(PredictFolder(folder).table(), console, model_kind(folder))
