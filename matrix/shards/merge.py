"""One run from several shard reports: python -m matrix merge A B ... -o DIR.

Shards come from `pytest cases --shard K/N` on N machines. Each writes the plan all of them
share (matrix/shards/plan.py); the cells it gives a shard that did not report them (a shard that
died, timed out, or never uploaded) are listed under `missing`, and the run is incomplete.

Merging refuses inputs that ran different stacks (package versions, version stack name,
project commit) unless asked, since one grid should answer one question. A cell id present in
two inputs is an error: shards are disjoint. When one device axis value ran on different
hardware in different inputs (cuda on an H100 here and on an A100 there), the cells keep their
hardware apart: the device becomes `cuda-h100-80gb-hbm3` and `cuda-a100-sxm4-40gb`, so each
gets its own column in the grids.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path

from matrix.grid.cell import Cell, SelectionError
from matrix.grid.packages import STACK
from matrix.results import journal
from matrix.results.document import results_document
from matrix.results.files import AXES, load
from matrix.results.run_directory import write_new_directory
from matrix.shards.plan import PLAN_FILE, parse_shard, read_plan


class MergeError(ValueError):
    """Inputs that cannot be merged into one run; str() says which and why."""


def release(version: str | None) -> str | None:
    """'2.13.0+cu128' -> '2.13.0': one release, whichever build of it a machine needs."""
    return version.split("+", 1)[0] if version else version


def stack_of(document: dict) -> dict:
    packages = document["environment"].get("packages") or {}
    run = document["run"]
    return {
        **{name: release(packages.get(name)) for name in STACK},
        "version stack": run.get("stack"),
        "project commit": run.get("git_commit"),
    }


def slug(name: str) -> str:
    words = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("(r)", "").replace("(tm)", "")).strip("-")
    return words.removeprefix("nvidia-") or "unknown"


def _hardware(cell: dict, document: dict) -> str | None:
    """The device a cell ran on: recorded per cell since schema 4, else the run's own."""
    if cell.get("device_name"):
        return cell["device_name"]
    env = document["environment"]
    if cell["device"] == "cpu":
        return env.get("cpu")
    gpus, index = env.get("cuda_devices") or [], env.get("selected_cuda_device")
    return gpus[index]["name"] if isinstance(index, int) and index < len(gpus) else None


def merge(paths: list[Path], *, allow_mixed_stacks: bool = False, run_id: str | None = None) -> dict:
    if not paths:
        raise MergeError("nothing to merge: give two or more report directories or results.json files")
    inputs = [load(path) for path in paths]
    first, first_file = inputs[0]

    ids = [document["run"]["id"] for document, _ in inputs]
    repeated = sorted({run for run in ids if ids.count(run) > 1})
    if repeated:
        raise MergeError(f"run {repeated[0]} is given more than once")
    if not allow_mixed_stacks:
        expected = stack_of(first)
        for document, file in inputs[1:]:
            differing = [
                f"{key} {expected[key]} in {first_file} but {value} in {file}"
                for key, value in stack_of(document).items()
                if value != expected[key]
            ]
            if differing:
                raise MergeError(
                    f"different stacks: {'; '.join(differing)} (one grid per stack; --allow-mixed-stacks merges anyway)"
                )
    planned = shard_plan(inputs)
    warnings = shard_warnings(inputs, planned)

    hardware: dict[str, set[str]] = {}
    for document, _ in inputs:
        for cell in document["cells"]:
            if cell["outcome"] != "skipped" and _hardware(cell, document):
                hardware.setdefault(cell["device"], set()).add(_hardware(cell, document))
    split = {device for device, names in hardware.items() if len(names) > 1}

    records: dict[str, tuple[dict, Path]] = {}
    reported = {cell["id"] for document, _ in inputs for cell in document["cells"]}
    missing = {entry["id"]: entry for document, _ in inputs for entry in document.get("missing", [])}
    for k, cell_ids in enumerate(planned["cells"] if planned else [], start=1):
        missing.update({cell_id: {"id": cell_id, "shard": f"{k}/{planned['shards']}"} for cell_id in cell_ids})
    missing = [entry for cell_id, entry in missing.items() if cell_id not in reported]
    if missing:
        by_shard = Counter(entry["shard"] or "unsharded" for entry in missing)
        warnings.append(
            f"{len(missing)} planned cells never reported ("
            + ", ".join(f"shard {shard}: {count}" for shard, count in sorted(by_shard.items()))
            + "): they are listed as missing"
        )
    for document, file in inputs:
        for cell in document["cells"]:
            # the fields an older schema's cells lack (4: placement and rerun, 5: traceback)
            record = {"cuda_index": None, "device_name": None, "rerun": None, "traceback": None, **cell}
            if cell["device"] in split and _hardware(cell, document):
                record["device"] = f"{cell['device']}-{slug(_hardware(cell, document))}"
                record["id"] = Cell(**{axis: record[axis] for axis in AXES}).id
            if record["id"] in records:
                raise MergeError(
                    f"cell {record['id']} is in both {records[record['id']][1]} and {file}; shards must not overlap"
                )
            records[record["id"]] = (record, file)

    runs = [document["run"] for document, _ in inputs]
    selection = {}
    for axis, values in first["run"].get("axes", {}).items():
        chosen = {value for run in runs for value in run.get("selection", {}).get(axis, [])}
        selection[axis] = [value for value in values if value in chosen]
    now = time.time()
    run = {
        "id": run_id or journal.new_run_id(),
        "command": "python -m matrix merge " + " ".join(str(path) for path in paths),
        "started_at": min(run.get("started_at") or "" for run in runs),
        "finished_at": max(run.get("finished_at") or "" for run in runs),
        "duration_s": max(run.get("duration_s") or 0 for run in runs),  # shards run side by side
        "pytest_exit_status": max(run.get("pytest_exit_status") or 0 for run in runs),
        "selection": selection,
        "axes": first["run"].get("axes", {}),
        "workers": None,
        "shard": None,
        # the shards' --order-seed when they share one (a nightly's do); null when they differ
        "order_seed": seeds.pop() if len(seeds := {run.get("order_seed") for run in runs}) == 1 else None,
        "cuda_device": None,
        "stack": first["run"].get("stack"),
        "git_commit": first["run"].get("git_commit"),
        "git_dirty": any(run.get("git_dirty") for run in runs),
        "incomplete": any(run.get("incomplete") for run in runs) or bool(warnings),
        "merged_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "merged_from": [merged_from_entry(document, file) for document, file in inputs],
    }
    environment = dict(first["environment"])
    environment["warnings"] = list(
        dict.fromkeys([*warnings, *(w for document, _ in inputs for w in document["environment"].get("warnings", []))])
    )
    explorations = [e for document, _ in inputs for e in document.get("explorations", [])]
    kind_setups = [s for document, _ in inputs for s in document.get("kind_setups", [])]
    return results_document(
        run,
        environment,
        [record for record, _ in records.values()],
        explorations,
        first.get("precisions") or {},
        kind_setups=kind_setups,
        missing=missing,
    )


def shard_warnings(inputs, planned: dict | None = None) -> list[str]:
    """Shards of the split that no input is; one the plan gave no cell is not missing."""
    shards = [document["run"].get("shard") for document, _ in inputs]
    if not any(shards):
        return []
    parsed = set()
    for shard, (_, file) in zip(shards, inputs, strict=True):
        if not shard:
            raise MergeError(f"{file}: run.shard: missing, while other inputs are shards")
        try:
            parsed.add(parse_shard(shard))
        except SelectionError as error:
            raise MergeError(f"{file}: run.shard: {str(error).removeprefix('--shard: ')}") from None
    totals = {n for _, n in parsed}
    if len(totals) > 1:
        raise MergeError(f"run.shard: shards of different splits ({', '.join(sorted(shards))}) cannot be merged")
    total = totals.pop()
    missing = sorted(set(range(1, total + 1)) - {k for k, _ in parsed})
    if planned and planned["shards"] == total:
        missing = [k for k in missing if planned["cells"][k - 1]]
    if not missing:
        return []
    return [f"shards {', '.join(f'{k}/{total}' for k in missing)} are missing: this run is incomplete"]


def shard_plan(inputs) -> dict | None:
    """The plan the shards ran by (shard-plan.json beside each shard's results.json): every shard
    computes the same one, so two that differ ran different selections or costs."""
    plans = [(plan, file) for plan, file in ((read_plan(file.parent), file) for _, file in inputs) if plan]
    for plan, file in plans[1:]:
        if (plan["shards"], plan["cells"]) != (plans[0][0]["shards"], plans[0][0]["cells"]):
            raise MergeError(
                f"{file.parent / PLAN_FILE} and {plans[0][1].parent / PLAN_FILE} plan different shards: give every "
                "shard the same selection and the same --shard-costs"
            )
    return plans[0][0] if plans else None


def merged_from_entry(document: dict, file: Path) -> dict:
    run, env = document["run"], document["environment"]
    return {
        "id": run["id"],
        "file": str(file),
        "shard": run.get("shard"),
        "stack": run.get("stack"),
        "git_commit": run.get("git_commit"),
        "packages": env.get("packages"),
        "cpu": env.get("cpu"),
        "cuda_devices": env.get("cuda_devices", []),
        "selected_cuda_device": env.get("selected_cuda_device"),
        "cells": len(document["cells"]),
        "duration_s": run.get("duration_s"),
    }


def write_merged(document: dict, output: Path) -> Path:
    if output.exists():
        raise MergeError(f"{output}: exists; merge writes a new directory and never into an existing one")
    write_new_directory(output, document)
    return output
