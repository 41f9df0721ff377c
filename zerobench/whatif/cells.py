"""What ``zerobench estimate`` and ``zerobench predict`` share: the workload's engine
configurations (its matrix without the world-size axis), which of them run at which world
size, the ``--world-sizes`` option, the version columns of their rows and the folder they
write. Neither driver imports the other."""

from __future__ import annotations

import dataclasses


def parse_world_sizes(text: str) -> list[int]:
    """"8,64,1024" -> [8, 64, 1024]; ValueError naming the bad value otherwise."""
    out = []
    for part in str(text).split(","):
        try:
            ws = int(part)
        except ValueError:
            raise ValueError(f"--world-sizes: {part!r} is not allowed (allowed: comma-separated ints >= 1)") from None
        if ws < 1:
            raise ValueError(f"--world-sizes: {ws} is not allowed (allowed: ints >= 1)")
        if ws in out:
            raise ValueError(f"--world-sizes: {ws} is repeated (allowed: each world size once)")
        out.append(ws)
    return out


def configurations(workload, world_sizes=(2,)):
    """The distinct engine configurations of the workload's matrix (world size left out):
    those valid at one or more of ``world_sizes`` (a configuration such as HYBRID_SHARD
    can be valid at 8 ranks and not at 2), as cells at the first world size they are
    valid at. Which world sizes each one runs at is ``why_not``'s to say."""
    from zerobench.spec.matrix import expand

    seen, out = set(), []
    for ws in world_sizes:
        matrix = dict(workload.matrix)
        matrix["world_size"] = [ws]
        for cell in expand(dataclasses.replace(workload, matrix=matrix)):
            key = (cell.engine, cell.dtype, cell.options)
            if cell.skip_reason is None and key not in seen:
                seen.add(key)
                out.append(cell)
    return out


def select_configurations(w, only=None, world_sizes=(2,)) -> list:
    """The workload's configurations valid at one or more of ``world_sizes``, or those
    whose id is in ``only`` (``--config``); an id that names none is an error listing
    the ids there are."""
    cells = configurations(w, world_sizes)
    if not only:
        return cells
    ids = [c.config_id for c in cells]
    unknown = [i for i in only if i not in ids]
    if unknown:
        from zerobench.choices import not_allowed

        raise ValueError(not_allowed("--config", unknown[0], ids, show=str,
                                     what=f"is not a configuration of workload {w.name!r}"))
    return [c for c, i in zip(cells, ids) if i in only]


def check_hybrid_shard_size(size: int | None, world_sizes) -> None:
    """ValueError naming ``--hybrid-shard-size`` unless it divides every world size."""
    if size is None:
        return
    if size < 1:
        raise ValueError(f"--hybrid-shard-size: {size} is not allowed (allowed: int >= 1)")
    bad = [ws for ws in world_sizes if ws % size]
    if bad:
        common = [d for d in range(1, min(world_sizes) + 1) if all(ws % d == 0 for ws in world_sizes)]
        raise ValueError(f"--hybrid-shard-size: {size} does not divide world size {bad[0]} (allowed: a divisor of "
                         f"every --world-sizes value: {', '.join(map(str, common))})")


def why_not(cell, world_size: int, hybrid_shard_size: int | None) -> str | None:
    """Why this configuration cannot be estimated at ``world_size`` (None if it can)."""
    from zerobench.engines import get_engine

    if world_size < 1:
        return f"world size {world_size} is not allowed (allowed: >= 1)"
    why = get_engine(cell.engine).unsupported(cell.opts, cell.dtype, world_size, "cpu")
    if why:
        return why
    if cell.opts.get("sharding_strategy") == "HYBRID_SHARD":
        if hybrid_shard_size and world_size % hybrid_shard_size:
            return (f"HYBRID_SHARD: world size {world_size} is not a multiple of the shard group size "
                    f"{hybrid_shard_size} (--hybrid-shard-size)")
    return None


def versions() -> dict[str, str | None]:
    """The torch and zerobench versions, columns of every row of estimate.csv and
    predict.csv: part of a row's identity when ``zerobench compare`` gates it ([Note:
    comparing what-if folders] in zerobench/analysis/compare/whatif.py)."""
    import torch

    from zerobench.runs.folder import zerobench_version

    return {"torch_version": torch.__version__, "zerobench_version": zerobench_version()}


def configurations_to_run(w, workload_path, only, world_sizes, tool: str, log=print) -> list:
    """:func:`select_configurations`, refusing a workload none of whose configurations
    can run (ValueError naming the workload file and ``zerobench cells``); the matrix's
    notes (axes dropped, no [matrix]) go to ``log``, as ``zerobench run`` prints them."""
    from zerobench.spec.matrix import matrix_notes

    cells = select_configurations(w, only, world_sizes)
    if not cells:
        raise ValueError(f"{workload_path}: no configuration of workload {w.name!r} can be {tool}ed: every cell "
                         f"of its matrix is skipped (`zerobench cells {workload_path}` says why)")
    for note in matrix_notes(w):
        log(note)
    return cells


def new_results_folder(results_root, w, tool: str):
    """A new folder ``<results_root>/<stamp>-<workload>-<tool>`` holding the workload.json
    it is made from (zerobench/runs/kinds.py: what marks each kind of results folder); a
    workload already named for the tool (``llama3-8b-estimate``) is not named twice."""
    from zerobench.runs.files import new_stamped_dir, write_json_atomic
    from zerobench.runs.kinds import WORKLOAD_FILE

    name = w.name if w.name.endswith(f"-{tool}") else f"{w.name}-{tool}"
    out_dir = new_stamped_dir(results_root, name)
    write_json_atomic(out_dir / WORKLOAD_FILE, w.to_dict())
    return out_dir


def ran_notes(frame) -> list[str]:
    """A table's notes for the rows whose engine ignored a setting or ran something else
    than the row says ([Note: say what ran] in zerobench/engines/base.py), one line per
    configuration and note: ``config at ws1, ws2: note``."""
    if "note" not in frame.columns:
        return []
    noted = frame[(frame["status"] == "ok") & frame["note"].notna() & (frame["note"].astype(str) != "")]
    return [f"{config} at {', '.join(f'ws{int(s)}' for s in group['world_size'])}: {note}"
            for (config, note), group in noted.groupby(["config", "note"], sort=False)]
