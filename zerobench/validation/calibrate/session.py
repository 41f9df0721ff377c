"""The H200 session's files as measurements: results/gpu/h200-20261126/ (micro.json,
micro.log, smi.csv, host.json, env.txt; its README.md says what each holds) read into
the measurements format ``zerobench calibrate`` writes, so that the shipped ``h200`` preset
is built from them by the same function as any user's (``zerobench calibrate --from
results/gpu/h200-20261126``).

The session ran its own scripts before calibrate existed; what they measured maps onto
calibrate's kernels (zerobench/instruments/vgpu/microbench.py) one to one:

* every ``gemm`` row (``m``, ``n``, ``k``, bf16) a ``gemm``, in the layout its role ran
  as (forward ``nt``, input gradient ``nn``, weight gradient ``tn``: [Note: GEMM
  layouts] in zerobench/instruments/vgpu/gemm.py; the 8192^3 GEMM ``nn``);
* ``sdpa fwd causal`` / ``sdpa bwd causal``: attention (1, 32, 8192, 128), causal, bf16,
  on torch's default backend, which on that H200 (sm90, torch 2.11, cuDNN 9.19) is cuDNN
  ([Note: SDPA backend choice] in zerobench/instruments/vgpu/sdpa.py);
* ``rms_norm fwd [T,D]``, ``silu(a)*b [T,FF]`` (bf16), ``cross_entropy fwd fp32 [T,V]``,
  ``bf16->fp32 logits [T,V]``, with T 8192, D 4096, FF 14336, V 128256 (Llama 3 8B at
  sequence 8192); ``copy 2 GiB``; the foreach AdamW step over one Llama 3 8B block in fp32;
* micro.log's six 2-second windows of the 8192^3 GEMM (the sustained rate) against the
  ``mm 8192^3`` row (the burst rate); smi.csv's idle samples (0 % utilisation with a
  context holding memory) for the idle power; env.txt's power limit.
"""

from __future__ import annotations

import csv
import json
import re
import statistics
from pathlib import Path

from zerobench.instruments.vgpu import microbench, sdpa
from zerobench.instruments.vgpu.calibration import MEASUREMENT_FORMAT
from zerobench.instruments.vgpu.gemm import ROLE_LAYOUTS

#: Compute capability by part (NVIDIA's CUDA GPUs table): the session did not record it.
COMPUTE_CAPABILITY = {"H100": "9.0", "H200": "9.0", "GH200": "9.0", "A100": "8.0"}
T, D, FF, V = 8192, 4096, 14336, 128256
ATTENTION = {"batch": 1, "heads": 32, "seq": 8192, "head_dim": 128, "causal": True, "dtype": "bf16"}


def is_session(folder: Path) -> bool:
    return (Path(folder) / "micro.json").is_file()


def _row(source: dict) -> dict | None:
    name, kind = source["name"], source["kind"]
    if kind == "gemm":
        kernel, params = "gemm", {"m": source["m"], "n": source["n"], "k": source["k"], "dtype": "bf16",
                                  "layout": ROLE_LAYOUTS.get(source.get("role"), "nn")}
    elif kind == "attention":
        params = {**ATTENTION, "direction": "forward" if source.get("role") == "fwd" else "backward"}
        kernel = "attention"
    elif name.startswith("rms_norm"):
        kernel, params = "rms_norm", {"shape": [T, D], "dtype": "bf16"}
    elif name.startswith("silu"):
        kernel, params = "pointwise", {"shape": [T, FF], "dtype": "bf16"}
    elif name.startswith("cross_entropy"):
        kernel, params = "cross_entropy", {"shape": [T, V], "dtype": "fp32"}
    elif name.startswith("bf16->fp32"):
        kernel, params = "cast", {"shape": [T, V], "dtype": "bf16", "to": "fp32"}
    elif kind == "copy":
        kernel, params = "copy", {"numel": source["bytes"] // 2 // 2, "dtype": "bf16"}
    elif kind == "optimizer":
        kernel, params = "optimizer", {"optimizer": "adamw", "shapes": [list(s) for s in microbench.LLAMA3_8B_BLOCK],
                                       "dtype": "fp32"}
    else:
        return None
    return {"kernel": kernel, "params": params, "seconds": source["median_s"], "min_s": source.get("min_s"),
            "max_s": source.get("max_s"), "name": name}


def read_session(folder: Path) -> dict:
    """The session folder's measurements in calibrate's format."""
    folder = Path(folder)
    micro = json.loads((folder / "micro.json").read_text())
    env = micro["env"]
    torch_version = env.get("torch", "")
    part = next((k for k in sorted(COMPUTE_CAPABILITY, key=len, reverse=True) if k in env.get("name", "").upper()),
                None)
    cc = COMPUTE_CAPABILITY.get(part) if part else None
    rows = [r for r in (_row(s) for s in micro["rows"]) if r is not None]
    backend = sdpa.choose(microbench.DTYPES["bf16"], ATTENTION["head_dim"], int(cc.split(".")[0]) if cc else 9,
                          torch_version)
    for row in rows:
        if row["kernel"] == "attention":
            row["params"]["backend"] = backend
    out = {"format": MEASUREMENT_FORMAT, "source": str(folder),
           "env": {"name": env.get("name"), "torch": torch_version, "memory_bytes": env.get("mem"),
                   "sm_count": env.get("sms"), "compute_capability": cc, "cudnn": env.get("cudnn"),
                   "power_limit_w": _power_limit(folder / "env.txt")},
           "kernels": rows, "sustained": _sustained(folder, micro)}
    host = folder / "host.json"
    if host.is_file():
        out["host"] = {k: v for k, v in json.loads(host.read_text()).items() if k != "torch"}
    return out


def _power_limit(env_txt: Path) -> float | None:
    if not env_txt.is_file():
        return None
    found = re.search(r"(\d+)W\s*/\s*(\d+)W", env_txt.read_text())
    return float(found.group(2)) if found else None


def _sustained(folder: Path, micro: dict) -> dict:
    log = folder / "micro.log"
    windows = []
    if log.is_file():
        for line in log.read_text().splitlines():
            found = re.search(r"sustained (\S+) (\w+), window \d+: ([\d.]+) TFLOP/s over ([\d.]+) s", line)
            if found:
                windows.append({"tflops": float(found.group(3)), "seconds": float(found.group(4))})
    burst = next((r for r in micro["rows"] if r["name"].startswith("mm 8192^3")), None)
    out = {"params": {"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16"}, "windows": windows,
           "burst_tflops": burst["flops"] / burst["median_s"] / 1e12 if burst else None}
    smi = folder / "smi.csv"
    if smi.is_file():
        with smi.open() as f:
            samples = list(csv.reader(f))[1:]
        idle = [float(r[3].split()[0]) for r in samples
                if r[5].strip() == "0 %" and float(r[6].split()[0]) > 0]
        if idle:
            out["idle_power_w"] = statistics.median(idle)
    return out
