"""Calibrate's collectives, used: ``zerobench calibrate`` writes a link file from the
collectives it measured, and ``predict --link FILE`` prices collectives with it ([Note:
measured links] in zerobench/instruments/link.py). The round trip on the CPU path: two
ranks over gloo."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from zerobench.instruments.link import LINK_FORMAT, Link, read_link_file, resolve_link
from zerobench.instruments.vgpu import comm


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """``zerobench calibrate --device cpu --section collectives --ranks 2``: its folder."""
    from zerobench.cli import main

    root = tmp_path_factory.mktemp("calibrate")
    assert main(["calibrate", "--device", "cpu", "--section", "collectives", "--ranks", "2",
                 "--results", str(root)]) == 0
    (folder,) = root.iterdir()
    return folder


def test_calibrate_writes_a_link_file_of_what_it_measured(calibrated):
    measured = json.loads((calibrated / "measurements.json").read_text())["collectives"]["rows"]
    link = json.loads((calibrated / "link.json").read_text())
    assert link["format"] == LINK_FORMAT and link["world_size"] == 2 and link["rows"] == measured
    assert {kind for kind, _, _ in link["curves"]} == {"all_gather", "reduce_scatter", "all_reduce"}
    assert link["bandwidth_gbps"] == max(r["busbw_gbps"] for r in measured)


def test_a_collective_of_a_measured_size_takes_the_time_measured(calibrated):
    link = resolve_link(str(calibrated / "link.json"))
    assert link.curves and link.world_size == 2
    rows = json.loads((calibrated / "measurements.json").read_text())["collectives"]["rows"]
    for row in rows:
        predicted = comm.collective_seconds(row["kind"], row["nbytes"], row["world_size"], link)
        assert predicted == pytest.approx(row["seconds"], rel=1e-9), row
    # between two measured sizes: between their times; a kind not measured takes all-reduce's curve
    ag = sorted((r for r in rows if r["kind"] == "all_gather"), key=lambda r: r["nbytes"])
    middle = comm.collective_seconds("all_gather", (ag[0]["nbytes"] + ag[1]["nbytes"]) // 2, 2, link)
    assert min(ag[0]["seconds"], ag[1]["seconds"]) <= middle <= max(ag[0]["seconds"], ag[1]["seconds"])
    assert comm.measured_busbw(link, "broadcast", 1 << 16) == comm.measured_busbw(link, "all_reduce", 1 << 16)
    # what predict hands its child process reads back as the same link
    assert Link(**json.loads(json.dumps(link.to_json()))) == link


def test_predict_prices_collectives_with_the_measured_link(calibrated, tmp_path):
    from zerobench.whatif.predict import predict
    from zerobench.whatif.predict.request import PredictRequest

    path = str(calibrated / "link.json")
    rows = {}
    for name, link in (("measured", path), ("nvlink4", "nvlink4-8gpu")):
        out = predict(PredictRequest("workloads/quickstart.toml", (2,), link=link, results_root=tmp_path / name,
                                     only=("impl-fsdp-fp32",)), log=lambda *_: None)
        rows[name] = pd.read_csv(out / "predict.csv").iloc[0]
    assert rows["measured"]["status"] == "ok" and rows["measured"]["link"] == read_link_file(path).name
    # gloo between two CPU processes moves about 0.1 GB/s, NVLink 4 hundreds: the step's
    # collectives take far longer on the link calibrate measured
    assert rows["measured"]["comm_s"] > 20 * rows["nvlink4"]["comm_s"]


def test_a_bad_link_file_is_named_before_anything_is_written(tmp_path):
    from zerobench.whatif.predict import resolve_devices

    bad = tmp_path / "link.json"
    bad.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match=r"^--link: link file .*link.json: format must be 'zerobench-link/1'"):
        resolve_devices("h100-sxm", None, str(bad), None, "", None, None)
    bad.write_text(json.dumps({"format": LINK_FORMAT, "bandwidth_gbps": 1.0, "latency_us": 1.0, "world_size": 2,
                               "curves": [["all_gather", [4096, 1024], [1.0, 2.0]]]}))
    with pytest.raises(ValueError, match="all_gather's sizes must be distinct, increasing"):
        read_link_file(bad)
    with pytest.raises(ValueError, match="no such file|does not exist|No such file"):
        resolve_link(str(tmp_path / "missing.json"))
