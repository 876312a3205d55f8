"""The compiled twins of the DeepSpeed engines (deepspeed-zero1-compile, hf-trainer-zero2-compile) on two
gloo ranks. A file of its own: `nox -s deepspeed -- --all` (every night, nightly-cpu.yml) runs it, on a
worker of its own beside tests/test_deepspeed.py's grids (--dist loadfile); Inductor's compile is most of
its time, and CI's slice of the session leaves it out."""

from __future__ import annotations

import pytest
from test_deepspeed import needs_deepspeed


@pytest.fixture(scope="module")
def compiled_grid(matrix_cpu, tmp_path_factory):
    """The compiled twins of DeepSpeed's engine and of the Trainer on DeepSpeed: tiny-llama trained
    in bf16-mixed (engine.compile(); TrainingArguments(torch_compile=True))."""
    selection = ("--model", "tiny-llama", "--precision", "bf16-mixed", "--mode", "train")
    engines = ("--engine", "deepspeed-zero1-compile,hf-trainer-zero2-compile")
    # Inductor compiles inside the cell, from a cold cache on a fresh clone, in each phase that builds
    # an engine: on two cores shared with the other worker's DeepSpeed scripts the ZeRO-1 twin ran past
    # the default 120 s (RankTimeout, a fresh clone's nox -s deepspeed at bc9d6f9); nox -s compile --
    # --all gives a cold cache 900 s for the same reason
    budget = ("--cell-timeout", "600")
    return matrix_cpu(tmp_path_factory.mktemp("deepspeed-compile"), *selection, *engines, *budget)


@needs_deepspeed
def test_the_compiled_twins_compile_on_deepspeed(compiled_grid):
    """Each twin compiles its model once and reuses the graph; the Trainer's twin once compiled
    nothing (its DeepSpeed settings dropped torch_compile), which NotCompiled now fails."""
    done, cells = compiled_grid
    assert len(cells) == 2, done.stdout[-3000:]
    for cell_id, cell in cells.items():
        assert cell["outcome"] == "passed", (cell_id, cell.get("message"))
        compiled = cell["metrics"]["compiled"]
        assert compiled["graphs_per_training_step"][0] >= 1, compiled
        assert compiled["graphs_per_training_step"][1:3] == [0, 0], compiled
    assert cells["tiny-llama-bf16-mixed-train-cpu-hf-trainer-zero2-compile"]["metrics"]["engine_settings"][
        "torch_compile"
    ]
