"""The virtual GPU's host ([Note: host cost] in zerobench/instruments/vgpu/host.py): the
prices taken from host.json, the one fitted figure and its held-out check, the counter
of Python calls (what it counts, what it leaves out, that it keeps counting), the host
clock charged for what was counted, and the host measurement of calibrate on a CPU."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from zerobench.instruments.vgpu import VirtualGpu, host
from zerobench.instruments.vgpu.host import HostPreset, from_measurements

US = 1e-6
ROOT = Path(__file__).resolve().parents[1]
H200 = host.MEASURED["h200-host"]


@pytest.fixture(scope="module")
def measured() -> dict:
    return host.load_measurements(*H200)


def _noop():
    return None


def _calls(n: int) -> None:
    for _ in range(n):
        _noop()


# -- prices ------------------------------------------------------------------------------


def test_prices_are_differences_of_measured_calls(measured):
    """Each price is worked out from two measured calls: x + 1 allocates what x.add_(1)
    does not; torch.empty is an operator without a kernel that allocates; F.linear is a
    view and a GEMM."""
    p = from_measurements(measured)
    us = {k: v for k, v in measured.items() if k.endswith("_us")}
    alloc = us["add_out_of_place_us"] - us["add_inplace_us"]
    dispatch = us["empty_alloc_us"] - alloc
    launch = us["add_inplace_us"] - dispatch
    assert p.alloc_s == pytest.approx(alloc * US)
    assert p.dispatch_s == pytest.approx(dispatch * US)
    assert p.launch_s == pytest.approx(launch * US)
    assert p.gemm_s == pytest.approx((us["linear_small_us"] - 2 * dispatch - launch - alloc) * US)
    assert p.event_record_s == pytest.approx(us["event_record_us"] * US)
    assert p.wait_stream_s == pytest.approx((us["event_record_us"] + us["wait_event_us"]) * US)
    assert p.stream_switch_s == pytest.approx(us["stream_ctx_us"] * US)
    assert p.collective_s == pytest.approx(us["all_gather_1mib_ws1_us"] * US)
    assert p.collective_wait_s == pytest.approx((us["all_gather_1mib_ws1_async_wait_us"]
                                                 - us["all_gather_1mib_ws1_us"]) * US)
    # an eager x + 1 costs what it was measured to cost: one operator, its kernel, its output
    assert (p.dispatch_s + p.launch_s + p.alloc_s) / US == pytest.approx(us["add_out_of_place_us"])


def test_fitted_programs_and_the_held_out_one(measured):
    """The line and foreach prices are fitted on the plain and fully_shard steps; FSDP1's
    step, held out, checks the model (its error is documented in docs/vgpu.md)."""
    report = {r["program"]: r for r in host.fit_report(measured)}
    assert report["fsdp1_mlp8"]["role"] == "held out"
    for row in report.values():
        assert abs(row["error"]) < 0.15, row
    # the fit moves with the measurements: a host twice as slow more than doubles what is fitted
    slower = {**measured, **{f"{p}_step_us": 2 * measured[f"{p}_step_us"] for p in host.FITTED}}
    assert from_measurements(slower).python_line_s > 2 * from_measurements(measured).python_line_s


def test_the_fit_recovers_the_prices_a_made_up_host_has(measured):
    """Steps made from the counts at known prices (0.3 us a line, 2 us a foreach tensor):
    the fit gives those prices back, and the held-out program is then exact too."""
    units = from_measurements(measured).units()
    made_up = {**units, "python_line": 0.3 * US, "foreach_tensor": 2 * US}
    steps = {f"{p}_step_us": sum(n * made_up[k] for k, n in c.items()) / US for p, c in measured["counts"].items()}
    preset = from_measurements({**measured, **steps})
    assert preset.python_line_s == pytest.approx(0.3 * US)
    assert preset.foreach_tensor_s == pytest.approx(2 * US)
    assert all(abs(r["error"]) < 1e-9 for r in host.fit_report({**measured, **steps}, preset))


def test_a_kind_the_programs_cannot_carry_is_zero_not_negative(measured):
    """A host whose fully_shard step is barely slower than its plain one: the two-kind fit
    would price one kind below zero; that kind is 0 and the other is fitted alone."""
    faster = {**measured, "fsdp2_mlp8_step_us": measured["plain_mlp8_step_us"] * 1.5}
    preset = from_measurements(faster)
    assert preset.python_line_s >= 0 and preset.foreach_tensor_s >= 0
    assert 0.0 in (preset.python_line_s, preset.foreach_tensor_s)


def test_the_shipped_host_is_built_from_the_h200_measurements(measured):
    source = json.loads(H200[0].read_text())["host"]["source"]
    assert host.HOST_PRESETS["h200-host"] == from_measurements(measured, name="h200-host", source=source)
    # the h200 preset file carries the H200's host.json, figure for figure
    recorded = json.loads((ROOT / "results" / "gpu" / "h200-20261126" / "host.json").read_text())
    assert {k: measured[k] for k in recorded if k != "torch"} == {k: v for k, v in recorded.items() if k != "torch"}


@pytest.mark.parametrize("change, message", [
    (lambda m: m.pop("event_record_us"), "'event_record_us' is missing"),
    (lambda m: m.update(add_inplace_us=-1.0), "add_inplace_us -1.0 is not allowed"),
    (lambda m: m["counts"].pop("fsdp2_mlp8"), "'counts' must give"),
])
def test_bad_measurements_are_refused_naming_the_field(measured, change, message):
    broken = json.loads(json.dumps(measured))
    change(broken)
    with pytest.raises(ValueError, match=message):
        from_measurements(broken)


def test_a_preset_refuses_a_negative_price():
    with pytest.raises(ValueError, match="python_line_s -1e-06 is not allowed"):
        HostPreset("bad", dispatch_s=1e-6, launch_s=1e-6, python_line_s=-1e-6)


def test_a_prediction_runs_on_the_gpu_presets_host_or_the_measured_one():
    from zerobench.instruments.vgpu.presets import gpu_preset

    assert host.host_for(gpu_preset("h200")).name == "h200-host"
    assert host.host_for(gpu_preset("h200"), "slow").name == "slow"
    with pytest.raises(ValueError, match=r"host: nonsense is not allowed \(allowed: fast, slow, h200-host\)"):
        host.host_for(gpu_preset("h200"), "nonsense")


# -- the counter of Python calls ---------------------------------------------------------

COUNTING = HostPreset("counting", dispatch_s=0.0, launch_s=0.0, python_frame_s=1 * US)
FRAME, LINE, GENERATOR, C_CALL, TORCH_CALL = range(len(host.PYTHON_KINDS))


def test_python_calls_are_counted_and_charged_before_the_next_operator():
    """Ten calls of a function of this file, then an operator: the host clock has charged
    the ten calls (1 us each) when the operator is dispatched, and the trace shows them."""
    x = torch.ones(4)
    gpu = VirtualGpu(gpu="h100-sxm", host=COUNTING)
    with gpu:
        start = gpu.host.now
        _calls(10)
        x.add_(1)
        elapsed = gpu.host.now - start
    # _calls, then _noop ten times; nothing else of the program's ran between the two reads
    assert elapsed == pytest.approx(11 * US)
    assert gpu.host_counts["python_frame"] >= 11
    assert any(name == "python" and (args or {}).get("python_frame") == 11 for _, name, _, _, args in gpu.trace.spans)


def _three_lines(x):
    y = x + 1
    z = y * 2
    return z


def _early(x):
    if x:
        return 1
    a = 2
    b = a + 3
    return b


def _generator():
    while True:
        yield 1


def test_each_kind_of_python_work_is_counted_apart():
    """Lines run up to the return (a loop's body once, an early return's lines only), a
    generator's entries, C builtins, and torch C entries that dispatch no operator (one
    that dispatches is the operator's)."""
    t = torch.ones(4)
    gen = _generator()
    gpu = VirtualGpu(gpu="h100-sxm", host=COUNTING)
    with gpu:
        counts = gpu.python.counts
        before = list(counts)
        _three_lines(1)
        assert [counts[FRAME] - before[FRAME], counts[LINE] - before[LINE]] == [1, 3]
        before = list(counts)
        _early(True)
        assert [counts[FRAME] - before[FRAME], counts[LINE] - before[LINE]] == [1, 2]
        before = list(counts)
        for _ in range(3):
            next(gen)
        assert counts[GENERATOR] - before[GENERATOR] == 3 and counts[C_CALL] - before[C_CALL] == 3
        before = list(counts)
        len([1, 2])
        isinstance(t, int)
        assert counts[C_CALL] - before[C_CALL] == 2 and counts[TORCH_CALL] == before[TORCH_CALL]
        before = list(counts)
        t.dim()
        torch.is_grad_enabled()
        assert counts[TORCH_CALL] - before[TORCH_CALL] == 2 and counts[C_CALL] == before[C_CALL]
        before = list(counts)
        t.add(1)  # an operator: priced as one, not as a torch C entry
        assert counts[TORCH_CALL] == before[TORCH_CALL]


def test_a_foreach_operator_costs_the_host_per_tensor_in_its_lists():
    toy = HostPreset("toy", dispatch_s=1 * US, launch_s=0.0, foreach_tensor_s=0.5 * US)
    tensors = [torch.ones(4) for _ in range(6)]
    gpu = VirtualGpu(gpu="h100-sxm", host=toy)
    with gpu:
        start = gpu.host.now
        torch._foreach_add_(tensors, tensors)  # one operator, twelve tensors
        assert gpu.host.now - start == pytest.approx(7 * US)
        assert gpu.host_counts["foreach_tensor"] == 12


def test_what_only_this_cpu_runs_is_not_counted():
    """The virtual GPU's own code (and what it calls), the standard library's frames and
    the garbage collector's pass are no program's work; counting goes on after each."""
    import fractions

    x = torch.ones(4)
    gpu = VirtualGpu(gpu="h100-sxm", host=COUNTING)
    with gpu:
        calls = gpu.python.counts
        before = calls[FRAME]
        for _ in range(20):
            x.mul_(2)          # dispatched: the modes' Python is paused or skipped
        gpu.synchronize()      # the virtual GPU's own Python: skipped
        fractions.Fraction(1, 3)  # the standard library's frames: not counted
        gc.collect()           # the collector's pass and its finalizers: not counted
        assert calls[FRAME] == before
        _calls(5)
        assert calls[FRAME] == before + 6  # and counting goes on
        assert gpu.python._depth == 0


def test_counting_stops_when_the_device_is_uninstalled():
    import sys

    previous = sys.getprofile()
    gpu = VirtualGpu(gpu="h100-sxm", host=COUNTING)
    with gpu:
        assert sys.getprofile() is not previous
    assert sys.getprofile() is previous
    calls = list(gpu.python.counts)
    _calls(3)
    assert gpu.python.counts == calls


def test_presets_without_a_python_price_count_nothing():
    gpu = VirtualGpu(gpu="h100-sxm", host="fast")
    assert gpu.python is None


# -- stream calls at their prices --------------------------------------------------------


def test_stream_calls_cost_their_measured_prices():
    """Event.record, wait_event, wait_stream, a stream switch, record_stream: each at
    its own price (round numbers, worked by hand)."""
    toy = HostPreset("toy", dispatch_s=0.0, launch_s=0.0, event_record_s=11 * US, wait_event_s=2 * US,
                     wait_stream_s=13 * US, stream_switch_s=20 * US, record_stream_s=1 * US)
    gpu = VirtualGpu(gpu="h100-sxm", host=toy)
    with gpu:
        side = gpu.Stream()
        event = gpu.Event()
        start = gpu.host.now
        event.record()                     # 11
        side.wait_event(event)             # + 2
        side.wait_stream(gpu.default)      # + 13
        with gpu.stream(side):             # + 20
            t = torch.empty(16)
        t.record_stream(side)              # + 1 (and the empty: 0 here)
        assert gpu.host.now - start == pytest.approx(47 * US)
        assert gpu.host_counts["stream_switch"] == 1 and gpu.host_counts["event_record"] == 1


# -- the programs and calibrate's host measurement ---------------------------------------


def test_the_stored_counts_are_those_of_this_torch():
    """zerobench/instruments/vgpu/host_counts.json holds what the plain program executes
    at this torch (regenerate it with ``python -m zerobench.validation.calibrate.host
    count``); the fitted host depends on it."""
    from zerobench.validation.calibrate.host import count_programs

    stored = json.loads(H200[1].read_text())
    assert stored["torch"] == torch.__version__
    assert count_programs(("plain_mlp8",))["plain_mlp8"] == stored["counts"]["plain_mlp8"]


def test_calibrate_measures_the_host_on_a_cpu_and_the_result_builds_a_preset(measured):
    """The calibrate path on a CPU: every figure host.json has, the loops the Python kinds
    are priced from, every program's step (the engines' adapters included) and DeepSpeed
    ZeRO-3's profile, measured here, and a host preset from them."""
    from zerobench.validation.calibrate.host import measure

    result = measure("cpu", budget_s=3.0, count=False)
    for key in (*host.REQUIRED, *host.PYTHON_LOOPS, "host_bytes_per_s", *(f"{p}_step_us" for p in host.PROGRAMS),
                *(f"{p}_aten_ops" for p in host.PROGRAMS)):
        assert key in result, (key, {k: v for k, v in result.items() if k.endswith("_error")})
        assert result[key] >= 0, key
    assert result["plain_mlp8_aten_ops"] == 175  # as the H200 counted it: the same program
    profile = result["deepspeed_zero3_mlp8_profile"]
    assert profile and any("deepspeed" in row["function"] for row in profile)
    assert all(row["own_us"] >= 0 and row["calls"] > 0 for row in profile)
    result["counts"] = json.loads(H200[1].read_text())["counts"]
    preset = from_measurements(result, name="this-cpu")
    # (a CPU runs its kernels in the call, so its operators may explain its whole step:
    # a fitted price is then 0, never negative)
    assert preset.python_line_s >= 0 and preset.foreach_tensor_s >= 0
    assert preset.bytes_per_s == result["host_bytes_per_s"]
    report = host.fit_report(result, preset)
    assert [r["program"] for r in report] == list(host.PROGRAMS)
    assert all(r["measured_us"] == result[f"{r['program']}_step_us"] for r in report)
    assert [r["role"] for r in report].count("fitted") == len(host.FITTED)


def test_calibrate_counts_the_programs_in_a_fresh_process_that_sees_no_gpu():
    """What measure() stores as ``counts``: the stored counts of this torch, made in a child
    process (a process that ran the programs, DeepSpeed's on a GPU, is not fresh)."""
    from zerobench.validation.calibrate.host import count_in_a_fresh_process

    assert count_in_a_fresh_process(("plain_mlp8",)) == {"plain_mlp8": json.loads(H200[1].read_text())["counts"]["plain_mlp8"]}


def test_a_program_that_fails_is_a_note_and_the_others_are_kept(monkeypatch):
    from zerobench.validation.calibrate import host as calibrate_host

    build = calibrate_host.build_program

    def failing(name, device):
        if name == "ddp_mlp8":
            raise RuntimeError("no such device")
        return build(name, device)

    monkeypatch.setattr(calibrate_host, "build_program", failing)
    result = calibrate_host.measure("cpu", budget_s=1.0, count=False, programs=("ddp_mlp8", "plain_mlp8"))
    assert result["ddp_mlp8_error"] == "RuntimeError: no such device"
    assert "ddp_mlp8_step_us" not in result and result["plain_mlp8_step_us"] > 0
    with pytest.raises(ValueError, match="programs: nonsense not allowed"):
        calibrate_host.measure("cpu", budget_s=1.0, count=False, programs=("nonsense",))


@pytest.mark.slow
def test_every_stored_count_is_that_of_this_torch():
    """All six programs, DeepSpeed's included (a minute on two cores)."""
    from zerobench.validation.calibrate.host import count_programs

    assert count_programs() == json.loads(H200[1].read_text())["counts"]


def test_python_calls_inside_python_uncounted_cost_nothing():
    gpu = VirtualGpu(gpu="h100-sxm", host=COUNTING)
    with gpu:
        start = gpu.host.now
        with gpu.python_uncounted():
            _calls(10)
        assert gpu.host.now == start
        _calls(2)
        assert gpu.host.now - start == pytest.approx(3 * US)


def test_a_predictions_measured_step_does_not_depend_on_what_ran_before(monkeypatch):
    """The first configuration a process predicts runs first-call code (caches filled,
    modules imported) that later ones do not: here, 200,000 calls more in its first
    warm-up. Its figures are bit for bit those it has the second time."""
    import dataclasses

    from zerobench.instruments.link import resolve_link
    from zerobench.rank.session import Session
    from zerobench.spec.workload import load_workload
    from zerobench.whatif.cells import select_configurations
    from zerobench.whatif.predict.job import predict_one

    warm_up, first = Session.warm_up, [True]

    def warm_up_first_call_code(self, *args, **kwargs):
        if first[0]:
            first[0] = False
            _calls(200_000)  # 0.8 s of host time: the measured step would start in another binade
        return warm_up(self, *args, **kwargs)

    monkeypatch.setattr(Session, "warm_up", warm_up_first_call_code)
    w = load_workload("workloads/ci-predict.toml")
    (cell,) = [dataclasses.replace(c, world_size=8) for c in select_configurations(w, None, [8])
               if c.config_id == "torch-fsdp2-bf16"]

    def row():
        out = predict_one(w, cell, "h100-sxm", None, resolve_link("pcie4"), None, 8)
        return {k: v for k, v in out.items() if k != "predict_wall_s"}

    once, again = row(), row()
    assert not first[0] and once["host_python_calls"] > 0
    assert again == once
