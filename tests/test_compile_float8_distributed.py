"""The distributed compiled twins trained in float8 on two gloo ranks (issue 37). Each compiles its
graphs cold on every rank, the slowest tests of `nox -s compile`: the session runs this file with
-- --all-tests (every night, nightly-cpu.yml) or -- --all, and CI's slice runs
tests/test_compile_float8.py, whose compiled cells are the torch engine's."""

from __future__ import annotations

import pytest
from test_compile_float8 import needs_torchao

from matrix.execute.cell_run import run_cell
from matrix.grid.cell import Cell


@needs_torchao
@pytest.mark.parametrize("engine", ["ddp-compile", "fsdp2-compile", "accelerate-fsdp2-compile"])
def test_a_distributed_twin_trains_float8_compiled_on_two_ranks(tmp_path, engine):
    """The distributed twins as their users compile: DDP wrapped, then compiled (its forward stays
    outside the graph: graph breaks, recorded); FSDP2's layers compiled in place before
    fully_shard (no break); accelerate's prepare compiling the sharded model whole (breaks at
    FSDP2's hooks, recorded). Each trains float8 with later steps compiling nothing."""
    result = run_cell(Cell("tiny-llama", "float8-rowwise", "train", "cpu", engine), tmp_path)
    assert result.outcome == "passed", result.message
    compiled = result.metrics.compiled
    assert compiled.graphs_per_training_step[0] >= 1 and compiled.graphs_per_training_step[1:] == [0, 0]
    assert bool(compiled.graph_breaks) is (engine != "fsdp2-compile"), compiled.graph_breaks
    assert result.metrics.float8.converted
    converted_by = result.metrics.float8.converted_by
    assert converted_by.startswith("the library") is (engine == "accelerate-fsdp2-compile")
    assert (
        compiled.eager_deviation_abs
        <= compiled.eager_tolerance.atol + compiled.eager_tolerance.rtol * compiled.eager_loss
    )
