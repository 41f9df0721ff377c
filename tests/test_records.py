"""Cell and rank records are typed (zerobench/schema/records.py): checked where they are
written as well as where they are read, the JSON unchanged; and booleans come back from
CSV as booleans, by their column's type."""

from __future__ import annotations

import glob
import json

import pandas as pd
import pytest

from zerobench.runs.folder import DamagedFile, RunFolder, check_record, read_table
from zerobench.schema.records import CellRecord, RankRecord, RecordError

RANK = {"metrics": {"step_time_s": 0.01}, "step_times": [0.01, 0.02], "losses": [1.0, 0.9], "rank": 0}


def _cell(**changes) -> dict:
    return {"cell_id": "ddp-ws1-fp32", "status": "ok", "error": None,
            "config": {"engine": "ddp", "world_size": 1, "dtype": "fp32"}, "ranks": [RANK], **changes}


def test_every_record_under_results_reads_back_and_writes_the_same_json():
    paths = glob.glob("results/**/cells/*.json", recursive=True)
    assert paths
    for path in paths:
        data = json.load(open(path))
        assert json.dumps(CellRecord.from_json(data).to_json(), sort_keys=True) == json.dumps(data, sort_keys=True)


@pytest.mark.parametrize("changes, message", [
    ({"status": "done"}, r"cell record ddp-ws1-fp32.status: 'done' is not allowed \(allowed: ok, failed, skipped\)"),
    ({"config": {"engine": "ddp", "world_size": "1"}}, r"config.world_size: '1' is not allowed \(allowed: an int >= 1\)"),
    ({"ranks": [{**RANK, "losses": ["x"]}]}, r"rank 0's record.losses: \['x'\] is not allowed \(allowed: a list of"),
    ({"ranks": [{**RANK, "rank": -1}]}, r"rank record.rank: -1 is not allowed \(allowed: an int >= 0\)"),
    ({"cell_id": 3}, r"cell record.cell_id: 3 is not allowed"),
])
def test_a_bad_field_is_refused_by_name_where_the_record_is_written(tmp_path, changes, message):
    folder = RunFolder(tmp_path)
    with pytest.raises(RecordError, match=message):
        folder.write_cell(_cell(**changes))
    assert not folder.cells_dir.exists() or not any(folder.cells_dir.iterdir())  # nothing written
    assert check_record(_cell(**changes))  # and the reader says why too


def test_a_record_keeps_what_it_does_not_know_and_its_nulls(tmp_path):
    data = _cell(loss_max_abs_diff_ref=None, future_field={"x": 1}, ranks=[{**RANK, "ran": {"a": 1}, "new": 2}])
    folder = RunFolder(tmp_path)
    folder.write_cell(data)
    assert json.loads(folder.cell_path("ddp-ws1-fp32").read_text()) == data
    record = CellRecord.from_json(data)
    assert isinstance(record.ranks[0], RankRecord) and record.ranks[0].ran == {"a": 1}
    assert record.extra == {"future_field": {"x": 1}}


def test_booleans_come_back_as_booleans_by_their_columns_type(tmp_path):
    path = tmp_path / "results.csv"
    pd.DataFrame({"cell_id": ["a", "b", "c"], "limit_all_gathers": [True, None, False],
                  "forward_prefetch": ["True", "False", None]}).to_csv(path, index=False)
    frame = read_table(path)
    assert frame["limit_all_gathers"].tolist()[0] is True and frame["limit_all_gathers"].tolist()[2] is False
    assert pd.isna(frame["limit_all_gathers"].tolist()[1])
    assert [v for v in frame["forward_prefetch"].tolist()[:2]] == [True, False]
    pd.DataFrame({"cell_id": ["a"], "limit_all_gathers": ["on"]}).to_csv(path, index=False)
    with pytest.raises(DamagedFile, match=r"limit_all_gathers: 'on' is not allowed in a boolean column "
                                         r"\(allowed: True, False or empty\)"):
        read_table(path)
