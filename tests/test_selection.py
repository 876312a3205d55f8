"""Axis selection: comma lists, axis order, and unknown values as usage errors."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from matrix.selection.cells import Cell, SelectionError, axis_values, cell_from_id, enumerate_cells, parse_selection

AXES = axis_values()


@given(st.sampled_from(sorted(AXES)), st.data())
def test_any_subset_is_selected_in_axis_order(axis, data):
    chosen = data.draw(st.lists(st.sampled_from(AXES[axis]), min_size=1, unique=True))
    selected = parse_selection(axis, ",".join(chosen))
    assert set(selected) == set(chosen)
    assert list(selected) == [v for v in AXES[axis] if v in chosen]


@pytest.mark.parametrize("text", [None, "", " , "])
def test_nothing_selected_means_every_value(text):
    assert parse_selection("precision", text) == AXES["precision"]


def test_unknown_value_names_valid_values():
    with pytest.raises(SelectionError) as info:
        parse_selection("precision", "bf16-mixed,fp8")
    message = str(info.value)
    assert message.startswith("--precision: unknown value 'fp8'")
    for value in AXES["precision"]:
        assert value in message


def test_every_precision_the_issue_names_exists():
    assert {
        "fp32",
        "fp16-mixed",
        "bf16-mixed",
        "bf16-true",
        "fp16-true",
        "bf16-loaded-mixed",
        "fp16-loaded-mixed",
    } <= set(AXES["precision"])
    assert set(AXES["model"]) >= {"tiny-transformer", "tiny-llama", "lora", "gemma-cache"}
    assert AXES["mode"] == ("train", "eval") and AXES["device"] == ("cpu", "cuda")
    engines = (
        *("torch", "accelerate", "hf-trainer", "lightning", "ddp", "fsdp2", "accelerate-fsdp2"),
        *("deepspeed-zero0", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"),
        *("hf-trainer-zero2", "hf-trainer-zero3"),
    )
    # each engine with its compiled twin beside it
    assert AXES["engine"] == tuple(name for engine in engines for name in (engine, f"{engine}-compile"))
    # the compiled twins run only where a selection names them (docs/compile-and-float8.md)
    assert parse_selection("engine", None) == tuple(e for e in AXES["engine"] if not e.endswith("-compile"))


def test_cell_ids_read_like_the_cell_and_are_unique():
    cells = enumerate_cells(AXES)
    assert Cell("gemma-cache", "bf16-mixed", "eval", "cpu").id == "gemma-cache-bf16-mixed-eval-cpu-torch"
    ids = [c.id for c in cells]
    assert len(ids) == len(set(ids)) == len(AXES["model"]) * len(AXES["precision"]) * 2 * 2 * len(AXES["engine"])
    assert all(cell_from_id(c.id) == c for c in cells)


def test_unknown_axis_value_is_a_usage_error_without_traceback(run_pytest):
    done = run_pytest("--model", "tiny-llama,gpt-5", "--collect-only", "-q")
    assert done.returncode == 4, done.stdout + done.stderr
    valid = "tiny-transformer, tiny-llama, lora, gemma-cache, liger-llama"
    assert f"--model: unknown value 'gpt-5'; valid values: {valid}" in done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_options_and_k_combine(run_pytest):
    done = run_pytest(
        "--device",
        "cpu",
        "--precision",
        "bf16-mixed,bf16-loaded-mixed",
        "-k",
        "bf16-mixed and eval",
        "--collect-only",
        "-q",
    )
    collected = sorted(line.split("[")[1].rstrip("]") for line in done.stdout.splitlines() if "::test_cell[" in line)
    engines = parse_selection("engine", None)
    assert collected == sorted(f"{m}-bf16-mixed-eval-cpu-{e}" for m in AXES["model"] for e in engines)
