"""A cell's metrics are a typed record (matrix/results/metrics.py): results.schema.json's `metrics`
follows its fields, reports/README.md names them, and a real cell's metrics make the round trip
through results.json unchanged."""

import json
import pickle
import re
from pathlib import Path

import jsonschema
import pytest

from matrix.execute import cell_run as execute
from matrix.grid.cell import Cell
from matrix.results.files import SCHEMA_FILE
from matrix.results.journal import json_safe
from matrix.results.metrics import (
    RECORDS,
    UNSET,
    CellMetrics,
    CrossEngine,
    Effective,
    field_names,
    metrics_schema,
)
from matrix.results.records import CellRecord

SCHEMA = json.loads(SCHEMA_FILE.read_text())
README = Path(__file__).resolve().parents[1] / "reports" / "README.md"
REGENERATE = (
    "regenerate it: python -c 'import json, pathlib; from matrix.results.metrics import metrics_schema; "
    'p = pathlib.Path("matrix/results/results.schema.json"); d = json.loads(p.read_text()); '
    'd["$defs"]["cell"]["properties"]["metrics"] = metrics_schema(); '
    'p.write_text(json.dumps(d, indent=2, ensure_ascii=False) + "\\n")\''
)


def schema_names(schema: dict, prefix: str = "") -> list[str]:
    names = []
    for name, property_ in schema["properties"].items():
        names.append(prefix + name)
        nested = [s for s in property_.get("oneOf", []) if "properties" in s]
        for record in nested:
            names += schema_names(record, f"{prefix}{name}.")
    return names


def test_the_schema_declares_exactly_the_metrics_fields():
    declared = SCHEMA["$defs"]["cell"]["properties"]["metrics"]
    assert declared == metrics_schema(), REGENERATE
    assert set(schema_names(declared)) == set(field_names())  # both directions, nested records too


def test_the_report_readme_names_every_metrics_field():
    text = README.read_text()
    named = set(re.findall(r"`([a-z0-9_.]+)`", text))
    missing = [name for name in field_names() if name.split(".")[-1] not in named and name not in named]
    assert not missing, f"reports/README.md does not name {missing}"


def test_unknown_keys_are_kept_and_written_back_and_a_writer_cannot_make_one_up():
    older = {"eval_loss": 1.5, "effective": {"autocast_dtype": None, "retired": 1}, "retired_metric": [1]}
    metrics = CellMetrics.from_dict(older)
    assert metrics.eval_loss == 1.5 and metrics.effective.autocast_dtype is None
    assert metrics.effective.device is UNSET and metrics.extra == {"retired_metric": [1]}
    assert metrics.as_dict() == older
    with pytest.raises(AttributeError):
        metrics.eval_los = 1.0  # a typo is not a new key
    for record in RECORDS:
        assert record().as_dict() == {}


def test_metrics_cross_a_process_boundary_pickled():
    """A rank's metrics come back to the driver pickled (matrix/engines/distributed.py)."""
    metrics = CellMetrics(rank_first_step_loss=2.0, effective=Effective(autocast_dtype_in_forward=None))
    metrics.cross_engine = CrossEngine(first_step_loss=2.0, random_numbers=None)
    back = pickle.loads(pickle.dumps(metrics))
    assert back == metrics and back.as_dict() == metrics.as_dict()
    assert back.effective.device is UNSET  # the one UNSET, across processes


@pytest.mark.parametrize(
    "cell",
    [Cell("gemma-cache", "fp32", "train", "cpu", "accelerate"), Cell("gemma-cache", "bf16-mixed", "eval", "cpu")],
    ids=str,
)
def test_a_real_cells_metrics_make_the_round_trip_through_results_json(cell, tmp_path):
    result = execute.run_cell(cell, tmp_path / "work")
    assert result.outcome == "passed", result.message
    record = CellRecord.of(cell, "passed", phases=result.phases, duration_s=result.duration_s, metrics=result.metrics)
    # as matrix/results/run_directory.py write_documents writes a cell into results.json
    (tmp_path / "results.json").write_text(json.dumps(json_safe([record.as_dict()]), indent=2, allow_nan=False))
    (written,) = json.loads((tmp_path / "results.json").read_text())
    jsonschema.validate(written, {"$ref": "#/$defs/cell", "$defs": SCHEMA["$defs"]})
    metrics = written["metrics"]
    read = CellMetrics.from_dict(metrics)
    assert read.as_dict() == metrics
    assert read.extra == {}  # every key a cell writes is a field
    assert all(value.extra == {} for value in vars_of(read) if hasattr(value, "extra"))
    assert read.effective.autocast_dtype_in_forward is not UNSET and read.kind.traits
    if cell.mode == "train":
        assert read.loss_decrease.relative > 0 and read.cross_engine.spread_abs <= 1e-5
        assert read.learning_rate.value > 0
    else:
        assert read.eval_cache_type.endswith("Cache") and read.fp32_tolerance.atol > 0


def vars_of(record) -> list:
    import dataclasses

    return [getattr(record, f.name) for f in dataclasses.fields(record)]


def test_the_library_clock_counts_the_outermost_library_call_once(monkeypatch):
    """metrics.library_seconds (matrix/harness/library_clock.py): the time inside an engine's library
    calls, a call made from inside another counted in the outer one only, any other attribute the
    engine's own."""
    from matrix.harness import library_clock

    now = [0.0]
    monkeypatch.setattr(library_clock, "perf_counter", lambda: now[0])

    class Loop:
        owns_loop = True

        def train(self, state, run, steps):
            now[0] += 1.0
            return clock.evaluate(state, run)  # a library callback that evaluates mid-train

        def evaluate(self, state, run):
            now[0] += 2.0
            return "evaluated"

        def weights(self, state, run):
            now[0] += 4.0  # the harness reading the run: not a library call
            return "weights"

    metrics = CellMetrics()
    clock = library_clock.LibraryClock(Loop(), metrics)
    assert clock.owns_loop is True and clock.weights(None, None) == "weights"
    assert metrics.library_seconds is UNSET  # reading weights is the harness's time
    assert clock.train(None, None, 3) == "evaluated"
    assert metrics.library_seconds == 3.0  # not 5: the nested evaluate counted once, in train
    clock.evaluate(None, None)
    assert metrics.library_seconds == 5.0
