"""The validation table: published GPU runs beside what ``zerobench predict`` says of
them (docs/vgpu.md, "Validation against published runs").

``python -m zerobench.whatif.predict.published [--only NAME ...] [--results DIR] [--out TABLE.md]``

For each published run, the workload that rebuilds it (``workloads/``) is predicted on
the preset of the card it ran on, and each published figure is put beside the
prediction with the error (predicted / published - 1). The figures and their sources
are in :data:`PUBLISHED`; nothing here tunes the model to them (the cost model is
calibrated on microbenchmarks: [Note: virtual GPU presets]).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

GiB = 2**30
_A100 = {"gpu": "a100-80gb", "link": "nvlink3-8gpu", "inter_link": "ib-200g"}
_H100 = {"gpu": "h100-sxm", "link": "nvlink4-8gpu", "inter_link": None}
# The H100s of Meta's Grand Teton hosts, which torchtitan's and PyTorch's published H100
# runs used: 96 GB of HBM2e at 2.4 TB/s, 500 W power limit (pytorch/torchtitan/docs/performance.md;
# the preset h100-96gb-500w cites it).
_GRAND_TETON_H100 = {"gpu": "h100-96gb-500w", "link": "nvlink4-8gpu", "inter_link": None}
# What the published runs' software did, not a fit: torchtitan's launcher sets
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; the FSDP1 studies of 2023 ran a
# ProcessGroupNCCL that record-streamed collective tensors ([Note: collective tensors]).
_TORCHTITAN = {"alloc_conf": "expandable_segments:True"}
_PG_NCCL_2023 = {"record_streams": True}
# PR #129721 ran torch's nightly of June 2024, after pytorch#128539 withdrew cuDNN's SDPA
# from the top of the H100's priority order: flash attention ([Note: SDPA backend choice]).
_TORCH_2024_H100 = {**_TORCHTITAN, "sdpa_backend": "flash"}


@dataclass(frozen=True)
class Published:
    name: str
    source: str
    workload: str
    world_size: int
    config: str
    """the predicted configuration's id"""
    figures: dict = field(default_factory=dict)
    """predict.csv column -> published value (tokens per second per GPU, bytes, seconds, ...)"""
    hardware: dict = field(default_factory=lambda: dict(_H100))
    software: dict = field(default_factory=dict)
    """predict options that say what the run's software did (allocator settings, ProcessGroupNCCL)"""


PUBLISHED: tuple[Published, ...] = (
    Published("pr129721", "PyTorch PR #129721: Llama 3 8B, fully_shard, 8x H100, batch 1, seq 8192, no AC",
              "workloads/pr129721-llama3-8b-h100.toml", 8, "torch-fsdp2-bf16",
              {"tokens_per_s": 6130, "peak_reserved_bytes": 77.29 * GiB, "mfu": 0.359}, dict(_GRAND_TETON_H100),
              _TORCH_2024_H100),
    Published("torchtitan-8b-op-ac", "pytorch/torchtitan/docs/performance.md: Llama 3 8B, FSDP2, 64x A100 80 GB, "
              "batch 1, seq 8192, op-level selective AC", "workloads/torchtitan-llama3-8b-a100.toml", 64,
              "torch-fsdp2-bf16-activation_checkpointing=ops", {"tokens_per_s": 2973, "mfu": 0.582}, dict(_A100),
              _TORCHTITAN),
    Published("torchtitan-8b-layer-ac", "pytorch/torchtitan/docs/performance.md: the same, layer-level selective AC "
              "(every second block)", "workloads/torchtitan-llama3-8b-a100.toml", 64,
              "torch-fsdp2-bf16-activation_checkpointing=every:2", {"tokens_per_s": 2904, "mfu": 0.568}, dict(_A100),
              _TORCHTITAN),
    Published("torchtitan-13b", "pytorch/torchtitan/docs/performance.md: Llama 2 13B, FSDP2, 64x A100 80 GB, batch 2, "
              "seq 4096, no AC", "workloads/torchtitan-llama2-13b-a100.toml", 64, "torch-fsdp2-bf16",
              {"tokens_per_s": 2162, "mfu": 0.611}, dict(_A100), _TORCHTITAN),
    Published("torchtitan-70b", "pytorch/torchtitan/docs/performance.md: Llama 3 70B, FSDP2, 64x A100 80 GB, batch 1, "
              "seq 8192, full AC", "workloads/torchtitan-llama3-70b-a100.toml", 64,
              "torch-fsdp2-bf16-activation_checkpointing=full", {"tokens_per_s": 331, "mfu": 0.517}, dict(_A100),
              _TORCHTITAN),
    Published("issue104509-off", "pytorch#104509: 7B GPT, FSDP1, 16 A100s, local batch 8, limit_all_gathers off",
              "workloads/fsdp1-gpt7b-a100-limiter.toml", 16, "torch-fsdp1-bf16-limit_all_gathers=off",
              {"step_time_s": 7.3, "num_alloc_retries": 46}, dict(_A100), _PG_NCCL_2023),
    Published("issue104509-on", "pytorch#104509: the same, limit_all_gathers on",
              "workloads/fsdp1-gpt7b-a100-limiter.toml", 16, "torch-fsdp1-bf16",
              {"step_time_s": 5.0, "num_alloc_retries": 0}, dict(_A100), _PG_NCCL_2023),
    Published("pr98354-off", "PyTorch PR #98354: FSDP1, compute-bound, limit_all_gathers off (model not published; "
              "compare the ratio with the next row)", "workloads/limiter-gpu.toml", 8,
              "torch-fsdp1-bf16-limit_all_gathers=off", {"step_time_s": 0.2476, "peak_active_bytes": 38_555e6},
              software=_PG_NCCL_2023),
    Published("pr98354-on", "PyTorch PR #98354: the same, limit_all_gathers on", "workloads/limiter-gpu.toml", 8,
              "torch-fsdp1-bf16", {"step_time_s": 0.2365, "peak_active_bytes": 7_164e6}, software=_PG_NCCL_2023),
    Published("fsdp-paper-175b", "FSDP paper (arXiv 2304.11277): minGPT-175B, FSDP1 with AC, 128 A100s: more than "
              "173 TFLOP/s per GPU", "workloads/fsdp-paper-gpt175b-a100.toml", 128,
              "torch-fsdp1-bf16-activation_checkpointing=full", {"tflops_per_gpu": 173}, dict(_A100),
              _PG_NCCL_2023),
)


def _groups(rows):
    """One predict command per workload, world size and hardware: their configurations."""
    out: dict = {}
    for row in rows:
        key = (row.workload, row.world_size, tuple(sorted(row.hardware.items(), key=lambda kv: kv[0])),
               tuple(sorted(row.software.items())))
        out.setdefault(key, []).append(row)
    return out


def validate(results_root: Path, only=None, log=print):
    """Predict every published run (or those named in ``only``); one row per figure."""
    import pandas as pd

    from zerobench.runs.whatif import PredictFolder
    from zerobench.whatif.predict import predict
    from zerobench.whatif.predict.request import PredictRequest

    rows = [p for p in PUBLISHED if not only or p.name in only]
    unknown = set(only or ()) - {p.name for p in PUBLISHED}
    if unknown:
        raise ValueError(f"--only: {', '.join(sorted(unknown))} is not a published run "
                         f"(allowed: {', '.join(p.name for p in PUBLISHED)})")
    table = []
    for (workload, ws, hardware, software), group in _groups(rows).items():
        hw = dict(hardware)
        out = predict(PredictRequest(workload, (ws,), gpu=hw["gpu"], link=hw["link"], inter_link=hw["inter_link"],
                                     results_root=results_root, only=sorted({p.config for p in group}),
                                     **dict(software)), log=log)
        frame = PredictFolder(out).table()
        for p in group:
            found = frame[(frame["config"] == p.config) & (frame["world_size"] == ws)]
            r = found.iloc[0] if not found.empty else None
            for column, published in p.figures.items():
                predicted = None if r is None or column not in r or pd.isna(r[column]) else float(r[column])
                table.append({"run": p.name, "figure": column, "published": published, "predicted": predicted,
                              "error": (predicted / published - 1) if predicted is not None and published else None,
                              "status": None if r is None else r["status"],
                              "reason": None if r is None or pd.isna(r.get("reason")) else r["reason"],
                              "source": p.source, "predict_csv": str(PredictFolder(out).table_path)})
    return pd.DataFrame(table)


def _fmt(column: str, value) -> str:
    if value is None or value != value:
        return "-"
    if column.endswith("_bytes"):
        return f"{value / GiB:.2f} GiB"
    if column == "mfu":
        return f"{100 * value:.1f} %"
    if column == "step_time_s":
        return f"{value:.3f} s"
    if column == "num_alloc_retries":
        return f"{int(value)}"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def to_markdown(frame) -> str:
    lines = ["| run | figure | published | predicted | error | status |", "|---|---|---:|---:|---:|---|"]
    for _, r in frame.iterrows():
        error = "-" if r["error"] is None or r["error"] != r["error"] else f"{100 * r['error']:+.1f} %"
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
        lines.append(f"| {r['run']} | {r['figure']} | {_fmt(r['figure'], r['published'])} | "
                     f"{_fmt(r['figure'], r['predicted'])} | {error} | {status} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerobench.whatif.predict.published",
                                     description="predict the published GPU runs and compare")
    parser.add_argument("--only", action="append", help=f"only this run (repeatable): "
                                                         f"{', '.join(p.name for p in PUBLISHED)}")
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here too")
    args = parser.parse_args(argv)
    frame = validate(args.results, args.only)
    text = to_markdown(frame)
    from zerobench.runs.files import print_and_write

    print_and_write(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
