"""What the reports show as grids and what they sum up as "not run here" (matrix/results/reach.py)."""

import itertools

from hypothesis import given
from hypothesis import strategies as st

from matrix.results.reach import general_reason, reach

AXES = {
    "model": ("tiny-llama", "lora"),
    "precision": ("fp32", "bf16-mixed", "nf4-bf16-mixed"),
    "mode": ("train", "eval"),
    "device": ("cpu", "cuda"),
    "engine": ("torch", "ddp", "deepspeed-zero1"),
}
REASONS = ("Requires: [CUDA device]", "Requires: [deepspeed] (not installed)", "wired into the <engine> engine")


def document(outcomes: dict[tuple, str | None]) -> dict:
    """Cells of AXES; `outcomes`: axes -> None (passed) or a skip reason (<engine> put as the cell's own)."""
    cells = []
    for values, reason in outcomes.items():
        axes = dict(zip(AXES, values, strict=True))
        cell = {"id": "-".join(values), **axes, "outcome": "passed", "skip_reason": None}
        if reason is not None:
            cell.update(outcome="skipped", skip_reason=reason.replace("<engine>", axes["engine"]))
        cells.append(cell)
    return {"run": {"axes": {axis: list(values) for axis, values in AXES.items()}}, "precisions": {}, "cells": cells}


ALL = list(itertools.product(*AXES.values()))


def key(cell: dict, *axes: str) -> tuple:
    return tuple(cell[axis] for axis in axes)


COLUMN = ("device", "mode", "precision")
ROW = ("device", "mode", "model", "engine")
BLOCK = ("device", "mode", "model", "precision")  # one model's engines in one precision column


@given(st.lists(st.one_of(st.none(), st.sampled_from(REASONS)), min_size=len(ALL), max_size=len(ALL)))
def test_every_cell_is_either_in_a_grid_or_in_one_line_and_what_ran_is_always_in_a_grid(reasons):
    doc = document(dict(zip(ALL, reasons, strict=True)))
    cells = doc["cells"]
    shown = reach(doc)
    listed = [c["id"] for group in shown.not_run for c in group.cells]
    assert len(listed) == len(set(listed)) and set(listed).isdisjoint(shown.shown)
    assert set(listed) | shown.shown == {c["id"] for c in cells}
    assert all(group.reason in (c["skip_reason"], general_reason(c)) for group in shown.not_run for c in group.cells)
    assert len({g.reason for g in shown.not_run}) == len(shown.not_run)
    assert [len(g.cells) for g in shown.not_run] == sorted((len(g.cells) for g in shown.not_run), reverse=True)

    ran = [c for c in cells if c["outcome"] != "skipped"]
    devices_that_ran = {c["device"] for c in ran}
    columns_that_ran = {key(c, *COLUMN) for c in ran}
    rows_that_ran = {key(c, *ROW) for c in ran}
    blocks_that_ran = {key(c, *BLOCK) for c in ran}
    for cell in cells:
        if cell["outcome"] != "skipped":
            assert cell["id"] in shown.shown, cell["id"]  # what ran is never summed up
            continue
        beside_a_run = (
            cell["device"] in devices_that_ran
            and key(cell, *COLUMN) in columns_that_ran
            and key(cell, *ROW) in rows_that_ran
            and key(cell, *BLOCK) in blocks_that_ran
        )
        # a skip stays in its grid exactly where its device, column, row and block ran something
        assert (cell["id"] in shown.shown) == beside_a_run, cell["id"]


def test_a_missing_extra_is_one_line_naming_its_engines_and_a_missing_gpu_another():
    outcomes = {}
    for values in ALL:
        axes = dict(zip(AXES, values, strict=True))
        if axes["device"] == "cuda":
            outcomes[values] = "Requires: [CUDA device] (none visible)"
        elif axes["engine"] == "deepspeed-zero1":
            outcomes[values] = "Requires: [deepspeed] (not installed: pip install '.[deepspeed]')"
        elif axes["precision"] == "nf4-bf16-mixed" and axes["model"] == "tiny-llama":
            outcomes[values] = "Requires: [adapters to train over a quantized base] (tiny-llama trains its own weights)"
        elif axes["precision"] == "nf4-bf16-mixed" and axes["engine"] == "ddp":
            outcomes[values] = "Requires: [a quantized base wired into the ddp engine]"
        else:
            outcomes[values] = None
    shown = reach(document(outcomes))
    lines = [(len(g.cells), g.reason, g.scope(shown.axes)) for g in shown.not_run]
    assert lines == [
        (36, "Requires: [CUDA device] (none visible)", "device cuda"),
        (
            12,  # 2 models x 3 precisions x 2 modes
            "Requires: [deepspeed] (not installed: pip install '.[deepspeed]')",
            "engine deepspeed-zero1; device cpu",
        ),
        (
            4,  # a precision the kind cannot take: its block of the nf4 column, in both modes
            "Requires: [adapters to train over a quantized base] (tiny-llama trains its own weights)",
            "engines torch, ddp; model tiny-llama; precision nf4-bf16-mixed; device cpu",
        ),
    ]
    # left in the grids: lora's nf4 block ran on torch, so its ddp cells are skips in place
    in_grid = {
        c["id"] for c in document(outcomes)["cells"] if c["id"] in shown.shown and c["precision"] == "nf4-bf16-mixed"
    }
    assert in_grid == {
        f"lora-nf4-bf16-mixed-{mode}-cpu-{engine}" for mode in ("train", "eval") for engine in ("torch", "ddp")
    }


def test_a_reason_naming_its_own_engine_or_model_is_one_reason():
    cell = {
        "engine": "hf-trainer-zero2",
        "model": "lora",
        "skip_reason": "gradients wired into the hf-trainer-zero2 engine; lora",
    }
    assert general_reason(cell) == "gradients wired into the <engine> engine; <model>"
    # another engine's name, or the cell's name inside a longer one, stays as it is
    other = {"engine": "hf-trainer", "model": "lora", "skip_reason": "needs hf-trainer-zero2, not hf-trainer; qlora"}
    assert general_reason(other) == "needs hf-trainer-zero2, not <engine>; qlora"
