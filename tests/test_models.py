"""The models a workload can train (Llama, a user's factory, Hugging Face configs) and
activation checkpointing: shapes, parity, where recomputed memory is counted, and errors."""

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from zerobench.instruments.memory import StorageTracker
from zerobench.spec import data
from zerobench.spec.checkpointing import parse_mode
from zerobench.spec.matrix import expand
from zerobench.spec.models import build_for_cell, construct, loss_fn, sharding_units
from zerobench.spec.workload import WorkloadError, parse_workload

MODELS = Path(__file__).parent / "data" / "models"
TINY_LLAMA = {"kind": "llama", "layers": 4, "d_model": 32, "heads": 4, "kv_heads": 2, "ffn_hidden": 64,
              "vocab": 64, "seq_len": 16}
MODES = ("none", "full", "every:2", "ops")


def llama(**changes):
    return parse_workload({"model": {**TINY_LLAMA, **changes}}).model


def count(cfg) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in construct(cfg).parameters())


@pytest.mark.parametrize("preset, params", [
    ("llama2-7b", 6_738_415_616),    # Llama 2 7B as released
    ("llama3-8b", 8_030_261_248),    # Llama 3 8B as released
    ("llama3-70b", 70_553_706_496),  # Llama 3 70B as released
    ("llama2-13b", 13_015_864_320),  # Llama 2 13B as released
])
def test_presets_have_the_published_parameter_counts(preset, params):
    cfg = parse_workload({"model": {"kind": "llama", "preset": preset}}).model
    assert count(cfg) == params


def test_the_loss_in_fp32_upcasts_the_logits_as_torchtitan_does():
    logits = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    targets = torch.randint(0, 64, (2, 16))
    assert loss_fn(llama()).__call__(logits, targets).dtype == torch.bfloat16
    upcast = loss_fn(llama(loss_dtype="fp32"))(logits, targets)
    assert upcast.dtype == torch.float32
    assert upcast.item() == pytest.approx(torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten()).item())
    with pytest.raises(WorkloadError, match=r"model.loss_dtype: 'bf16' is not allowed \(allowed: 'model', 'fp32'\)"):
        llama(loss_dtype="bf16")


def test_explicit_keys_override_the_preset_and_tying_shares_the_head():
    cfg = parse_workload({"model": {"kind": "llama", "preset": "llama3-8b", "layers": 2, "seq_len": 1024}}).model
    assert (cfg.layers, cfg.seq_len, cfg.kv_heads, cfg.vocab) == (2, 1024, 8, 128256)
    untied, tied = count(llama()), count(llama(tie_embeddings=True))
    assert untied - tied == 64 * 32
    model = construct(llama(tie_embeddings=True))
    assert model.head.weight is model.tok_emb.weight


def test_llama_round_trips_through_the_run_folders_workload_json():
    w = parse_workload({"model": {"kind": "llama", "preset": "llama2-7b", "layers": 3}})
    again = parse_workload(w.to_dict())
    assert again.model == w.model


def test_llama_runs_on_fake_tensors_with_fused_attention_memory():
    """Under FakeTensorMode (what estimate and predict use) the model runs, and SDPA holds
    the fused kernel's outputs: no tensor of seq x seq elements per head exists."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg = llama(seq_len=256)
    sizes = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            sizes.extend(t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    with FakeTensorMode(), Sizes():
        model, _ = build_for_cell(cfg, 0, None)
        idx = torch.randint(0, cfg.vocab, (2, cfg.seq_len))
        loss_fn(cfg)(model(idx), idx).backward()
    per_head_scores = 2 * cfg.heads * cfg.seq_len * cfg.seq_len
    assert sizes and max(sizes) < per_head_scores


@pytest.mark.parametrize("mode", MODES[1:])
def test_checkpointing_gives_the_same_loss_and_gradients(mode):
    cfg = llama()
    inputs, targets = data.global_batch(cfg, 4, 0, 0)
    results = {}
    for m in ("none", mode):
        model, units = build_for_cell(cfg, 0, "cpu", m)
        loss = loss_fn(cfg)(model(inputs), targets)
        loss.backward()
        results[m] = (loss.detach(), [p.grad for p in model.parameters()])
    assert torch.equal(results["none"][0], results[mode][0])
    for a, b in zip(results["none"][1], results[mode][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_checkpointing_wraps_the_chosen_units():
    cfg = llama()
    names = {m: [type(u).__name__ for u in build_for_cell(cfg, 0, "cpu", m)[1]] for m in MODES}
    assert names["none"] == ["LlamaBlock"] * 4
    assert names["full"] == names["ops"] == ["CheckpointWrapper"] * 4
    assert names["every:2"] == ["CheckpointWrapper", "LlamaBlock"] * 2


def _activation_peak(mode: str) -> tuple[int, dict]:
    cfg = llama(seq_len=64)
    model, _ = build_for_cell(cfg, 0, "cpu", mode)
    inputs, targets = data.global_batch(cfg, 4, 0, 0)
    tracker = StorageTracker("cpu", timeline=False)
    with tracker:
        tracker.track_tensors(list(model.parameters()))
        tracker.reset_peak()
        tracker.set_phase("forward")
        loss = loss_fn(cfg)(model(inputs), targets)
        tracker.set_phase("backward")
        loss.backward()
        tracker.set_phase("optimizer")
        grads = [p.grad for p in model.parameters()]
    tracker.classify(params=list(model.parameters()), grads=grads)
    return tracker.peak_bytes, tracker.peak_breakdown()


def test_checkpointing_lowers_the_peak_and_recomputed_tensors_count_as_activations():
    peaks = {mode: _activation_peak(mode) for mode in MODES}
    assert peaks["full"][0] < peaks["every:2"][0] < peaks["none"][0]
    assert peaks["ops"][0] < peaks["none"][0]
    # In backward a checkpointed block re-creates its activations: the tracker counts them
    # as activations (without the recomputation mark they would be "other").
    assert peaks["full"][1]["activations"] > 0
    assert peaks["full"][1]["other"] < peaks["full"][1]["activations"]


def test_recomputed_storages_are_marked():
    from zerobench.spec import checkpointing

    seen = []
    cfg = llama(layers=1)
    model, units = build_for_cell(cfg, 0, "cpu", "full")
    units[0]._checkpoint_wrapped_module.register_forward_pre_hook(lambda *a: seen.append(checkpointing.recomputing()))
    inputs, targets = data.global_batch(cfg, 2, 0, 0)
    loss_fn(cfg)(model(inputs), targets).backward()
    assert seen == [False, True] and not checkpointing.recomputing()


@pytest.mark.parametrize("bad", ["every", "every:0", "every:x", "selective", 2, "Full"])
def test_bad_checkpointing_values_name_the_axis(bad):
    with pytest.raises(ValueError, match=r"activation_checkpointing: .* \(allowed: 'none', 'full', 'every:K'"):
        parse_mode(bad)
    w = parse_workload({"model": TINY_LLAMA, "matrix": {"activation_checkpointing": [bad]}})
    with pytest.raises(WorkloadError, match="activation_checkpointing"):
        expand(w)


def test_checkpointing_is_an_axis_of_every_engine():
    w = parse_workload({"model": TINY_LLAMA, "matrix": {
        "engine": ["ddp", "torch-zero1", "impl-zero1", "impl-zero2", "torch-fsdp1", "torch-fsdp2", "impl-fsdp"],
        "activation_checkpointing": list(MODES)}})
    cells = expand(w)
    assert len(cells) == 7 * 4 and all(c.skip_reason is None for c in cells)
    assert {c.opts["activation_checkpointing"] for c in cells} == set(MODES)
    assert "ddp-ws2-fp32" in {c.id for c in cells}  # the default keeps today's ids


@pytest.mark.parametrize("changes, match", [
    ({"preset": "llama4"}, r"model.preset: 'llama4' is not allowed; did you mean 'llama3-8b'\? "
                            r"\(allowed: 'llama2-7b', 'llama2-13b', 'llama3-8b', 'llama3-70b'\)"),
    ({"kv_heads": 3}, r"model.kv_heads: 3 does not divide model.heads=4"),
    ({"heads": 5}, r"model.heads: 5 does not divide model.d_model=32"),
    ({"ffn_hidden": 0}, r"model.ffn_hidden: 0 is not allowed \(allowed: int from 1 to 2\*\*63 - 1\)"),
    ({"rope_theta": -1.0}, r"model.rope_theta: -1.0 is not allowed"),
    ({"tie_embeddings": "yes"}, r"model.tie_embeddings: expected bool"),
    ({"mlp_ratio": 4}, r"unknown key model.mlp_ratio \(allowed in model: .*kv_heads"),
])
def test_bad_llama_keys_name_the_key(changes, match):
    with pytest.raises(WorkloadError, match=match):
        parse_workload({"model": {**TINY_LLAMA, **changes}})


# -- a user's model ----------------------------------------------------------------------

@pytest.fixture
def user_module(monkeypatch, tmp_path):
    """toy_factory.py in a fresh current folder, as a user's module sits beside their workload."""
    shutil.copy(MODELS / "toy_factory.py", tmp_path / "toy_factory.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path


def test_factory_model_builds_with_its_units_batches_and_loss(user_module):
    cfg = parse_workload({"model": {"factory": "toy_factory:build_regressor", "width": 16, "wrap": ["ToyBlock"],
                                    "batch": "toy_factory:regression_batch", "loss": "toy_factory:l1_loss"}}).model
    assert cfg.kind == "factory" and dict(cfg.kwargs) == {"width": 16}
    model, units = build_for_cell(cfg, 0, "cpu", "full")
    assert [type(u).__name__ for u in units] == ["CheckpointWrapper"] * 2
    inputs, targets = data.global_batch(cfg, 4, 0, 0)
    assert inputs.shape == (4, 16) and torch.equal(targets, inputs.flip(-1))
    loss = loss_fn(cfg)(model(inputs), targets)
    assert loss.item() > 0
    tokens = parse_workload({"model": {"factory": "toy_factory:build", "vocab": 64, "seq_len": 8, "wrap": ["ToyBlock"]}})
    assert data.global_batch(tokens.model, 2, 0, 0)[0].shape == (2, 8)
    assert parse_workload(tokens.to_dict()).model == tokens.model


@pytest.mark.parametrize("model, match", [
    ({"factory": "no_such_module:build", "wrap": ["X"], "vocab": 8, "seq_len": 4},
     r"model.factory: cannot import 'no_such_module'"),
    ({"factory": "toy_factory:nope", "wrap": ["X"], "vocab": 8, "seq_len": 4},
     r"model.factory: module 'toy_factory' has no 'nope'"),
    ({"factory": "toy_factory:not_a_module", "wrap": ["X"], "vocab": 8, "seq_len": 4},
     r"model.factory: toy_factory:not_a_module returned dict, not a torch.nn.Module"),
    ({"factory": "toy_factory:build", "wrap": ["Block"], "vocab": 8, "seq_len": 4},
     r"model.wrap: 'Block' is the class of no module of the model; did you mean 'ToyBlock'\? \(allowed: .*ToyBlock"),
])
def test_factory_errors_name_the_key(user_module, model, match):
    cfg = parse_workload({"model": model}).model
    with pytest.raises(WorkloadError, match=match):
        build_for_cell(cfg, 0)


@pytest.mark.parametrize("model, match", [
    ({"factory": "toy_factory.build", "wrap": ["ToyBlock"]}, r"model.factory: 'toy_factory.build' is not allowed"),
    ({"factory": "toy_factory:build"}, r"model.wrap: missing"),
    ({"factory": "toy_factory:build", "wrap": ["ToyBlock"]}, r"model.vocab: required as an int >= 1 without model.batch"),
    ({"factory": "toy_factory:build", "wrap": ["ToyBlock"], "vocab": 8, "seq_len": 4, "loss": "huber"},
     r"model.loss: 'huber' is not allowed \(allowed: 'cross_entropy', 'mse' or 'package.module:function'\)"),
])
def test_factory_table_errors_name_the_key(model, match):
    with pytest.raises(WorkloadError, match=match):
        parse_workload({"model": model})


def test_hf_config_that_does_not_parse_names_the_key(tmp_path):
    (tmp_path / "config.json").write_text("{\"model_type\": \"llama\", ")
    with pytest.raises(WorkloadError, match=r"model.config: .*config.json is not valid JSON"):
        parse_workload({"model": {"kind": "hf", "config": str(tmp_path / "config.json")}})
    with pytest.raises(WorkloadError, match=r"model.config: cannot read"):
        parse_workload({"model": {"kind": "hf", "config": str(tmp_path / "missing.json")}})


def test_hf_config_path_is_relative_to_the_workload_file(tmp_path):
    (tmp_path / "sub").mkdir()
    shutil.copy(MODELS / "hf-llama-tiny.json", tmp_path / "sub" / "config.json")
    (tmp_path / "w.toml").write_text('[model]\nkind = "hf"\nconfig = "sub/config.json"\n')
    from zerobench.spec.workload import load_workload

    assert load_workload(tmp_path / "w.toml").model.config == str((tmp_path / "sub" / "config.json").resolve())


def test_units_are_the_blocks_for_our_models():
    for cfg in (llama(), parse_workload({"model": {"kind": "gpt"}}).model, parse_workload({}).model):
        model = construct(cfg)
        assert sharding_units(model, cfg) == list(model.blocks)
    assert dataclasses.is_dataclass(llama())
