"""Device selection on faked multi-GPU nodes ([Note: faked topologies] in
tests/helpers/topology.py): which device each rank takes under every launcher, in which
order it sets it and starts its process group, what each engine is handed, and which
GPU its telemetry reads. No GPU is needed."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.topology import Gpu, Topology, gpus, rank_setup, slurm_env, torchrun_env, zerobench_env


def _node(monkeypatch, n: int = 8, **kw) -> Topology:
    return Topology(gpus(n, **kw)).install(monkeypatch)


def _assert_rank_on(setup, index: int, gpu: Gpu, backend: str = "nccl"):
    assert setup.device == torch.device("cuda", index)
    assert setup.backend == backend
    assert setup.gpu == gpu
    # the device is set before the process group starts, and NCCL is handed the same indexed device
    init = [c for c in setup.calls if c[0] == "init_process_group"]
    assert setup.calls.index(("set_device", index)) < setup.calls.index(init[0])
    assert init == [("init_process_group", backend, setup.device if backend == "nccl" else None)]
    assert setup.telemetry_reads == gpu.uuid  # telemetry reads the rank's own GPU


# -- launchers -----------------------------------------------------------------------------


def test_zerobench_launcher_at_world_size_8_puts_rank_r_on_gpu_r(monkeypatch):
    node = _node(monkeypatch)
    for rank in range(8):
        _assert_rank_on(rank_setup(node, zerobench_env(rank, 8)), rank, node.nvml[rank])


def test_zerobench_launcher_at_world_size_4_on_an_8_gpu_node(monkeypatch):
    node = _node(monkeypatch)
    for rank in range(4):
        _assert_rank_on(rank_setup(node, zerobench_env(rank, 4)), rank, node.nvml[rank])


def test_torchrun_2_by_8_uses_local_rank(monkeypatch):
    node = _node(monkeypatch)
    for rank in (0, 7, 8, 11, 15):
        setup = rank_setup(node, torchrun_env(rank, nodes=2, per_node=8))
        _assert_rank_on(setup, rank % 8, node.nvml[rank % 8])
        assert setup.ctx.rank == rank and setup.ctx.world_size == 16 and setup.ctx.local_rank == rank % 8


def test_cuda_visible_devices_as_an_index_subset(monkeypatch):
    node = _node(monkeypatch)
    for rank in range(4):
        setup = rank_setup(node, zerobench_env(rank, 4), visible="4,5,6,7")
        _assert_rank_on(setup, rank, node.nvml[4 + rank])


def test_cuda_visible_devices_as_uuid_prefixes(monkeypatch):
    """Issue 39 item 4: a UUID prefix, as users write them, found by the UUID torch gives."""
    node = _node(monkeypatch)
    visible = ",".join(g.uuid[:12] for g in (node.nvml[6], node.nvml[2]))  # "GPU-00000006,GPU-00000002"
    for rank, physical in enumerate((6, 2)):
        setup = rank_setup(node, zerobench_env(rank, 2), visible=visible)
        _assert_rank_on(setup, rank, node.nvml[physical])
        assert setup.telemetry_note is None


def test_mixed_models_nvml_order_is_not_cudas(monkeypatch):
    """Issue 39 item 4: CUDA enumerates the faster model first, NVML by PCI bus; with
    CUDA_VISIBLE_DEVICES unset, telemetry still reads each rank's own GPU."""
    node = Topology(gpus(2, name="NVIDIA A100-SXM4-80GB", tag=1) + gpus(2, name="NVIDIA H100", tag=2, speed=1))
    node.install(monkeypatch)
    for rank in range(4):
        setup = rank_setup(node, zerobench_env(rank, 4))
        expected = node.nvml[[2, 3, 0, 1][rank]]
        _assert_rank_on(setup, rank, expected)


def test_a_mig_instance_is_read_for_memory_and_says_why_the_rest_is_absent(monkeypatch):
    mig = Gpu("NVIDIA H200 MIG 1g.18gb", "MIG-5e1f0000-aaaa-bbbb-cccc-000000000001")
    node = Topology([*gpus(1), mig]).install(monkeypatch)
    setup = rank_setup(node, zerobench_env(0, 1), visible=mig.uuid)
    assert setup.gpu == mig and setup.telemetry_reads == mig.uuid
    assert "MIG" in setup.telemetry_note and "only memory" in setup.telemetry_note


def test_shared_gpus_over_gloo_put_rank_r_on_gpu_r_mod_count(monkeypatch):
    node = _node(monkeypatch, n=2)
    for rank in range(4):
        env = {**zerobench_env(rank, 4), "ZEROBENCH_CUDA_SHARED_BACKEND": "gloo"}
        _assert_rank_on(rank_setup(node, env), rank % 2, node.nvml[rank % 2], backend="gloo")


# -- Slurm without torchrun ([Note: ranks started by Slurm]) -------------------------------


def test_srun_gpus_per_node_starts_ranks_from_slurms_variables(monkeypatch):
    """srun --nodes=2 --ntasks-per-node=8 --gpus-per-node=8: no RANK, only SLURM_*."""
    node = _node(monkeypatch)
    for rank in (0, 5, 8, 13):
        setup = rank_setup(node, slurm_env(rank, nodes=2, per_node=8))
        _assert_rank_on(setup, rank % 8, node.nvml[rank % 8])
        assert (setup.ctx.rank, setup.ctx.world_size, setup.ctx.local_rank) == (rank, 16, rank % 8)
        assert setup.env == {"RANK": str(rank), "WORLD_SIZE": "16", "LOCAL_RANK": str(rank % 8),
                             "MASTER_ADDR": "gpu007", "MASTER_PORT": "19242"}


def test_srun_gpus_per_task_gives_each_rank_its_own_gpu_as_cuda_0(monkeypatch):
    """srun --ntasks-per-node=8 --gpus-per-task=1: Slurm shows each task only its GPU."""
    node = _node(monkeypatch)
    for rank in range(8):
        setup = rank_setup(node, slurm_env(rank, nodes=1, per_node=8, gpus_per_task=1, nodelist="gpu042"),
                           visible=str(rank))
        _assert_rank_on(setup, 0, node.nvml[rank])
        assert setup.env["MASTER_ADDR"] == "gpu042" and setup.ctx.local_rank == rank


def test_slurm_host_lists_and_tasks_per_node():
    from zerobench.rank.protocol import first_host, tasks_per_node

    assert first_host("gpu[003-004,010],cpu1") == "gpu003"
    assert first_host("node12,node13") == "node12"
    assert first_host("rack[2-3]-gpu[07-08]") == "rack2-gpu07"
    assert tasks_per_node("8(x2),4") == [8, 8, 4]
    with pytest.raises(SystemExit, match="tasks per node"):
        tasks_per_node("eight")


def test_srun_missing_a_variable_names_it():
    from zerobench.rank.protocol import torchrun_env as env_of

    env = slurm_env(0, nodes=1, per_node=8)
    del env["SLURM_NTASKS"]
    with pytest.raises(SystemExit, match="SLURM_NTASKS is not set"):
        env_of(env=env)


def test_torchrun_inside_an_allocation_wins_over_slurms_variables(monkeypatch):
    """torchrun (or zerobench run) started inside an sbatch job: RANK is set, SLURM_* ignored."""
    node = _node(monkeypatch)
    env = {**slurm_env(0, nodes=1, per_node=1), **zerobench_env(3, 4)}
    setup = rank_setup(node, env)
    _assert_rank_on(setup, 3, node.nvml[3])
    assert setup.env["MASTER_ADDR"] == "127.0.0.1"


# -- every engine's device hand-over ------------------------------------------------------


class _Handover:
    """Stands in for each engine's wrapper constructors and records what device it is handed."""

    def __init__(self, monkeypatch):
        self.seen: dict = {}
        from zerobench.engines import ddp, impl_fsdp, impl_zero, torch_fsdp1, torch_fsdp2

        def ddp_ctor(model, device_ids=None, **kw):
            self.seen["device_ids"] = device_ids
            return model

        def fsdp_ctor(model, device_id=None, **kw):
            from tests.helpers.topology import check_device_id

            check_device_id(device_id, "FSDP")
            self.seen["device_id"] = device_id
            return model

        def mesh(device_type, shape, **kw):
            self.seen["mesh"] = (device_type, torch.cuda.current_device())  # fully_shard's device: the current one
            return object()

        def shard(module, **kw):
            return module

        class _Done:
            def wait(self):
                pass

        monkeypatch.setattr(ddp, "DistributedDataParallel", ddp_ctor)
        monkeypatch.setattr(torch_fsdp1, "FullyShardedDataParallel", fsdp_ctor)
        monkeypatch.setattr(impl_fsdp, "FSDP", fsdp_ctor)
        monkeypatch.setattr(torch_fsdp2, "init_device_mesh", mesh)
        monkeypatch.setattr(torch_fsdp2, "fully_shard", shard)
        monkeypatch.setattr(impl_zero.comm, "broadcast", lambda *a, **k: _Done())

    def of(self, engine: str, world) -> torch.device:
        """The device ``engine`` hands its wrapper (or DeepSpeed) on ``world``'s rank."""
        from zerobench.engines import get_engine

        self.seen.clear()
        cls = get_engine(engine)
        model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        if engine.startswith("deepspeed"):
            return _deepspeed_device(world.context())
        cls({k: a.default for k, a in cls.options.items()}, world.context(), "fp32").wrap(model, list(model))
        if "device_ids" in self.seen:
            return torch.device("cuda", self.seen["device_ids"][0])
        if "device_id" in self.seen:
            return self.seen["device_id"]
        if "mesh" in self.seen:
            return torch.device(*self.seen["mesh"])
        return torch.device("cuda", torch.cuda.current_device())  # impl-zero2: the tensors' own device


def _deepspeed_device(ctx) -> torch.device:
    """The device DeepSpeed 0.19.8 takes: zerobench starts it (``_start_deepspeed``, its
    process-group steps left out), then ``DeepSpeedEngine`` sets ``LOCAL_RANK`` as its
    device (``_set_distributed_vars``)."""
    import unittest.mock as mock

    import deepspeed
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    from deepspeed.runtime import engine as ds_engine

    from zerobench.engines import deepspeed as zb_deepspeed

    with mock.patch.object(zb_deepspeed, "_forget_an_earlier_world", lambda: None), \
            mock.patch.object(zb_deepspeed, "route_through_torch_distributed", lambda backend: None), \
            mock.patch.object(deepspeed, "init_distributed", lambda **kw: None):
        zb_deepspeed._start_deepspeed(ctx)
    engine = type("Stub", (), {})()
    ds_engine.DeepSpeedEngine._configure_with_arguments(engine, None, None)
    accelerator = CUDA_Accelerator.__new__(CUDA_Accelerator)  # no probe of a real GPU
    accelerator._name, accelerator._communication_backend_name = "cuda", "nccl"
    with mock.patch.object(ds_engine, "get_accelerator", lambda: accelerator), \
            mock.patch.object(ds_engine.dist, "get_world_size", lambda: ctx.world_size), \
            mock.patch.object(ds_engine.dist, "get_rank", lambda: ctx.rank):
        ds_engine.DeepSpeedEngine._set_distributed_vars(engine, None)
    assert engine.device == torch.device("cuda", torch.cuda.current_device())
    return engine.device


def _engines():
    from zerobench.engines import ENGINES
    from zerobench.engines.deepspeed import deepspeed_unavailable

    return [e for e in ENGINES if not (e.startswith("deepspeed") and deepspeed_unavailable())]


@pytest.mark.parametrize("launcher", ["zerobench-ws8", "torchrun-2x8", "slurm-gpus-per-task", "shared-gloo"])
def test_every_engine_hands_over_the_ranks_own_device(monkeypatch, launcher):
    """Issue 39 item 2, and item 1's first defect: DeepSpeed sets LOCAL_RANK as its
    device, so on shared GPUs it must be the rank's device index, not its local rank."""
    node = _node(monkeypatch, n=2 if launcher == "shared-gloo" else 8)
    handover = _Handover(monkeypatch)
    rank, visible = 5, None
    env = {"zerobench-ws8": zerobench_env(5, 8), "torchrun-2x8": torchrun_env(13, 2, 8),
           "slurm-gpus-per-task": slurm_env(5, 1, 8, gpus_per_task=1),
           "shared-gloo": {**zerobench_env(3, 4), "ZEROBENCH_CUDA_SHARED_BACKEND": "gloo"}}[launcher]
    if launcher == "slurm-gpus-per-task":
        visible = "5"
    expected = {"zerobench-ws8": 5, "torchrun-2x8": 5, "slurm-gpus-per-task": 0, "shared-gloo": 1}[launcher]
    handed = {}

    def engines(world):
        for engine in _engines():
            handed[engine] = handover.of(engine, world)

    setup = rank_setup(node, env, visible=visible, inside=engines)
    assert setup.device == torch.device("cuda", expected), rank
    assert handed and all(d == setup.device for d in handed.values()), handed
    assert any(e.startswith("deepspeed") for e in handed) or "deepspeed" not in " ".join(_engines())


# -- the guard of tests/conftest.py ([Note: indexed CUDA devices]) ------------------------


def test_the_guard_fails_a_cuda_device_id_without_an_index():
    import torch.distributed as dist
    from torch.distributed.fsdp import _init_utils

    from impl.fsdp import FullyShardedDataParallel

    with pytest.raises(AssertionError, match="init_process_group: device_id=cuda has no index"):
        dist.init_process_group("gloo", device_id=torch.device("cuda"))
    with pytest.raises(AssertionError, match="torch FSDP1: device_id=cuda has no index"):
        _init_utils._get_device_from_device_id(torch.device("cuda"), 0, None)
    with pytest.raises(AssertionError, match="impl's FSDP: device_id=cuda has no index"):
        FullyShardedDataParallel(torch.nn.Linear(2, 2), device_id="cuda")
    assert not dist.is_initialized()


# -- issue 39's defects found by reading, one test each -----------------------------------


def test_a_gpu_cells_notes_are_the_gpus(monkeypatch, tmp_path):
    """Defect 2: the worker found its cell as a CPU cell, so a DeepSpeed cell with
    overlap_comm on a GPU recorded "no side stream on CPU"."""
    from zerobench.rank import passes as worker
    from zerobench.runs.folder import RunFolder
    from zerobench.spec.workload import parse_workload

    _node(monkeypatch, n=1)
    workload = parse_workload({"model": {"kind": "mlp", "depth": 1, "width": 8},
                               "matrix": {"engine": ["deepspeed-zero3"], "world_size": [1],
                                          "overlap_comm": [True]}})
    folder = RunFolder(tmp_path / "run")
    folder.root.mkdir()
    folder.write_workload(workload)
    seen = {}

    class Stop(Exception):
        pass

    class World:
        rank = 0

        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    def session(workload, cell, world):
        seen["cell"] = cell
        raise Stop

    monkeypatch.setattr(worker, "TorchrunWorld", World)
    monkeypatch.setattr(worker, "Session", session)
    monkeypatch.setattr(worker, "_set_emulation", lambda cell: None)
    cell_id = "deepspeed-zero3-ws1-fp32"
    from tests.helpers.topology import environment

    with environment(zerobench_env(0, 1)), pytest.raises(Stop):
        worker.run_cell(folder.root, cell_id, profile=False, device="auto")
    assert seen["cell"].id == cell_id and seen["cell"].opts["overlap_comm"] is True
    assert "no side stream on CPU" not in (seen["cell"].note or "")
    with environment(zerobench_env(0, 1)), pytest.raises(Stop):
        worker.run_cell(folder.root, cell_id, profile=False, device="cpu")
    assert "no side stream on CPU" in seen["cell"].note  # on a CPU it is true


def test_the_power_sampler_reads_the_gpu_the_kernels_run_on(monkeypatch):
    """Defect 3: with CUDA_VISIBLE_DEVICES=3 the kernels ran on GPU 3 and NVML read GPU 0."""
    from tests.helpers.topology import environment
    from zerobench.validation.calibrate.sustained import PowerSampler

    node = _node(monkeypatch)
    with environment({}, visible="3"):
        for device in (torch.device("cuda", 0), torch.device("cuda")):
            sampler = PowerSampler(device)
            node.nvml_reads.clear()
            limits = sampler.limits()
            assert node.nvml_reads == [node.nvml[3].uuid, node.nvml[3].uuid]
            assert limits["power_limit_w"] == 103.0  # GPU 3's, not GPU 0's 100 W


def test_index_0_is_an_index(monkeypatch):
    """Defect 5: ``index or current_device()`` read cuda:0 as "no index"."""
    from impl.fsdp.fully_sharded import cuda_device_of

    node = _node(monkeypatch)
    node.current = 3
    assert cuda_device_of(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert cuda_device_of("cuda:0") == torch.device("cuda", 0)
    assert cuda_device_of(0) == torch.device("cuda", 0)
    assert cuda_device_of("cuda") == torch.device("cuda", 3)


def test_gpu_checks_one_rank_world_ignores_an_inherited_slurm_or_torchrun_environment(monkeypatch):
    """Defect 5: gpu_check took RANK, WORLD_SIZE and LOCAL_RANK with setdefault, and
    hard-coded cuda:0; a Slurm step's values won."""
    from tests.helpers.topology import environment
    from zerobench.validation.gpu_check import Target

    node = _node(monkeypatch)
    inherited = {**torchrun_env(13, 2, 8), **slurm_env(13, 2, 8)}
    with environment(inherited, visible="6,7"):
        with Target() as target:
            assert target.device == target.device_id == torch.device("cuda", 0)
            assert node.calls[-1] == ("init_process_group", "nccl", torch.device("cuda", 0))
            import os

            assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("0", "1", "0")
            assert os.environ["MASTER_ADDR"] == "127.0.0.1"
        assert node.gpu(target.device.index) == node.nvml[6]


def test_host_memory_for_the_build_is_refused_up_front(monkeypatch):
    """Defect 6: every rank builds the whole model in fp32 on the host; Llama 3 70B at
    8 ranks needs about 2.2 TB there, refused before any rank starts."""
    from tests.helpers.runs import ROOT
    from zerobench.harness import preflight
    from zerobench.spec.matrix import expand
    from zerobench.spec.workload import load_workload

    workload = load_workload(ROOT / "workloads" / "torchtitan-llama3-70b-a100.toml")
    params = preflight.parameter_count(workload)
    assert 70e9 < params < 71.5e9
    monkeypatch.setattr(preflight, "host_memory_bytes", lambda: 2.0 * 2**40)  # a node with 2 TiB
    import dataclasses

    workload = dataclasses.replace(workload, matrix={**workload.matrix, "world_size": [4, 8]})
    cells = [c for c in expand(workload, "cuda") if c.skip_reason is None]
    by_ws = {c.world_size: c for c in cells}
    assert 8 in by_ws
    reason = preflight.build_refusal(by_ws[8], params)
    need = 8 * (params * 4 + preflight.RANK_BASE_BYTES)
    assert reason.startswith(f"preflight: {by_ws[8].id} builds its whole model ({params:,} parameters) in fp32")
    assert f"{need / 2**30:,.1f} GiB of host memory" in reason and "2,048.0 GiB" in reason
    assert 2.2e12 < need < 2.3e12
    small = next(c for c in cells if c.world_size <= 4)
    assert preflight.build_refusal(small, params) is None  # 4 x 282 GB fits in 2 TiB
