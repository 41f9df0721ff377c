"""DeepSpeed ZeRO on the virtual GPU: its accelerator answers as a CUDA device while one is
installed, ZeRO takes its CUDA path there (overlap_comm's second bucket shows), and
`zerobench estimate` and `zerobench predict` agree on memory at any world size, on fake
tensors. Skipped without the optional extra."""

from __future__ import annotations

import os

import pytest

from zerobench.engines import get_engine
from zerobench.engines.deepspeed import deepspeed_unavailable

if deepspeed_unavailable():
    pytest.skip(deepspeed_unavailable(), allow_module_level=True)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from zerobench.instruments.link import resolve_link  # noqa: E402
from zerobench.spec.cell import Cell  # noqa: E402
from zerobench.spec.workload import load_workload  # noqa: E402

BUCKET = 20_000_000  # elements: 40 MB in bf16, far above this model's 2.6 MB of bf16 parameters


def test_the_accelerator_is_a_cuda_device_only_while_a_virtual_gpu_is_installed():
    from deepspeed.accelerator import get_accelerator

    from zerobench.engines import deepspeed_vgpu
    from zerobench.instruments.vgpu import VirtualGpu
    from zerobench.instruments.vgpu.timeline import VStream

    deepspeed_vgpu.install()
    accelerator = get_accelerator()
    assert isinstance(accelerator, deepspeed_vgpu.VirtualGpuAccelerator)
    assert accelerator.is_synchronized_device() and accelerator.Stream is None  # DeepSpeed's CPU answers
    with VirtualGpu("h100-sxm") as gpu:
        assert not accelerator.is_synchronized_device() and not accelerator.resolves_data_dependency()
        side = accelerator.Stream()
        assert isinstance(side, VStream) and side in gpu.streams
        with accelerator.stream(side):
            assert accelerator.current_stream() is side
        assert accelerator.current_stream() is gpu.default
        assert accelerator.total_memory() == gpu.preset.memory_bytes
        assert accelerator.memory_stats() == gpu.memory_stats()
    assert accelerator.is_synchronized_device()


def _cell(name: str, world_size: int, **options) -> Cell:
    opts = {k: axis.default for k, axis in get_engine(name).options.items()}
    opts.update(options, activation_checkpointing="none")
    return Cell(name, world_size, "bf16", tuple(opts.items()))


def _predict(w, cell):
    from zerobench.whatif.predict.job import predict_one

    row = predict_one(w, cell, "h100-sxm", "fast", resolve_link("nvlink4-8gpu"), None, 8)
    assert row["status"] == "ok", row
    return row


@pytest.fixture(scope="module")
def quickstart():
    return load_workload("workloads/quickstart.toml")


@pytest.mark.slow
def test_overlap_comm_double_buffers_zero2s_bucket_on_the_virtual_gpu(quickstart):
    plain = _predict(quickstart, _cell("deepspeed-zero2", 8, reduce_bucket_size=BUCKET, overlap_comm=False))
    overlapped = _predict(quickstart, _cell("deepspeed-zero2", 8, reduce_bucket_size=BUCKET, overlap_comm=True))
    bucket = 2 * BUCKET  # bf16
    extra = overlapped["peak_allocated_bytes"] - plain["peak_allocated_bytes"]
    assert 0.99 * bucket <= extra <= 1.05 * bucket, (plain["peak_allocated_bytes"], overlapped["peak_allocated_bytes"])
    assert plain["peak_allocated_bytes"] >= bucket  # the bucket is allocated whole


@pytest.mark.slow
@pytest.mark.parametrize("name, world_size, options", [
    ("deepspeed-zero1", 8, {"reduce_bucket_size": 100_000}),
    ("deepspeed-zero2", 64, {"reduce_bucket_size": 100_000, "overlap_comm": True}),
    ("deepspeed-zero3", 512, {"reduce_bucket_size": 100_000, "stage3_param_persistence_threshold": 0}),
])
def test_estimate_and_predict_agree_on_memory(quickstart, name, world_size, options):
    """The estimator runs DeepSpeed's CPU path (a synchronous device) and the prediction its
    CUDA path (side streams, recorded streams): the allocator model's allocated peak, less
    cuBLAS's two workspaces (the forward's and the backward thread's: [Note: cuBLAS
    workspaces]), is the tracker's tensor-byte peak within 3 %, and never below it."""
    from zerobench.instruments.vgpu.device import cublas_workspace_bytes
    from zerobench.whatif.estimate.job import estimate_one

    cell = _cell(name, world_size, **options)
    estimated = estimate_one(quickstart, cell, 0, True)
    predicted = _predict(quickstart, cell)
    workspaces = 2 * cublas_workspace_bytes("9.0")
    ratio = (predicted["peak_allocated_bytes"] - workspaces) / estimated["peak_mem_bytes"]
    assert 1.0 <= ratio < 1.03, (predicted["peak_allocated_bytes"], estimated["peak_mem_bytes"])
    assert predicted["peak_reserved_bytes"] >= predicted["peak_active_bytes"] >= predicted["peak_allocated_bytes"]
    assert predicted["step_time_s"] >= predicted["compute_s"] > 0


@pytest.mark.slow
def test_a_zero3_cell_leaves_the_process_as_a_fresh_one_counts_it(quickstart):
    """ZeRO-3 replaces ``F.linear`` with its own and DeepSpeed runs dynamo's patches of
    torch's optimizers: after a ZeRO-3 prediction the next cell of the process runs torch's
    ``F.linear``, and the host counts of a program are those stored, as a fresh process
    counts them (their Python calls price the predicted host)."""
    import json

    import torch

    from zerobench.validation.calibrate.host import count_programs

    linear = torch.nn.functional.linear
    _predict(quickstart, _cell("deepspeed-zero3", 2, reduce_bucket_size=100_000))
    assert torch.nn.functional.linear is linear
    stored = json.loads(open("zerobench/instruments/vgpu/host_counts.json").read())["counts"]
    assert count_programs(("plain_mlp8",))["plain_mlp8"] == stored["plain_mlp8"]
