"""What ``zerobench estimate`` prints, and ``zerobench show`` of an estimate folder: the
per-rank peak of each configuration at each world size, the model states beside the
ZeRO paper's formula, and (``--against RUN``) the estimates beside a run's peaks. Tables
through zerobench/analysis/render.py ([Note: tables at any width]), every byte figure in
one binary unit per table that fits its numbers (MiB for a small model, GiB for a
large one)."""

from __future__ import annotations

from pathlib import Path

from zerobench.analysis.render import Column, Table, bytes_unit, decimals_for, format_column, memory_unit, print_table
from zerobench.runs.tables import REFERENCE_ENGINE
from zerobench.whatif.cells import ran_notes

PAPER_CONVENTION = "the ZeRO paper's mixed-precision convention, 2 + 2 + K bytes per element"


#: The engines whose optimizer-state shard is made of whole parameters (torch's
#: ZeroRedundancyOptimizer's sorted-greedy partition, which impl/zero/partition.py follows),
#: not an even share of the elements: their largest shard is above the formula's 1/N when
#: the parameters do not split evenly (a few large ones, or few per rank at a large N).
WHOLE_PARAMETER_SHARDS = ("torch-zero1", "impl-zero1")


def folder_unit(frame) -> tuple[str, int]:
    """The unit every table and plot of an estimate shows memory in ([Note: one unit a
    folder] in zerobench/analysis/render.py): DDP's peaks decide, else the median peak."""
    ok = frame[frame["status"] == "ok"]
    return memory_unit(ok["peak_mem_bytes"], ok.loc[ok["engine"] == REFERENCE_ENGINE, "peak_mem_bytes"])


def peak_table(frame) -> Table:
    """Per-rank peak per configuration (rows) and world size (columns); a skipped cell
    says so, and why under the table (one line per configuration and reason)."""
    sizes = sorted({int(s) for s in frame["world_size"]})
    ok = frame[frame["status"] == "ok"]
    unit, size = folder_unit(frame)
    table = Table([Column("config", "left", "parts")] + [Column(f"ws{s}") for s in sizes],
                  title=f"per-rank peak {unit}, estimated on a fake process group:")
    decimals = decimals_for([v / size for v in ok["peak_mem_bytes"]])  # one for the whole table
    for config, group in frame.groupby("config", sort=False):
        cells = []
        for s in sizes:
            rows = group[group["world_size"] == s]
            if rows.empty:
                cells.append("")
            elif rows.iloc[0]["status"] == "ok":
                cells += format_column([rows.iloc[0]["peak_mem_bytes"]], 1 / size, decimals)
            else:
                cells.append(str(rows.iloc[0]["status"]))
        table.add_row(config, *cells)
    skipped = frame[frame["status"] != "ok"]
    for (config, reason), group in skipped.groupby(["config", skipped["reason"].fillna("")], sort=False):
        sizes_text = ", ".join(f"ws{int(s)}" for s in group["world_size"])
        table.notes.append(f"{group.iloc[0]['status']} {config} at {sizes_text}: {reason}")
    table.notes += ran_notes(frame)
    return table


def model_states_table(frame) -> Table:
    """Per configuration and world size: the model states from the element counts the
    engine holds (measured) beside the paper's formula for its stage (analytic)."""
    ok = frame[frame["status"] == "ok"]
    measured, analytic = ok["paper_model_states_bytes"], ok["paper_analytic_model_states_bytes"]
    unit, size = folder_unit(frame)
    table = Table([Column("config", "left", "parts", role="key"), Column("ws"), Column("stage"), Column(f"measured {unit}"),
                   Column(f"analytic {unit}"), Column("diff %")],
                  title=f"model states per rank, {unit}, in {PAPER_CONVENTION}:")
    both = format_column(list(measured) + list(analytic), 1 / size)
    diff = [100 * (m - a) / a if a else float("nan") for m, a in zip(measured, analytic)]
    for k, (_, r) in enumerate(ok.iterrows()):
        table.add_row(r["config"], int(r["world_size"]), int(r["zero_stage"]), both[k], both[len(ok) + k],
                      format_column([diff[k]], decimals=2, signed=True)[0])
    uneven = sorted({r["config"] for (_, r), d in zip(ok.iterrows(), diff)
                     if r.get("engine") in WHOLE_PARAMETER_SHARDS and d == d and d > 1.0})
    if uneven:
        table.notes.append(f"{', '.join(uneven)}: above the formula because ZeroRedundancyOptimizer (and impl's "
                           f"ZeRO-1) gives each rank whole parameters, not 1/ws of the elements; the rank measured "
                           f"holds the largest shard, the more so the fewer parameters each rank gets")
    return table


def against_table(both, against: str) -> Table:
    """``against_run``'s frame: estimated and real peak per configuration, world size and rank."""
    unit, size = bytes_unit(list(both["peak_mem_bytes"]) + list(both["real_peak_bytes"]))
    table = Table([Column("config", "left", "parts", role="key"), Column("ws"), Column("rank"), Column(f"estimated {unit}"),
                   Column(f"real {unit}"), Column("diff %")], title=f"estimated vs real peak ({against}):")
    values = format_column(list(both["peak_mem_bytes"]) + list(both["real_peak_bytes"]), 1 / size)
    diffs = format_column(both["diff_pct"], decimals=2, signed=True)
    for k, (_, r) in enumerate(both.iterrows()):
        table.add_row(r["config"], int(r["world_size"]), int(r["rank"]), values[k], values[len(both) + k], diffs[k])
    return table


def capacity_table(frame) -> Table:
    """``estimate --gpu``: each cell's tensor peak against what the caching allocator may
    reserve on that GPU (``capacity_bytes``), and whether it fits."""
    ok = frame[frame["status"] == "ok"]
    unit, size = folder_unit(frame)
    table = Table([Column("config", "left", "parts", role="key"), Column("ws"), Column(f"peak {unit}"),
                   Column(f"capacity {unit}"), Column("fits", "left")],
                  title=f"on {frame['gpu'].iloc[0]}: tensor peak against what the allocator may reserve (the caching "
                        f"allocator rounds and caches on top, which `zerobench predict` models):")
    values = format_column(list(ok["peak_mem_bytes"]) + list(ok["capacity_bytes"]), 1 / size)
    for k, (_, r) in enumerate(ok.iterrows()):
        table.add_row(r["config"], int(r["world_size"]), values[k], values[len(ok) + k],
                      "yes" if r["peak_mem_bytes"] <= r["capacity_bytes"] else "no")
    return table


def estimate_tables(frame) -> list[Table]:
    """Every table of an estimate: the peaks, the model states where a cell ran, and
    the capacity of the GPU it was asked about (``--gpu``)."""
    tables = [peak_table(frame)]
    if (frame["status"] == "ok").any():
        tables.append(model_states_table(frame))
        if "capacity_bytes" in frame.columns:
            tables.append(capacity_table(frame))
    return tables


def print_estimate(frame, console=None) -> None:
    for table in estimate_tables(frame):
        print_table(table, console)


def show_estimate(folder: Path, console=None) -> None:
    """``zerobench show`` of an estimate folder: its tables, from estimate.csv."""
    from zerobench.runs.whatif import EstimateFolder

    print_estimate(EstimateFolder(folder).table(), console)
