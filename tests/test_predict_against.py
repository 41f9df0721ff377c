"""``zerobench predict --against RUN`` (zerobench/whatif/predict/against.py) and the
breakdown by kernel class it reads both traces with (zerobench/analysis/profiling/kernels.py,
[Note: kernel classes in a trace]): real CUDA kernel names classed as their libraries
name them, a synthetic CUDA trace worked out by hand, a CPU run's gloo trace, the
virtual GPU's trace, and the table, plot and refusals of the command."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from zerobench.analysis.profiling.kernels import class_breakdown, cuda_kernel_class, mean_breakdown, operator_class
from zerobench.analysis.profiling.trace import load_trace
from zerobench.whatif.predict import against

DATA = Path(__file__).parent / "data"
US = 1e-6

# Kernel names as CUDA libraries and torch 2.x name them (cuBLAS, CUTLASS, cuDNN, flash
# and memory-efficient attention, ATen, NCCL, Triton).
REAL_KERNELS = {
    "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas": "gemm",
    "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT": "gemm",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8>(Params)": "gemm",
    "void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false>(params)": "gemm",
    "void splitKreduce_kernel<32, 16, int, float, float, float, float, true, false, false>(params)": "gemm",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_6_64x128x128_4x1x1_kernel0_0": "attention",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<bf16>::Params)": "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>(params)": "attention",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<4>, "
    "FusedAdamMathFunctor<float, 4>>(args)": "optimizer",
    "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)>(args)":
        "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::sum_functor>>(args)": "elementwise",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(args)": "elementwise",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>(args)": "elementwise",
    "triton_poi_fused_add_mul_0": "elementwise",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>(a)":
        "copy",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 1, 128, 1>(args)": "copy",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, Array<char*, 1>>(args)": "copy",
    "Memcpy HtoD (Pinned -> Device)": "copy",
    "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)": "collective",
    "my_extension::custom_kernel(float*, int)": "other",
}


@pytest.mark.parametrize("name, cls", list(REAL_KERNELS.items()), ids=list(REAL_KERNELS.values()))
def test_real_cuda_kernels_are_classed_as_their_libraries_name_them(name, cls):
    assert cuda_kernel_class(name) == cls


@pytest.mark.parametrize("name, cls", [
    ("aten::mm", "gemm"), ("addmm.default", "gemm"), ("aten::_scaled_dot_product_flash_attention", "attention"),
    ("_scaled_dot_product_flash_attention_for_cpu_backward.default", "attention"), ("_foreach_lerp_.Scalar", "optimizer"),
    ("_foreach_copy_.default", "copy"), ("aten::copy_", "copy"), ("_to_copy.default", "copy"),
    ("aten::relu", "elementwise"), ("native_layer_norm.default", "elementwise"), ("all_gather 4.00 MiB", "collective"),
    ("c10d::allreduce_", "collective"), ("_sleep", "other"),
])
def test_operators_are_classed_by_their_names(name, cls):
    assert operator_class(name) == cls


def test_a_synthetic_cuda_trace_worked_out_by_hand():
    """tests/data/cuda_step.trace.json: two steps of one rank. Step 0 (0-1000 us): a GEMM
    of 200 us, flash attention 100, SiLU 50, a device copy 20, an all-gather of 200 on
    another stream (350-550: hidden by compute until 470), and in the optimizer step a
    multi-tensor kernel (50) and a plain add launched inside it (20, optimizer by its
    launch). Step 1 (1000 us to the last kernel's end, 2050): an nvjet GEMM 300, a custom
    kernel 10, a Triton kernel of 60 that runs past the host's step."""
    b = class_breakdown(load_trace(DATA / "cuda_step.trace.json"))
    step0, step1 = b.iloc[0], b.iloc[1]
    expected0 = {"step_s": 1000, "gemm_s": 200, "attention_s": 100, "elementwise_s": 50, "copy_s": 20,
                 "collective_s": 200, "optimizer_s": 70, "other_s": 0, "busy_s": 520, "exposed_comm_s": 80,
                 "host_idle_s": 480}
    expected1 = {"step_s": 1050, "gemm_s": 300, "other_s": 10, "elementwise_s": 60, "optimizer_s": 0,
                 "busy_s": 370, "exposed_comm_s": 0, "host_idle_s": 680}
    for row, expected in ((step0, expected0), (step1, expected1)):
        for key, us in expected.items():
            assert row[key] == pytest.approx(us * US), key


def test_the_hosts_busy_time_is_each_step_less_its_synchronize_calls(tmp_path):
    """The synthetic trace's two steps of 1000 us, the first waiting 100 us in a
    cudaDeviceSynchronize (and 150 us more past the step's end, which is not the step's):
    the host was busy 900 and 1000 us, 950 on average. A CPU run's trace has no CUDA
    runtime: no figure."""
    data = json.loads((DATA / "cuda_step.trace.json").read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    step = next(e for e in events if e.get("name") == "zerobench::step")
    events.append({**step, "name": "cudaDeviceSynchronize", "cat": "cuda_runtime", "ts": 900, "dur": 100})
    events.append({**step, "name": "cudaStreamSynchronize", "cat": "cuda_runtime", "ts": 2000, "dur": 150})
    path = tmp_path / "synced.trace.json"
    path.write_text(json.dumps(data))
    assert against.host_busy(load_trace(path)) == pytest.approx(950 * US)
    assert against.host_busy(load_trace(DATA / "ddp.rank0.json.gz")) is None


def test_a_cpu_runs_trace_breaks_down_into_its_operators_and_gloo():
    """A real 2-rank gloo trace (tests/data/ddp.rank0.json.gz): every step's classes and
    idle time add up to no more than the step, DDP's all-reduces are communication, and
    the optimizer step's operators are the optimizer's."""
    b = class_breakdown(load_trace(DATA / "ddp.rank0.json.gz"))
    assert len(b) == 2
    for _, row in b.iterrows():
        assert row["collective_s"] > 0 and row["gemm_s"] > 0 and row["optimizer_s"] > 0
        assert row["busy_s"] + row["host_idle_s"] == pytest.approx(row["step_s"])
        assert row["exposed_comm_s"] <= row["collective_s"] + 1e-12
        assert row["attention_s"] == 0


def _virtual_trace(path: Path) -> dict:
    """A toy virtual GPU's trace: a matmul, a pointwise op, a copy, a foreach update."""
    import torch

    from zerobench.instruments.vgpu import GpuPreset, HostPreset, VirtualGpu

    gpu = VirtualGpu(gpu=GpuPreset("toy", memory_bytes=1 << 30, peak_flops={torch.float32: 1e12},
                                   hbm_bytes_per_s=1e10, context_bytes=0),
                     host=HostPreset("toy", dispatch_s=10 * US, launch_s=10 * US))
    a, b = torch.ones(64, 64), torch.ones(64, 64)
    with gpu:
        c = a @ b
        c.relu_()
        d = c.clone()
        torch._foreach_add_([c, d], 1.0)
        gpu.synchronize()
    trace = gpu.trace.chrome(label="toy")
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    return trace


def _folders(tmp_path: Path) -> tuple[Path, Path]:
    """A run folder holding the real gloo trace of one DDP cell, and a predict folder
    holding the toy virtual GPU's trace for the same cell."""
    run = tmp_path / "run"
    (run / "traces" / "ddp-ws2-fp32").mkdir(parents=True)
    shutil.copy(DATA / "ddp.rank0.json.gz", run / "traces" / "ddp-ws2-fp32" / "rank0.json.gz")
    pd.DataFrame([{"cell_id": "ddp-ws2-fp32", "rank": 0, "step_time_s": 0.004},
                  {"cell_id": "ddp-ws2-fp32", "rank": 1, "step_time_s": 0.005}]).to_csv(run / "results.csv",
                                                                                        index=False)
    predicted = tmp_path / "predict"
    (predicted / "traces").mkdir(parents=True)
    _virtual_trace(predicted / "traces" / "ddp-ws2-fp32.trace.json.gz")
    pd.DataFrame([{"config": "ddp-fp32", "world_size": 2, "status": "ok", "step_time_s": 0.0002}]).to_csv(
        predicted / "predict.csv", index=False)
    return run, predicted


def test_against_puts_each_class_beside_its_prediction(tmp_path):
    run, predicted = _folders(tmp_path)
    frame = against.compare(run, predicted)
    measured = mean_breakdown(load_trace(DATA / "ddp.rank0.json.gz"))
    modelled = mean_breakdown(load_trace(predicted / "traces" / "ddp-ws2-fp32.trace.json.gz"))
    rows = frame.set_index("quantity")
    assert list(frame["cell"].unique()) == ["ddp-ws2-fp32"]
    assert list(rows.index) == [label for _, label in against.QUANTITIES + against.HOST_QUANTITIES]
    assert rows.loc["gemm", "measured_s"] == pytest.approx(measured["gemm_s"])
    assert rows.loc["gemm", "predicted_s"] == pytest.approx(modelled["gemm_s"]) and modelled["gemm_s"] > 0
    assert modelled["optimizer_s"] > 0 and modelled["copy_s"] > 0 and modelled["elementwise_s"] > 0
    assert rows.loc["step (timed)", "measured_s"] == pytest.approx(0.004)  # rank 0's timing pass
    assert rows.loc["step (timed)", "predicted_s"] == pytest.approx(0.0002)
    assert rows.loc["step (timed)", "error"] == pytest.approx(0.0002 / 0.004 - 1)
    assert pd.isna(rows.loc["attention", "error"])  # nothing measured: no error
    # the virtual GPU runs no profiler: its idle is (nearly) its idle without one
    assert rows.loc["device idle, the host's (less the profiler's cost)", "predicted_s"] == pytest.approx(
        modelled["host_idle_s"], abs=2e-4)
    from zerobench.analysis.render import markdown, text

    table = markdown(against.against_table(frame))
    assert "| ddp-ws2-fp32 | gemm |" in table and "device idle (waiting on the host)" in table
    narrow = text(against.against_table(frame), 80)
    assert "ddp-ws2-fp32" in narrow and all(len(line) <= 80 for line in narrow.splitlines())
    written = against.write(frame, predicted)
    assert all(p.exists() for p in written) and (predicted / "plots" / "against.png").exists()
    assert pd.read_csv(predicted / "against.csv")["quantity"].tolist() == frame["quantity"].tolist()


def test_a_kernel_no_rule_names_takes_its_launching_operators_class(tmp_path):
    """cuDNN attention's backward launches ``cudnn::fusion`` helpers beside its bprop kernel:
    attention by the operator that launched them; a kernel without one stays ``other``."""
    trace = json.loads((DATA / "cuda_step.trace.json").read_text())
    events = trace["traceEvents"]
    events.append({"ph": "X", "pid": 1, "tid": 11, "cat": "cpu_op", "name": "aten::_cudnn_attention_backward",
                   "ts": 1062, "dur": 8, "args": {"External id": 77}})
    for e in events:
        if e.get("name", "").startswith("my_extension::custom_kernel"):
            helper = dict(e, name="void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*)",
                          ts=1410, dur=30, args={**e["args"], "External id": 77, "correlation": 99})
    events.append(helper)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    step1 = class_breakdown(load_trace(path)).iloc[1]
    assert step1["attention_s"] == pytest.approx(30 * US)
    assert step1["other_s"] == pytest.approx(10 * US)  # the custom kernel: no operator launched it


def test_the_profilers_cost_is_the_traced_step_less_the_timed_one_and_leaves_the_hosts_idle():
    """[Note: the profiler's own cost], worked by hand: 206.5 ms traced, 202.8 timed, 10.3 idle."""
    split = against.profiler_split({"step_s": 0.2065, "step_time_s": 0.2028, "host_idle_s": 0.0103})
    assert split["profiler_s"] == pytest.approx(0.0037)
    assert split["host_idle_timed_s"] == pytest.approx(0.0066)
    # a profiler that cost more than the idle it shows: none of that idle is the host's
    assert against.profiler_split({"step_s": 0.283, "step_time_s": 0.188, "host_idle_s": 0.05})[
        "host_idle_timed_s"] == 0.0
    assert against.profiler_split({"step_s": 0.2, "step_time_s": None, "host_idle_s": 0.01}) == {}


def test_against_splits_the_measured_idle_between_the_profiler_and_the_host(tmp_path):
    run, predicted = _folders(tmp_path)
    rows = against.compare(run, predicted).set_index("quantity")
    traced = rows.loc["step (traced)", "measured_s"]
    profiler = rows.loc["the profiler's own cost (traced - timed step)", "measured_s"]
    assert profiler == pytest.approx(max(traced - 0.004, 0.0))
    assert rows.loc["device idle, the host's (less the profiler's cost)", "measured_s"] == pytest.approx(
        max(rows.loc["device idle (waiting on the host)", "measured_s"] - profiler, 0.0))


def test_against_refuses_a_folder_without_traces_and_writes_nothing(tmp_path, capsys):
    run, predicted = _folders(tmp_path)
    shutil.rmtree(run / "traces")
    assert against.main([str(run), str(predicted)]) == 2
    assert "zerobench run WORKLOAD --profile" in capsys.readouterr().err
    assert not (predicted / "against.csv").exists()


def test_predict_against_a_folder_that_is_no_run_exits_2_before_predicting(tmp_path, capsys):
    from zerobench.cli import main

    results = tmp_path / "results"
    code = main(["predict", "quickstart", "--against", str(tmp_path / "nothing"), "--results", str(results)])
    assert code == 2
    assert "--against" in capsys.readouterr().err
    assert not results.exists()


@pytest.mark.slow
def test_predict_against_a_profiled_cpu_run(tmp_path):
    """End to end: ``zerobench run --profile`` of one cell on this CPU, then ``zerobench
    predict --against`` it: the table has the cell, every quantity measured, and the plot."""
    from zerobench.cli import main

    workload = tmp_path / "tiny.toml"
    workload.write_text("""name = "tiny"
seed = 0
[model]
kind = "mlp"
depth = 2
width = 64
[data]
batch_size = 8
warmup_steps = 1
steps = 2
seed = 0
[optimizer]
kind = "adam"
lr = 1e-3
[matrix]
engine = ["ddp"]
world_size = [2]
dtype = ["fp32"]
""")
    assert main(["run", str(workload), "--profile", "--results", str(tmp_path / "runs"), "--no-plots"]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    assert main(["predict", str(workload), "--against", str(run), "--results", str(tmp_path / "predicted")]) == 0
    (predicted,) = (tmp_path / "predicted").iterdir()
    frame = pd.read_csv(predicted / "against.csv")
    assert set(frame["cell"]) == {"ddp-ws2-fp32"}
    steps = frame.set_index("quantity")
    assert steps.loc["step (traced)", "measured_s"] > 0 and steps.loc["step (traced)", "predicted_s"] > 0
    assert steps.loc["gemm", "measured_s"] > 0 and steps.loc["collective", "measured_s"] > 0
    assert (predicted / "plots" / "against.png").exists()


def test_against_a_cpu_run_or_another_gpu_says_so(tmp_path):
    """[Note: against what was measured]: a run measured on a CPU over gloo, or on another
    GPU than the preset's, is named in a warning; the H200's run against h200 is not."""
    import json

    from zerobench.whatif.predict.against import device_warning, measured_on

    cpu = tmp_path / "cpu"
    cpu.mkdir()
    (cpu / "meta.json").write_text(json.dumps({"backend": "gloo", "cpu_model": "AMD EPYC", "gpu_model": None}))
    assert measured_on(cpu) == "CPU (AMD EPYC, gloo)"
    assert "measured on CPU (AMD EPYC, gloo)" in device_warning(cpu, "h200")
    h200 = Path(__file__).resolve().parents[1] / "results" / "gpu" / "h200-20261128" / "llama3-8b-l4-ws1-deepspeed"
    assert device_warning(h200, "h200") is None
    assert "whose preset is h200" in device_warning(h200, "h100-sxm")
