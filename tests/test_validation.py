"""The validation table's plumbing (zerobench/whatif/predict/published.py): every published
run names a workload that loads and a configuration it has, and the table reads errors
off predict.csv. (Predicting the runs themselves takes minutes: docs/vgpu.md.)"""

from __future__ import annotations

import pandas as pd
import pytest

from zerobench.spec.workload import load_workload
from zerobench.whatif.cells import configurations
from zerobench.whatif.predict.published import PUBLISHED, to_markdown, validate


@pytest.mark.parametrize("published", PUBLISHED, ids=lambda p: p.name)
def test_each_published_run_has_its_workload_and_configuration(published):
    w = load_workload(published.workload)
    ids = [c.config_id for c in configurations(w, [published.world_size])]
    assert published.config in ids
    assert published.figures


def test_an_unknown_run_is_refused_naming_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"--only: nope is not a published run \(allowed: pr129721, "):
        validate(tmp_path, ["nope"])


def test_the_table_gives_the_error_and_a_capped_cell_says_why():
    frame = pd.DataFrame([
        {"run": "a", "figure": "tokens_per_s", "published": 1000, "predicted": 1150.0, "error": 0.15,
         "status": "ok", "reason": None},
        {"run": "b", "figure": "peak_reserved_bytes", "published": 2**30, "predicted": None, "error": None,
         "status": "capped", "reason": "reserved memory reached 78 GiB"}])
    text = to_markdown(frame)
    assert "| a | tokens_per_s | 1,000 | 1,150 | +15.0 % | ok |" in text
    assert "| b | peak_reserved_bytes | 1.00 GiB | - | - | capped: reserved memory reached 78 GiB |" in text


def test_each_published_run_is_predicted_on_the_part_that_ran_it():
    """torchtitan's and PR #129721's H100s were Grand Teton's: 96 GB of HBM2e at 2.4 TB/s
    capped at 500 W (pytorch/torchtitan/docs/performance.md); its torch of June 2024 ran flash
    attention. Every row's preset loads."""
    from zerobench.instruments.vgpu.presets import gpu_preset

    for p in PUBLISHED:
        gpu_preset(p.hardware["gpu"])
    row = next(p for p in PUBLISHED if p.name == "pr129721")
    part = gpu_preset(row.hardware["gpu"])
    assert (part.memory_bytes, part.hbm_bytes_per_s, part.power_cap_w) == (96 * 2**30, 2.4e12, 500)
    assert "pytorch/torchtitan/docs/performance.md" in part.sources["power_cap_w"]
    assert row.software["sdpa_backend"] == "flash"
