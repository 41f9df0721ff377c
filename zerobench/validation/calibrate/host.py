"""The host's costs per call (microseconds, host.json's keys): a stand-in of one function
for calibrate's host section until the host model's own measurement lands. It times the
eager calls host.json names that need no engine: an operator with and without a kernel,
a small ``F.linear``, ``torch.empty``, and on a GPU ``Event.record``,
``Stream.wait_event``, ``with torch.cuda.stream(s)`` and ``record_stream``; each the
enqueue time of a loop of calls, the device synchronised after it.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def _per_call_us(call, device: torch.device, n: int) -> float:
    for _ in range(min(n, 50)):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(n):
        call()
    elapsed = time.perf_counter() - started
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return elapsed / n * 1e6


def measure(device: torch.device, budget_s: float) -> dict:
    """host.json-shaped per-call costs on ``device`` (microseconds), within about ``budget_s``."""
    n = max(100, min(20000, int(budget_s * 2000)))
    x = torch.zeros(256, device=device)
    w = torch.zeros(64, 64, device=device)
    a = torch.zeros(8, 64, device=device)
    out = {"torch": torch.__version__,
           "python_noop_us": _per_call_us(lambda: None, device, n),
           "add_out_of_place_us": _per_call_us(lambda: x + 1, device, n),
           "add_inplace_us": _per_call_us(lambda: x.add_(1), device, n),
           "linear_small_us": _per_call_us(lambda: F.linear(a, w), device, n),
           "empty_alloc_us": _per_call_us(lambda: torch.empty(256, device=device), device, n)}
    if device.type == "cuda":
        stream, event = torch.cuda.Stream(device), torch.cuda.Event()

        def in_stream():
            with torch.cuda.stream(stream):
                pass

        out.update(event_record_us=_per_call_us(event.record, device, n),
                   wait_event_us=_per_call_us(lambda: stream.wait_event(event), device, n),
                   stream_ctx_us=_per_call_us(in_stream, device, n),
                   record_stream_us=_per_call_us(lambda: x.record_stream(stream), device, n))
    return out
