"""Overlap, step breakdown, collectives and in-flight counts on tiny hand-made traces
whose answers are worked out by hand in the comments."""

import math

import numpy as np
import pytest

from zerobench.analysis import profiling as zp
from zerobench.analysis.profiling.collective_table import bus_factor, busbw_gbps, dtype_bytes, kind_of

PID, MAIN, GLOO_A, GLOO_B = 100, 100, 101, 102


def X(name, ts, dur, tid=MAIN, cat="cpu_op", **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": PID, "tid": tid, "args": args}


def trace(events, world_size=2, rank=0):
    return zp.load_trace({"traceEvents": events, "distributedInfo": {"rank": rank, "world_size": world_size}})


def cpu_gloo_events():
    """One 100 us step on CPU (times in us; the step starts at ts=0 after parsing).

    compute (main thread aten ops): [10,30] and [25,40] -> [10,40]; [60,70]. The
      aten ops inside the c10d op at [5,8] are the collective's, not compute.
    comm (gloo worker threads): all-gather [8,35], reduce-scatter (gloo:all_reduce) [50,65].
    => compute 40, comm 42, overlapped [10,35] + [60,65] = 30, exposed [8,10] + [50,60] = 12,
       idle 100 - 40 - 12 = 48, overlap ratio 30/42.
    """
    return [
        X("zerobench::step", 0, 100, cat="user_annotation"),
        X("c10d::_allgather_base_", 5, 3, **{"Input Dims": [[8], [4], []], "Input type": ["float", "float", "Scalar"]}),
        X("aten::empty", 6, 1),
        X("gloo:all_gather", 8, 27, tid=GLOO_A, cat="user_annotation", **{"Input Dims": [[4]], "Input type": ["float"]}),
        X("aten::mm", 10, 20),
        X("aten::add", 25, 15),
        X("c10d::_reduce_scatter_base_", 45, 3, **{"Input Dims": [[4], [8]], "Input type": ["float", "float"]}),
        X("gloo:all_reduce", 50, 15, tid=GLOO_B, cat="user_annotation", **{"Input Dims": [[8]], "Input type": ["float"]}),
        X("aten::relu", 60, 10),
        X("aten::copy_", 52, 2, tid=GLOO_B),  # gloo's own copy: on a worker thread, not compute
    ]


def test_cpu_overlap_and_step_breakdown():
    t = trace(cpu_gloo_events())
    assert t.main_tid == MAIN
    np.testing.assert_array_equal(zp.comm_intervals(t), [[8, 35], [50, 65]])
    np.testing.assert_array_equal(zp.compute_intervals(t), [[10, 40], [60, 70]])
    (row,) = zp.step_breakdown(t).to_dict("records")
    us = 1e-6
    assert row["step_time_s"] == pytest.approx(100 * us)
    assert row["compute_s"] == pytest.approx(40 * us)
    assert row["comm_s"] == pytest.approx(42 * us)
    assert row["overlapped_s"] == pytest.approx(30 * us)
    assert row["exposed_comm_s"] == pytest.approx(12 * us)
    assert row["idle_s"] == pytest.approx(48 * us)
    assert row["overlap_ratio"] == pytest.approx(30 / 42)
    # No impl labels: the engine does not say where it waits.
    assert math.isnan(row["collective_wait_s"]) and math.isnan(row["limiter_wait_s"])
    hta = zp.comm_comp_overlap(t)
    assert hta.loc[0, "overlap_ratio"] == pytest.approx(30 / 42)


def test_cpu_collectives_pair_issue_with_gloo_run():
    coll = zp.collectives(trace(cpu_gloo_events()))
    assert list(coll["kind"]) == ["all_gather", "reduce_scatter"]  # gloo:all_reduce issued as reduce-scatter
    # nccl-tests sizes: the gathered output (8 floats), the full reduce-scatter input (8 floats).
    assert list(coll["bytes"]) == [32, 32]
    assert list(coll["duration_s"] * 1e6) == pytest.approx([27, 15])
    assert list(coll["issue_s"] * 1e6) == pytest.approx([5, 45])
    ag = coll.iloc[0]
    assert ag["algbw_gbps"] == pytest.approx(32 / 27e-6 / 1e9)
    assert ag["busbw_gbps"] == pytest.approx(ag["algbw_gbps"] * 0.5)


def test_torch_engine_in_flight_from_issue_to_run_end():
    # all-gather in flight from issue (5) to gloo end (35): never more than one here.
    t = trace(cpu_gloo_events())
    assert zp.max_all_gathers_in_flight(t) == 1
    extra = [X("c10d::_allgather_base_", 20, 2, **{"Input Dims": [[8], [4]], "Input type": ["float", "float"]}),
             X("gloo:all_gather", 36, 4, tid=GLOO_B, cat="user_annotation")]
    # The second one is issued at 20 while the first is still running (until 35).
    assert zp.max_all_gathers_in_flight(trace(cpu_gloo_events() + extra)) == 2


def test_fallback_to_c10d_spans_without_gloo_events():
    events = [e for e in cpu_gloo_events() if not e["name"].startswith("gloo:")]
    t = trace(events)
    np.testing.assert_array_equal(zp.comm_intervals(t), [[5, 8], [45, 48]])
    coll = zp.collectives(t)
    assert list(coll["duration_s"] * 1e6) == pytest.approx([3, 3])


def impl_events():
    """impl engine on CPU, one 100 us step: two all-gathers issued at 0 and 2, a third
    at 30 after the first wait; waits end at 20, 50, 60. In flight: 1, 2, 1 (at 20),
    2 (at 30), 1 (50), 0 (60). compute [20,30] and [60,90]; gloo runs [3,18], [4,45],
    [31,58]; the waits [15,20], [40,50], [55,60] are comm too. Limiter waits [29,30]."""
    ag = {"Input Dims": [[8], [4]], "Input type": ["float", "float"]}
    return [
        X("zerobench::step", 0, 100, cat="user_annotation"),
        X("impl::all_gather", 0, 1, cat="user_annotation"), X("c10d::_allgather_base_", 0.2, 0.5, **ag),
        X("impl::all_gather", 2, 1, cat="user_annotation"), X("c10d::_allgather_base_", 2.2, 0.5, **ag),
        X("gloo:all_gather", 3, 15, tid=GLOO_A, cat="user_annotation"),
        X("gloo:all_gather", 4, 41, tid=GLOO_B, cat="user_annotation"),
        X("impl::wait_all_gather", 15, 5, cat="user_annotation"),
        X("aten::mm", 20, 8),
        X("aten::add", 28, 2),
        X("impl::rate_limiter_wait", 29, 1, cat="user_annotation"),
        X("impl::all_gather", 30, 1, cat="user_annotation"), X("c10d::_allgather_base_", 30.2, 0.5, **ag),
        X("gloo:all_gather", 31, 27, tid=GLOO_A, cat="user_annotation"),
        X("impl::wait_all_gather", 40, 10, cat="user_annotation"),
        X("impl::wait_all_gather", 55, 5, cat="user_annotation"),
        X("aten::mm", 60, 30),
    ]


def test_impl_labels_in_flight_and_waits():
    t = trace(impl_events())
    inflight = zp.all_gathers_in_flight(t)
    assert list(inflight["in_flight"]) == [1, 2, 1, 2, 1, 0]
    assert list(inflight["time_s"] * 1e6) == pytest.approx([0, 2, 20, 30, 50, 60])
    assert set(inflight["source"]) == {"impl"}
    assert zp.max_all_gathers_in_flight(t) == 2
    (row,) = zp.step_breakdown(t).to_dict("records")
    us = 1e-6
    # compute: [20,29] (the limiter span [29,30] is not compute) and [60,90] = 39.
    assert row["compute_s"] == pytest.approx(39 * us)
    # comm: [3,20] u [4,45] u [31,58] u waits [15,20],[40,50],[55,60] = [3,60] = 57.
    assert row["comm_s"] == pytest.approx(57 * us)
    # hidden: [20,29] = 9; exposed 48; idle 100 - 39 - 48 = 13.
    assert row["overlapped_s"] == pytest.approx(9 * us)
    assert row["exposed_comm_s"] == pytest.approx(48 * us)
    assert row["idle_s"] == pytest.approx(13 * us)
    assert row["collective_wait_s"] == pytest.approx(20 * us)
    assert row["limiter_wait_s"] == pytest.approx(1 * us)


def test_emulated_interval_counts_as_comm():
    # With emulation the impl collectives, issued at 0, 2 and 30, each occupy the link
    # for 70 us (latency only), one at a time: [0,70], [70,140], [140,210].
    from zerobench.instruments.link import Link

    t = trace(impl_events())
    np.testing.assert_allclose(zp.comm_intervals(t, Link(1e9, 70.0)), [[0, 210]], atol=1e-6)


def test_steps_from_phases_when_no_step_label():
    events = [
        X("zerobench::forward", 0, 10, cat="user_annotation"), X("zerobench::backward", 10, 20, cat="user_annotation"),
        X("zerobench::optimizer", 30, 5, cat="user_annotation"),
        X("zerobench::forward", 50, 10, cat="user_annotation"), X("zerobench::backward", 60, 20, cat="user_annotation"),
        X("zerobench::optimizer", 80, 5, cat="user_annotation"), X("aten::mm", 1, 2),
    ]
    w = zp.step_windows(trace(events))
    assert w[["ts", "end"]].values.tolist() == [[0, 35], [50, 85]]


def test_gpu_trace_nccl_kernels_and_record_param_comms():
    """GPU: comm = NCCL kernels; compute = other kernels except memcpy/memset;
    bytes and group size from record_param_comms."""
    def K(name, ts, dur, cat="kernel"):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": 7, "args": {}}

    events = [
        X("zerobench::step", 0, 100, cat="user_annotation"),
        X("c10d::_allgather_base_", 1, 4, **{"Input Dims": [[2048], [512]], "Input type": ["c10::BFloat16"] * 2}),
        X("record_param_comms", 2, 1, **{"Collective name": "_allgather_base", "In msg nelems": 512,
                                          "Out msg nelems": 2048, "dtype": "BFloat16", "Group size": 4}),
        K("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgs)", 10, 40),
        K("ampere_sgemm_128x64_nn", 20, 50),
        K("Memcpy DtoD (Device -> Device)", 60, 30, cat="gpu_memcpy"),
        K("void at::native::memset_kernel", 80, 15),
    ]
    t = trace(events, world_size=8)
    np.testing.assert_array_equal(zp.comm_intervals(t), [[10, 50]])
    np.testing.assert_array_equal(zp.compute_intervals(t), [[20, 70]])
    (row,) = zp.step_breakdown(t).to_dict("records")
    assert row["overlap_ratio"] == pytest.approx(30 / 40)
    (c,) = zp.collectives(t).to_dict("records")
    assert c["kind"] == "all_gather" and c["bytes"] == 2048 * 2 and c["group_size"] == 4
    assert c["busbw_gbps"] == pytest.approx(4096 / 40e-6 / 1e9 * 3 / 4)


# -- bandwidth conventions (nccl-tests doc/PERFORMANCE.md) --------------------------------


@pytest.mark.parametrize("n, ag, ar", [(1, 0.0, 0.0), (2, 0.5, 1.0), (4, 0.75, 1.5), (8, 0.875, 1.75)])
def test_bus_factors(n, ag, ar):
    assert bus_factor("all_gather", n) == ag
    assert bus_factor("reduce_scatter", n) == ag
    assert bus_factor("all_reduce", n) == ar
    assert bus_factor("broadcast", n) == 1.0


def test_busbw_values():
    # 1 GB all-reduced in 1 s over 4 ranks: algbw 1 GB/s, busbw 2*(3/4) = 1.5 GB/s.
    assert busbw_gbps("all_reduce", 1e9, 1.0, 4) == pytest.approx(1.5)
    assert busbw_gbps("all_gather", 8e9, 2.0, 8) == pytest.approx(4 * 7 / 8)
    assert zp.algbw_gbps(1e9, 0.5) == pytest.approx(2.0)
    assert math.isnan(zp.algbw_gbps(1e9, 0.0))


def test_names_and_dtypes():
    assert kind_of("c10d::_reduce_scatter_base_") == "reduce_scatter"
    assert kind_of("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "reduce_scatter"
    assert kind_of("gloo:all_gather") == "all_gather"
    assert kind_of("c10d::allreduce_") == "all_reduce"
    assert kind_of("c10d::alltoall_base_") == "other"
    assert dtype_bytes("c10::BFloat16") == 2 and dtype_bytes("float") == 4 and dtype_bytes("Float") == 4
    assert math.isnan(dtype_bytes("TensorList"))


def test_list_based_all_gather_size_is_n_times_the_shard():
    # c10d::allgather_ (gloo, FSDP1) records its list-of-lists output without dims.
    events = [
        X("zerobench::step", 0, 100, cat="user_annotation"),
        X("c10d::allgather_", 1, 2, **{"Input Dims": [[], [[100]], [], []], "Input type": ["", "TensorList", "", "Scalar"]}),
        X("gloo:all_gather", 3, 10, tid=GLOO_A, cat="user_annotation", **{"Input Dims": [[100]], "Input type": ["float"]}),
    ]
    (c,) = zp.collectives(trace(events, world_size=4)).to_dict("records")
    assert c["kind"] == "all_gather" and c["bytes"] == 4 * 100 * 4


def test_fsdp1_rate_limiter_label_counts_as_limiter_wait():
    events = [X("zerobench::step", 0, 100, cat="user_annotation"),
              X("FullyShardedDataParallel.rate_limiter", 10, 7, cat="user_annotation"),
              X("aten::mm", 12, 3)]  # inside the limiter span: not compute
    (row,) = zp.step_breakdown(trace(events)).to_dict("records")
    assert row["limiter_wait_s"] == pytest.approx(7e-6)
    assert row["compute_s"] == 0.0
    assert math.isnan(row["collective_wait_s"])


def emulated_events():
    """One 1000 us step, two all-gathers of 8 floats on an emulated link of 100 us latency
    (bandwidth so high the bytes cost nothing): modelled 100 us each, served serially.

    ag0 issued at 5, waited [10,110]; compute [110,150]; ag1 issued at 20 (a prefetch),
    waited [150,210]. Serial link: ag0 [5,105], ag1 [105,205].
    Best exposed (see [Note: best achievable exposed comm]): ag0 has no compute before
    its use -> 100; ag1 has 40 us of compute between ag0's use and its own -> 60. 160.
    Measured exposed all-gather (the waits): 100 + 60 = 160.
    """
    ag = {"Input Dims": [[8], [4], []], "Input type": ["float", "float", "Scalar"]}
    return [
        X("zerobench::step", 0, 1000, cat="user_annotation"),
        X("c10d::_allgather_base_", 5, 2, **ag),
        X("zerobench::wait_all_gather", 10, 100, cat="user_annotation"),
        X("c10d::_allgather_base_", 20, 2, **ag),
        X("aten::mm", 110, 40),
        X("zerobench::wait_all_gather", 150, 60, cat="user_annotation"),
    ]


def test_serial_modelled_intervals_and_best_achievable_exposed():
    from zerobench.analysis.profiling.best import best_exposed_by_step, best_exposed_summary, link_from_config
    from zerobench.analysis.profiling.overlap import modelled_intervals
    from zerobench.instruments.link import Link

    t = trace(emulated_events())
    link = Link(1e9, 100.0)
    m = modelled_intervals(t, link)
    np.testing.assert_allclose(m[["start_s", "end_s"]].to_numpy() * 1e6, [[5, 105], [105, 205]], atol=1e-6)
    (row,) = best_exposed_by_step(t, link).to_dict("records")
    assert row["best_exposed_all_gather_s"] == pytest.approx(160e-6)
    assert row["exposed_all_gather_s"] == pytest.approx(160e-6)
    assert best_exposed_summary(t, link)["exposed_vs_best"] == pytest.approx(1.0)
    # the waits count as communication, not compute; the serial intervals as communication
    np.testing.assert_allclose(zp.comm_intervals(t, link), [[5, 210]])
    # a cell's config names its link by preset or numbers
    assert link_from_config({"emulate_link": "ib-400g", "emulate_gbps": float("nan")}).name == "ib-400g"
    assert link_from_config({"emulate_link": "", "emulate_gbps": 2.0, "emulate_latency_us": 5.0}) == Link(2.0, 5.0)
    assert link_from_config({"emulate_gbps": 0.0}) is None


def test_exposed_vs_best_table_and_plot(tmp_path):
    import pandas as pd

    from zerobench.analysis.profiling.best_plot import best_table, plot_exposed_vs_best

    summary = pd.DataFrame({
        "cell_id": ["a", "a", "b", "c"], "rank": [0, 1, 0, 0],
        "step_trace_s": [1.0, 1.0, 2.0, 3.0], "overlap_ratio": [0.5, 0.5, 0.2, 0.1], "exposed_comm_s": [0.1] * 4,
        "exposed_all_gather_s": [0.2, 0.4, 0.5, 0.1], "best_exposed_all_gather_s": [0.1, 0.1, 0.5, math.nan],
    })
    t = best_table(summary)
    assert list(t["cell_id"]) == ["a", "b"]  # c ran without emulation
    assert t["exposed_vs_best"].tolist() == pytest.approx([3.0, 1.0])
    assert plot_exposed_vs_best(summary, tmp_path / "p.png").stat().st_size > 0
    assert plot_exposed_vs_best(summary.drop(columns=["best_exposed_all_gather_s"]), tmp_path / "q.png") is None
