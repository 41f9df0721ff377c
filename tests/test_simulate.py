"""The simulator's schedule rules on hand-made schedules whose answers are worked out
by hand in the comments (times in ms; every all-gather and reduce-scatter of a unit
takes 4 ms: 8e6 bytes over 2 ranks on a 1 GB/s, zero-latency link)."""

import json
import os
import subprocess
import sys

import pytest

from zerobench.instruments.link import Link
from zerobench.whatif.simulate import Knobs, Schedule, Unit, simulate

LINK = Link(1.0, 0.0)
MB8 = 8_000_000
MS = 1e-3


def sched(n_units=2, engine="impl-fsdp", fwd=10, bwd=10, **knobs) -> Schedule:
    units = [Unit(f"u{i}", MB8, fwd * MS, bwd * MS) for i in range(n_units)]
    return Schedule(engine=engine, world_size=2, units=units, optimizer_s=0.0, knobs=Knobs(**knobs))


def ms(x):
    return round(x / MS, 6)


def test_forward_prefetch_hides_all_but_the_first_gather():
    # no prefetch: AG0 [0,4] F0 [4,14] AG1 [14,18] F1 [18,28]; backward AG1 [28,32]
    # B1 [32,42] RS1 [42,46] B0 [42,52] RS0 [52,56]
    off = simulate(sched(forward_prefetch=False), LINK)
    assert ms(off.step_time_s) == 56
    # prefetch: AG1 issued with AG0, [4,8], hidden under F0 [4,14]: one gather less exposed
    on = simulate(sched(forward_prefetch=True), LINK)
    assert ms(on.step_time_s) == 52
    # exposed: AG0 (first gather), AG1 in backward, RS0 at the end
    assert ms(on.exposed_comm_s) == 12
    assert ms(on.comm_s) == 20
    assert on.overlap_ratio == pytest.approx(8 / 20)


def test_backward_prefetch_pre_post_none():
    # 3 units, forward: AG0 F0 AG1 F1 AG2 F2 ends at 42. Backward:
    # pre:  AG2 [42,46] AG1 [46,50] B2 [46,56] RS2 [56,60] B1 [56,66] RS1 B0 [66,76] RS0 [76,80]
    # post: AG2 [42,46] B2 [46,56] AG1 [56,60] RS2 [60,64] B1 [60,70] B0 [70,80] RS0 [80,84]
    # none: AG2 [42,46] B2 [46,56] RS2 [56,60] AG1 [60,64] B1 [64,74] B0 [74,84] RS0 [84,88]
    got = {p: ms(simulate(sched(3, backward_prefetch=p), LINK).step_time_s) for p in ("pre", "post", "none")}
    assert got == {"pre": 80, "post": 84, "none": 88}


def test_limiter_depth_one_defers_the_prefetch_until_a_free():
    # forward prefetch, 3 units: AG0 [0,4] (root: no ticket), AG1 [4,8] (ticket), F0 [4,14];
    # unit 1's prefetch of AG2 is deferred (1 ticket out) until unit 1 frees at 24:
    # AG2 [24,28], F2 [28,38] instead of AG2 [14,18], F2 [24,34] without the limiter.
    free = simulate(sched(3, forward_prefetch=True, backward_prefetch="none"), LINK)
    lim = simulate(sched(3, forward_prefetch=True, backward_prefetch="none", limit_all_gathers=True,
                         limiter_depth=1), LINK)
    assert ms(lim.step_time_s - free.step_time_s) == 4
    # the limiter bounds the unsharded units alive: root + 1 ticket
    assert lim.max_unsharded_units <= 2 < free.max_unsharded_units
    deep = simulate(sched(3, forward_prefetch=True, backward_prefetch="none", limit_all_gathers=True,
                          limiter_depth=2), LINK)
    assert ms(deep.step_time_s) == ms(free.step_time_s)


def test_blocking_collectives_hide_nothing():
    # Each collective blocks the thread (PyTorch's FSDPs on CPU). Forward: AG0 [0,4] F0
    # [4,14] AG1 [14,18] F1 [18,28] (unit 1 freed, the root kept); backward: AG1 [28,32]
    # B1 [32,42] RS1 [42,46] B0 [46,56] RS0 [56,60]: every collective exposed, 40 + 5 x 4.
    plain = simulate(sched(backward_prefetch="none", blocking_collectives=True), LINK)
    assert ms(plain.step_time_s) == 60 and ms(plain.exposed_comm_s) == 20
    # prefetching moves a wait earlier but hides nothing: the same 60 ms; the same
    # schedule with asynchronous collectives hides AG1 under F0 and RS1 under B0: 52
    pre = simulate(sched(forward_prefetch=True, backward_prefetch="pre", blocking_collectives=True), LINK)
    assert ms(pre.step_time_s) == 60 and ms(pre.exposed_comm_s) == 20
    assert ms(simulate(sched(forward_prefetch=True, backward_prefetch="pre"), LINK).step_time_s) == 52


def test_shard_grad_op_and_no_shard():
    # SHARD_GRAD_OP: no backward all-gathers. Forward AG0 [0,4] F0 [4,14] AG1 [14,18]
    # F1 [18,28]; B1 [28,38] RS1 [38,42] B0 [38,48] RS0 [48,52]
    sgo = simulate(sched(sharding_strategy="SHARD_GRAD_OP"), LINK)
    assert ms(sgo.step_time_s) == 52
    assert sgo.max_unsharded_units == 2
    # NO_SHARD: all-reduce 8e6 bytes, factor 2(n-1)/n = 1: 8 ms. F 20, B1 [20,30]
    # AR1 [30,38] B0 [30,40] AR0 [40,48]
    assert ms(simulate(sched(sharding_strategy="NO_SHARD"), LINK).step_time_s) == 48


def test_reshard_after_forward_false_keeps_units():
    a = simulate(sched(4, engine="torch-fsdp2", reshard_after_forward=True), LINK)
    b = simulate(sched(4, engine="torch-fsdp2", reshard_after_forward=False), LINK)
    # True: root + the unit in backward + its prefetch (3); False: all 4 held from forward on
    assert b.step_time_s < a.step_time_s and b.max_unsharded_units > a.max_unsharded_units


def test_hybrid_shard_uses_two_links():
    s = sched(sharding_strategy="HYBRID_SHARD", gpus_per_node=2)
    r = simulate(s, LINK, world_size=4, inter_link=Link(0.5, 0.0))
    assert set(r.link_utilisation) == {"intra", "inter"}
    assert r.link_utilisation["inter"] > 0


def test_ddp_bucketing_overlaps_backward():
    # DDP, all-reduce per unit (8 ms each): F 20, B1 [20,30] AR1 [30,38] B0 [30,40] AR0 [40,48]
    small = simulate(sched(engine="ddp", bucket_mb=1), LINK)
    assert ms(small.step_time_s) == 48
    # one bucket: AR of 16e6 bytes after B0 at 40: 16 ms -> 56
    one = simulate(sched(engine="ddp", bucket_mb=1000), LINK)
    assert ms(one.step_time_s) == 56


def test_zero_gathers_parameters_after_the_step():
    # ZeRO-2: RS per unit 4 ms: B1 [20,30] RS1 [30,34] B0 [30,40] RS0 [40,44]; all-gather of
    # 16e6 bytes, factor 1/2: 8 ms -> 52
    r = simulate(sched(engine="impl-zero", bucket_mb=1, zero_stage=2), LINK)
    assert ms(r.step_time_s) == 52


def test_world_size_and_compute_scale():
    s = sched(forward_prefetch=True)
    base = simulate(s, LINK)
    faster = simulate(s, LINK, compute_scale=2.0)
    assert ms(faster.compute_s) == ms(base.compute_s) / 2
    # 8 ranks: factor 7/8 instead of 1/2 -> every collective 7 ms instead of 4
    wide = simulate(s, LINK, world_size=8)
    assert ms(wide.comm_s) == pytest.approx(ms(base.comm_s) * 7 / 4)


def test_schedule_json_round_trip_and_errors(tmp_path):
    s = sched(3, forward_prefetch=True)
    p = tmp_path / "s.json"
    p.write_text(s.to_json())
    assert simulate(Schedule.load(p), LINK).step_time_s == simulate(s, LINK).step_time_s
    d = json.loads(s.to_json())
    d["knobs"]["backward_prefetch"] = "sideways"
    with pytest.raises(ValueError, match="backward_prefetch.*allowed"):
        Schedule.from_dict(d)
    d["knobs"]["backward_prefetch"] = "pre"
    d["engine"] = "megatron"
    with pytest.raises(ValueError, match="engine"):
        Schedule.from_dict(d)


def test_imports_and_runs_without_torch():
    code = r"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked")
sys.meta_path.insert(0, Block())
from zerobench.instruments.link import Link
from zerobench.whatif.simulate import Knobs, Schedule, Unit, simulate
s = Schedule("impl-fsdp", 2, [Unit("a", 1000, 0.01, 0.02), Unit("b", 1000, 0.01, 0.02)], 0.001, Knobs())
r = simulate(s, Link(1.0, 1.0))
assert r.step_time_s > 0.06
assert "torch" not in sys.modules
print("ok")
"""
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# ---- extraction and the command line, on the checked-in FSDP2 traces (3 blocks of
# two 64x64 linears: 2 * (64*64 + 64) * 4 = 33280 bytes per unit)
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
CELL = "torch-fsdp2-ws2-fp32"


def _run_folder(tmp_path):
    import shutil

    (tmp_path / "traces").mkdir()
    (tmp_path / "cells").mkdir()
    for r in (0, 1):
        shutil.copy(os.path.join(DATA, f"fsdp2.rank{r}.json.gz"), tmp_path / "traces" / f"{CELL}.rank{r}.json.gz")
    (tmp_path / "cells" / f"{CELL}.json").write_text(json.dumps(
        {"config": {"engine": "torch-fsdp2", "world_size": 2, "reshard_after_forward": True}}))
    return tmp_path


def test_extract_units_from_a_trace(tmp_path):
    from zerobench.analysis.profiling.overlap import compute_intervals, step_windows
    from zerobench.analysis.profiling.trace import load_trace
    from zerobench.whatif.simulate.extract import extract_cell, trace_steps

    s = extract_cell(_run_folder(tmp_path), CELL)
    assert [u.param_bytes for u in s.units] == [33280] * 3
    assert s.engine == "torch-fsdp2" and s.knobs.reshard_after_forward is True
    assert all(u.forward_s > 0 and u.backward_s > 0 for u in s.units) and s.optimizer_s > 0
    # the per-unit split keeps the step's busy time: forward + backward + optimizer of one
    # traced step lies between its aten compute and the step's length
    t = load_trace(os.path.join(DATA, "fsdp2.rank0.json.gz"))
    st = trace_steps(t)[0]
    w = step_windows(t).iloc[0]
    from zerobench.analysis.profiling import intervals as iv

    comp = iv.clip(compute_intervals(t), w.ts, w.end)
    total = float((comp[:, 1] - comp[:, 0]).sum()) * 1e-6
    got = sum(st["forward"]) + sum(st["backward"]) + st["optimizer"]
    assert 0.8 * total <= got <= (w.end - w.ts) * 1e-6
    # fully_shard calls its collectives with async_op=False: on a CPU trace they block
    assert s.knobs.blocking_collectives is True and s.source["device"] == "cpu"
    # what the validation compares with: the traced step, and the time the main thread
    # was blocked on communication, which is part of it
    m = s.measured
    assert 0 < m["blocked_comm_s"] < m["traced_step_s"]
    # the real transport under any emulation: gloo's own time per collective kind
    assert set(m["transport_s"]) == {"all_gather", "reduce_scatter"} and all(v > 0 for v in m["transport_s"].values())
    from zerobench.whatif.simulate.against import emulation_margin

    ag = m["transport_s"]["all_gather"]
    # 33280 B over 2 ranks, bus factor 1/2: a link of 16640 B / ag seconds takes as long as gloo did
    assert emulation_margin(s, Link(16640 / ag / 1e9 / 10, 0.0)) == pytest.approx(
        10 * min(1.0, ag / m["transport_s"]["reduce_scatter"]), rel=1e-6)
    assert m["blocked_comm_s"] == pytest.approx(
        m["traced_step_s"] - sum(u.forward_s + u.backward_s for u in s.units) - s.optimizer_s, abs=2e-3)


def test_cli_simulate_world_sizes(tmp_path):
    import pandas as pd

    from zerobench.cli import main

    run = _run_folder(tmp_path)
    assert main(["simulate", str(run), "--link", "pcie4", "--world-sizes", "2", "8", "--no-plots"]) == 0
    assert (run / "schedules" / f"{CELL}.json").exists()
    pred = pd.read_csv(run / "simulate" / "pcie4_ws2-8" / "predictions.csv")
    assert list(pred["world_size"]) == [2, 8]
    # bus factor (n-1)/n: 7/8 on 8 ranks against 1/2 on 2, latency the same
    assert pred["comm_s"].iloc[1] > pred["comm_s"].iloc[0]
    assert main(["simulate", str(run), "--gbps", "1", "--matrix", "--no-plots"]) == 0
    mat = pd.read_csv(run / "simulate" / "1gbps-0us" / "matrix.csv")
    assert mat["setting"].nunique() == 4 and mat["gbps"].nunique() == 5
    assert main(["simulate", str(run), "--cell", "nope", "--gbps", "1"]) == 2


def test_cli_simulate_refuses_bad_world_sizes_and_asks_for_a_link(tmp_path, capsys):
    from zerobench.cli import main

    run = _run_folder(tmp_path)
    assert main(["simulate", str(run), "--link", "pcie4", "--world-sizes", "0", "--no-plots"]) == 2
    assert "--world-sizes: 0 is not allowed (allowed: ints >= 1)" in capsys.readouterr().err
    # a cell run without emulation records emulate_gbps = 0.0: there is no link to re-time it on
    record = json.loads((run / "cells" / f"{CELL}.json").read_text())
    record["config"].update(emulate_link="", emulate_gbps=0.0, emulate_latency_us=0.0)
    (run / "cells" / f"{CELL}.json").write_text(json.dumps(record))
    assert main(["simulate", str(run), "--no-plots"]) == 2
    assert "measured without an emulated link; give --link" in capsys.readouterr().err


def test_cross_validation_predicts_each_cell_from_the_others(tmp_path):
    import pandas as pd

    from zerobench.whatif.simulate.against import cross_validate, validation_summary

    def cell(name, engine="impl-fsdp", fwd=10, **knobs):
        s = sched(3, engine=engine, fwd=fwd, **knobs)
        s.cell_id = name
        s.source = {"emulate_gbps": 1.0, "emulate_latency_us": 0.0}
        r = simulate(s, LINK)
        s.measured = {"step_time_s": r.step_time_s, "blocked_comm_s": r.exposed_comm_s}
        return s

    cells = {"off": cell("off"), "pre": cell("pre", forward_prefetch=True, backward_prefetch="pre"),
             "slow": cell("slow", fwd=20), "ddp": cell("ddp", engine="ddp")}
    df = cross_validate(cells, tmp_path)
    # pairs within an engine only: 3 impl-fsdp cells -> 6 pairs, the lone ddp cell none
    assert len(df) == 6 and set(df["engine"]) == {"impl-fsdp"}
    # same compute, other knobs: the model reproduces its own measurement exactly
    exact = df[df["source"].isin(["off", "pre"]) & df["target"].isin(["off", "pre"])]
    assert len(exact) == 2 and (exact["step_error"].abs() < 1e-9).all()
    # the slow cell's forward (3 x 20 ms against 3 x 10) is not in the fast cells' schedule
    wrong = df[(df["source"] == "off") & (df["target"] == "slow")]
    assert float(wrong["step_error"].iloc[0]) < -0.1
    assert "| impl-fsdp | all | 6 |" in (tmp_path / "cross.md").read_text()
    assert (tmp_path / "cross.csv").exists()
    pred = pd.DataFrame({"step_error": [0.1, -0.2, 0.0], "exposed_error": [0.3, 0.05, float("nan")],
                         "no_overlap_error": [0.5, 0.1, 0.2]})
    summary = validation_summary(pred)
    assert summary[0].startswith("all cells: step time within 15%: 2 of 3 (")
    assert "exposed communication within 20%: 1 of 2" in summary[0] and len(summary) == 1
    pred["emulation_margin"] = [3.0, 1.0, 2.5]
    assert validation_summary(pred)[1].startswith("cells whose emulated link is >= 2x the transport: step time "
                                                  "within 15%: 2 of 2")


CURATED = os.path.join(os.path.dirname(__file__), "..", "results", "curated", "20261123-144741-simulate-validation")


def test_curated_validation_replays_from_its_schedules(tmp_path):
    """docs/simulate.md quotes this run's validation: its stored schedules (no traces)
    reproduce validation.md and cross.md exactly, and the bar holds where it is claimed."""
    import shutil

    from zerobench.whatif.simulate.run import simulate_run

    for name in ("results.csv", "meta.json", "workload.json", "schedules"):
        src = os.path.join(CURATED, name)
        (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, tmp_path / name)
    pred, _ = simulate_run(tmp_path, plots=False, cross=True)
    for part in ("measured-link/validation.md", "cross/cross.md"):
        with open(os.path.join(CURATED, "simulate", part)) as f:
            assert (tmp_path / "simulate" / part).read_text() == f.read(), part
    # every impl-fsdp cell on the two slowest links: step within 15 %, exposed within 20 %
    impl = pred[(pred["engine"] == "impl-fsdp") & pred["link"].str.startswith(("0.02 ", "0.05 "))]
    assert len(impl) == 12
    assert (impl["step_error"].abs() <= 0.15).all() and (impl["exposed_error"].abs() <= 0.20).all()


def test_the_table_shows_the_measured_step_beside_every_what_if_and_the_profilers_cost():
    """On another link the measured column is the step as the cell ran (no error: it is
    not the same setting); a traced step longer than the timed one is said under the table."""
    import pandas as pd

    from zerobench.analysis.render import text
    from zerobench.commands.simulate import prediction_table

    pred = pd.DataFrame([{"cell_id": "ddp-ws2-fp32", "world_size": 2, "link": "ib-400g (50 GB/s, 20 us)",
                          "step_time_s": 0.30, "exposed_comm_s": 0.001, "overlap_ratio": 0.5,
                          "max_unsharded_units": 1, "as_run_step_s": 0.25, "as_run_traced_step_s": 0.35,
                          "as_run_link": "no emulated link"}])
    shown = text(prediction_table(pred), 120)
    assert "measured step ms" in shown and "250" in shown and "step error" not in shown
    assert "simulated on ib-400g" in shown and "ran 40 % longer" in shown
