"""A user's journey from the docs alone (issue 48): the training loop docs/ENGINES.md shows and the
model kind docs/extending.md shows are tests/plugins/docs_loop.py and docs_model.py, byte for
byte, and they run the default CPU precisions in both modes with a verdict in every cell (no
harness error, no dead worker). Their twins with the mistakes users make
(tests/plugins/docs_loop_mistakes.py) are caught by the matrix's checks, each with its own
signature and the traceback in every report; what users write as a matter of course (settings
holding a torch.dtype, a step returning the loss tensor, a save into the directory it is
given, a kind saving `model.state_dict()` under the torch engine's compiled twin) just works.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "tests" / "plugins"
PRECISIONS = ("fp32", "fp16-mixed", "bf16-mixed", "bf16-true")
MODELS = ("my-model", "tiny-llama")
TWINS = ("my-loop-model-only", "my-loop-scaled-clip", "my-loop-tensor-loss", "my-loop-no-applied", "my-loop-eval-dict")
# the docs' loop over every model and precision; its twins and the compiled twin on the docs' kind
SELECTED = "cpu-my-loop] or (my-model-fp16-mixed and not torch-compile) or my-model-fp32-train-cpu-torch-compile"


def python_block(page: Path, heading: str) -> str:
    """The first ```python block under `heading` of a docs page."""
    text = page.read_text()
    section = text[text.index(heading) :]
    found = re.search(r"^```python\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    assert found, f"no python block under {heading!r} in {page.name}"
    return found.group(1)


@pytest.mark.parametrize(
    ("page", "heading", "plugin"),
    [("ENGINES.md", "## A hand-written loop", "docs_loop.py"), ("extending.md", "## A model kind", "docs_model.py")],
)
def test_the_docs_show_the_tested_files_whole(page, heading, plugin):
    assert python_block(ROOT / "docs" / page, heading) == (PLUGINS / plugin).read_text()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict[tuple, dict], Path]:
    from conftest import run_matrix_cpu

    report_dir = tmp_path_factory.mktemp("docs-journeys")
    engines = ",".join(("my-loop", *TWINS, "torch-compile"))
    done, document = run_matrix_cpu(
        report_dir,
        *("-p", "docs_loop_mistakes", "-p", "docs_model"),
        *("--model", ",".join(MODELS), "--precision", ",".join(PRECISIONS), "--engine", engines),
        *("-k", SELECTED),
    )
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    assert "INTERNALERROR" not in done.stdout + done.stderr
    cells = {(c["engine"], c["model"], c["precision"], c["mode"]): c for c in document["cells"]}
    assert len(cells) == len(MODELS) * len(PRECISIONS) * 2 + len(TWINS) * 2 + 1
    return cells, report_dir / "users"


def test_the_docs_loop_and_kind_give_a_verdict_in_every_cell(run):
    cells, _ = run
    for model in MODELS:
        for precision in PRECISIONS:
            for mode in ("train", "eval"):
                cell = cells[("my-loop", model, precision, mode)]
                # passed, or a catalogue entry's known failure (tiny-llama's bf16-true reload is one)
                assert cell["outcome"] in ("passed", "known"), (cell["id"], cell.get("message"))
                assert cell["phase"] not in ("crash", "record", "setup", "call")
    trained = cells[("my-loop", "my-model", "fp16-mixed", "train")]
    assert trained["outcome"] == "passed"
    assert trained["metrics"]["resume"]["optimizer_state_restored"] is True
    assert trained["metrics"]["checkpoint_files"] == ["checkpoint.pt"]  # saved into the directory made for it
    # the settings hold torch.dtype values, as the docs write them: recorded by name
    assert trained["metrics"]["engine_settings"] == {"autocast": "float16", "grad_scaler": True}
    assert cells[("my-loop", "my-model", "fp32", "eval")]["metrics"]["engine_settings"] == {"grad_scaler": False}


def test_a_users_kind_saving_its_state_dict_reloads_under_the_compiled_twin(run):
    cells, _ = run
    cell = cells[("torch-compile", "my-model", "fp32", "train")]
    assert cell["outcome"] == "passed", (cell.get("signature"), cell.get("message"))
    assert cell["metrics"]["compiled"]["how"].startswith("model = torch.compile(model)")


FAILURES = {
    # engine, mode -> (phase, the signature's start)
    ("my-loop-model-only", "train"): (
        "resumed_step",
        "resumed_step: matrix.checks.CheckpointMismatch: optimizer state missing after reload",
    ),
    ("my-loop-scaled-clip", "train"): (
        "train_steps",
        "train_steps: matrix.checks.CurveDiverged: the training loss curve leaves the torch engine's",
    ),
    ("my-loop-no-applied", "train"): (
        "train_steps",
        "train_steps: matrix.engines.base.EngineContractBroken: step() returned a float, not (loss, applied)",
    ),
    ("my-loop-eval-dict", "train"): (
        "mid_training_eval",
        "mid_training_eval: matrix.engines.base.EngineContractBroken: evaluate() returned a dict, not the kind's "
        "EvalOutput",
    ),
    ("my-loop-eval-dict", "eval"): (
        "evaluate",
        "evaluate: matrix.engines.base.EngineContractBroken: evaluate() returned a dict, not the kind's EvalOutput",
    ),
}


@pytest.mark.parametrize(("engine", "mode"), list(FAILURES))
def test_each_mistake_is_a_named_failure_of_its_cell_with_its_traceback(run, engine, mode):
    cells, directory = run
    cell = cells[(engine, "my-model", "fp16-mixed", mode)]
    phase, signature = FAILURES[(engine, mode)]
    assert cell["outcome"] == "failed", cell["id"]
    assert cell["phase"] == phase, (cell["id"], cell["message"])
    assert cell["signature"]["text"].startswith(signature), cell["signature"]["text"]
    assert cell["traceback"].startswith("Traceback (most recent call last):")
    if "EngineContractBroken" in signature:  # the details name the user's method and file
        assert "docs_loop_mistakes.py:" in cell["message"], cell["message"]
    for report in ("summary.md", "index.html"):
        assert cell["signature"]["id"] in (directory / report).read_text(), report


def test_the_mistakes_caught_elsewhere_and_the_ordinary_ways_pass(run):
    cells, _ = run
    for engine, mode in [(t, m) for t in TWINS for m in ("train", "eval")]:
        cell = cells[(engine, "my-model", "fp16-mixed", mode)]
        if (engine, mode) not in FAILURES:  # a step returning the loss tensor is taken as its float
            assert cell["outcome"] == "passed", (cell["id"], cell.get("signature"))
    losses = cells[("my-loop-tensor-loss", "my-model", "fp16-mixed", "train")]["metrics"]["train_losses"]
    assert losses == cells[("my-loop", "my-model", "fp16-mixed", "train")]["metrics"]["train_losses"]


# ---------------------------------------------------------------- in this process


def _engine_with_settings(value_of):
    """A loop like the docs' whose settings hold value_of(precision) as `autocast`."""
    import torch

    from matrix.engines import EngineSettings, Loop

    @dataclasses.dataclass(frozen=True)
    class Settings(EngineSettings):
        autocast: object = None

    class Guessing(Loop):
        name, description = "guessing-loop", "settings as a user guesses them"

        def derive_settings(self, precision):
            return Settings(autocast=value_of(precision))

        def start(self, state, model, training):
            return self.Run(model, torch.optim.AdamW(model.parameters()) if training else None)

        def save(self, state, run, directory): ...

        def restore(self, state, directory, training): ...

    return Guessing()


def test_settings_a_report_cannot_record_are_refused_at_registration_naming_the_field():
    from matrix.engines import ENGINES
    from matrix.engines.base import SettingsUnrecordable

    engine = _engine_with_settings(lambda precision: precision.autocast)  # the method, not the dtype
    with pytest.raises(SettingsUnrecordable) as refused:
        ENGINES.register(engine)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("engine 'guessing-loop', precision fp32: Settings.autocast holds the method "), message
    assert "precision.autocast_dtype" in message
    assert "guessing-loop" not in list(ENGINES)


def test_settings_record_dtypes_devices_paths_and_small_tensors():
    import torch

    from matrix.engines.base import SettingsUnrecordable, recordable

    value = {"dtype": torch.bfloat16, "device": torch.device("cpu"), "path": Path("/x/y"), "lr": torch.tensor(0.5)}
    assert recordable(value, "S.f") == {"dtype": "bfloat16", "device": "cpu", "path": "/x/y", "lr": 0.5}
    assert recordable([torch.float16, None, (1, True)], "S.f") == ["float16", None, [1, True]]
    with pytest.raises(SettingsUnrecordable, match=r"^S\.f\[1\] holds a value of type object, "):
        recordable([1, object()], "S.f")
    with pytest.raises(SettingsUnrecordable, match="a tensor of 100 numbers"):
        recordable(torch.zeros(100), "S.f")


def test_a_steps_loss_tensor_is_its_float_and_anything_else_is_named():
    import torch

    from matrix.engines.base import EngineContractBroken, step_result

    def step(): ...

    assert step_result((torch.tensor(2.5, requires_grad=True) * 1, torch.tensor(True)), step) == (2.5, True)
    assert step_result((3, False), step) == (3.0, False)
    for taken, message in [
        (2.5, "step() returned a float, not (loss, applied)"),
        ((1.0, True, 0), "step() returned a tuple of 3, not (loss, applied)"),
        ((torch.ones(2), True), "step() returned a tensor of shape [2] as its loss, not a number"),
        ((1.0, 1), "step() returned a int as applied, not a bool"),
    ]:
        with pytest.raises(EngineContractBroken) as broken:
            step_result(taken, step)
        assert str(broken.value).startswith(message), str(broken.value)
        assert "test_docs_journeys.py:" in broken.value.details


def test_a_record_json_cannot_hold_fails_its_cell_and_keeps_its_traceback(tmp_path):
    import torch

    from matrix.results import journal
    from matrix.results.recording import recordable_entry

    entry = {
        "id": "c",
        "outcome": "failed",
        "phase": "train_steps",
        "message": "train_steps: the user's error",
        "traceback": 'Traceback (most recent call last):\n  File "my_loop.py", line 3\nValueError: x',
        "metrics": {"train_losses": [torch.tensor(1.0)]},
    }
    safe = recordable_entry(entry)
    assert safe["outcome"] == "failed" and safe["phase"] == "record"
    assert safe["signature"]["text"] == (
        "record: RecordUnwritable: TypeError: Object of type Tensor is not JSON serializable @ <recording>"
    )
    assert safe["traceback"].startswith(entry["traceback"])
    assert "the cell had failed in phase train_steps: train_steps: the user's error" in safe["message"]
    assert safe["metrics"]["train_losses"][0].startswith("<not recordable: Tensor: tensor(1.)")
    log = journal.Journal(tmp_path)
    log.cell(safe)  # written: no error ends the run
    log.close()
    assert json.loads((tmp_path / journal.JOURNAL).read_text().splitlines()[-1])["record"]["phase"] == "record"
    ok = {"id": "d", "outcome": "passed", "metrics": {"engine_settings": {"autocast": "float16"}}}
    assert recordable_entry(ok) is ok


def test_an_internal_error_of_pytest_is_the_cells_crash_with_its_traceback_and_the_run_goes_on(tmp_path):
    """A hook that raises as a cell is recorded (tests/plugins/internal_error.py) ends the pytest
    process; python -m matrix run records that cell as crashed with pytest's traceback, in every
    report, and runs the rest."""
    from conftest import run_matrix_cpu

    done, document = run_matrix_cpu(
        tmp_path,
        *("-p", "docs_model", "-p", "internal_error", "--model", "my-model"),
        *("--precision", "fp32"),
        *("--engine", "torch"),
    )
    assert done.returncode == 1, done.stderr[-3000:]
    cells = {c["id"]: c for c in document["cells"]}
    assert cells["my-model-fp32-train-cpu-torch"]["outcome"] == "passed"
    crashed = cells["my-model-fp32-eval-cpu-torch"]
    assert crashed["outcome"] == "failed" and crashed["phase"] == "crash"
    assert crashed["signature"]["text"] == (
        "crash: ProcessDied: killed by exit status 3 after an internal error of pytest: TypeError: a hook of ours "
        "raised while the cell was recorded @ internal_error:pytest_runtest_logreport"
    )
    assert 'tests/plugins/internal_error.py", line' in crashed["traceback"]
    assert not document["run"]["incomplete"]
    for report in ("summary.md", "index.html"):
        assert "a hook of ours raised while the cell was recorded" in (tmp_path / "users" / report).read_text()
