"""Standalone reproduction scripts of each engine's cells (matrix/releases/repro/parts/engine_<module>.py):
generated from a real run made here, run with nothing of this project importable, a failing cell's
script exits 1 with the check (or exception) the matrix recorded, a passing cell's exits 0 with
the numbers the matrix recorded."""

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from matrix.results.signatures import normalize_message

# Each engine's scripts take a minute or more on a 2-core CPU: the tests session (CI) and nox -s
# deepspeed run a slice of each engine family (SLICE below), nox -s repro every cell listed here
# (MATRIX_REPRO_EVERY_CELL=1).
EVERY_CELL = os.environ.get("MATRIX_REPRO_EVERY_CELL") == "1"


def sliced(cells: dict, chosen: set[str]) -> dict:
    """`cells`, or only the `chosen` of them outside nox -s repro."""
    assert chosen <= set(cells), chosen - set(cells)
    return dict(cells) if EVERY_CELL else {cell: target for cell, target in cells.items() if cell in chosen}


def matrix_run_of(cells: dict, report_dir, *selection: str):
    """One matrix run of `cells` (the axes `selection` names, then -k the cells), the scripts'
    record: (the run's directory, its cells by id)."""
    from conftest import run_matrix_cpu

    done, document = run_matrix_cpu(report_dir, *selection, "-k", " or ".join(cells), run_id="run")
    found = {c["id"]: c for c in document["cells"]}
    assert sorted(found) == sorted(cells), done.stdout[-3000:]
    return report_dir / "run", found


def torch_version() -> str:
    import torch

    return torch.__version__


def script_of(cell, run, tmp_path, limit_s: int):
    """The cell's script, run on its own (a distributed engine's ranks started by it), nothing of
    this project importable: (the process, its --json outcome)."""
    from matrix.releases.repro.generate import generate

    script = tmp_path / f"{cell}.py"
    script.write_text(generate(cell, run))
    # TORCH_EXTENSIONS_DIR left out too: where a DeepSpeed script builds its ops is the script's choice
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REPRO_WORKDIR", "TORCH_EXTENSIONS_DIR")}
    out = tmp_path / "out.json"
    done = subprocess.run(
        [sys.executable, str(script), "--json", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=limit_s,
    )  # fmt: skip
    return done, json.loads(out.read_text()) if out.exists() else None


# ---------------------------------------------------------------- DeepSpeed: deepspeed-zero0..3, hf-trainer-zero2/3
# (nox -s deepspeed runs these; where deepspeed is not installed they skip, naming it)

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="Requires: [deepspeed] (not installed: pip install '.[deepspeed]', or nox -s deepspeed)",
)


def deepspeed_refuses_fp16_on_this_cpu() -> str | None:
    """DeepSpeed's CPU accelerator takes fp16 only where oneDNN has fp16 kernels for this CPU
    (AVX512-FP16 or AMX-FP16): elsewhere its fp16 cells skip, naming that, and a bf16 cell stands in."""
    if importlib.util.find_spec("deepspeed") is None:
        return None  # every DeepSpeed test skips, naming deepspeed
    from matrix.engines.libraries.deepspeed import accelerator_refusal

    return accelerator_refusal("cpu", "fp16")


FP16_REFUSED = deepspeed_refuses_fp16_on_this_cpu()
# cell -> (phase, check or exception) the script must reproduce (exit 1), or None: it holds (exit 0)
DEEPSPEED_CELLS = {
    # deepspeed-zero0-bf16-adamw-stepped-at-construction, and ZeRO-1, whose AdamW starts unstepped
    "tiny-llama-fp16-mixed-train-cpu-deepspeed-zero0": ("train_steps", "CurveDiverged"),
    "tiny-llama-fp16-mixed-train-cpu-deepspeed-zero1": None,
    "tiny-llama-bf16-mixed-train-cpu-deepspeed-zero0": ("train_steps", "CurveDiverged"),  # the same entry, in bf16
    "lora-bf16-mixed-train-cpu-deepspeed-zero1": ("checkpoint_save", "RuntimeError"),  # drops frozen parameters
    "tiny-transformer-bf16-mixed-eval-cpu-deepspeed-zero3": ("evaluate", "AssertionError"),  # hooks split attention
    "tiny-llama-bf16-mixed-train-cpu-hf-trainer-zero2": None,
    # the Trainer averages its ranks' mean losses over tiny-transformer's uneven shares (2 rows and 1)
    "tiny-transformer-bf16-mixed-train-cpu-hf-trainer-zero3": ("train_steps", "CurveDiverged"),
    "tiny-llama-bf16-mixed-eval-cpu-hf-trainer-zero3": None,
    "tiny-llama-bf16-mixed-eval-cpu-hf-trainer-zero2": ("evaluate", "ValueError"),  # ZeRO inference needs stage 3
}
if FP16_REFUSED:
    DEEPSPEED_CELLS = {cell: target for cell, target in DEEPSPEED_CELLS.items() if "-fp16-" not in cell}
ZERO0_SHOWN_BY = f"tiny-llama-{'bf16' if FP16_REFUSED else 'fp16'}-mixed-train-cpu-deepspeed-zero0"
DEEPSPEED_CELLS = sliced(
    DEEPSPEED_CELLS,
    {
        ZERO0_SHOWN_BY,
        "tiny-llama-bf16-mixed-eval-cpu-hf-trainer-zero3",
        "tiny-transformer-bf16-mixed-train-cpu-hf-trainer-zero3",
    },
)
DEEPSPEED_SCRIPT_LIMIT_S = 900  # two gloo ranks, DeepSpeed's init and the references: minutes on a loaded 2-core CPU
# pytest-timeout past the matrix run's own limit (the first test sets the run up) and the script's
DEEPSPEED_TEST_LIMIT_S = 1200 + DEEPSPEED_SCRIPT_LIMIT_S + 60


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory):
    """One matrix run of DEEPSPEED_CELLS (two gloo ranks each), the scripts' record."""
    selection = (
        "--model", "tiny-llama,lora,tiny-transformer",
        "--precision", "bf16-mixed,fp16-mixed",
        "--engine", "deepspeed-zero0,deepspeed-zero1,deepspeed-zero3,hf-trainer-zero2,hf-trainer-zero3",
    )  # fmt: skip
    return matrix_run_of(DEEPSPEED_CELLS, tmp_path_factory.mktemp("deepspeed-repro"), *selection)


@needs_deepspeed
@pytest.mark.timeout(DEEPSPEED_TEST_LIMIT_S)
@pytest.mark.parametrize("cell", sorted(c for c, target in DEEPSPEED_CELLS.items() if target))
def test_deepspeed_script_reproduces_the_catalogued_failure(cell, deepspeed_run, tmp_path):
    run, cells = deepspeed_run
    record = cells[cell]
    phase, name = DEEPSPEED_CELLS[cell]
    assert record["outcome"] == "known" and record["phase"] == phase, record.get("signature")
    done, outcome = script_of(cell, run, tmp_path, DEEPSPEED_SCRIPT_LIMIT_S)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert outcome["outcome"] == "reproduced" and outcome["phase"] == phase
    assert outcome["failure"]["name"] == name, outcome["failure"]
    # the exception's first line (the matrix keeps the whole message)
    assert record["signature"]["message"].startswith(normalize_message(outcome["failure"]["message"]))
    if name == "CurveDiverged":  # the same losses as the matrix's, step by step, and the same references
        curve = record["metrics"]["curve"]
        steps = [c for c in outcome["checks"] if c["name"] == "CurveDiverged" and c["what"].startswith("torch engine")]
        assert [c["value"] for c in steps] == pytest.approx(curve["losses"], rel=1e-9, abs=0)
        assert [c["reference"] for c in steps] == pytest.approx(curve["torch_engine"]["reference_losses"], rel=1e-9)
        judged = zip(curve["torch_engine"]["deviations"], curve["torch_engine"]["allowed"], strict=True)
        assert [c["held"] for c in steps] == [deviation <= allowed for deviation, allowed in judged]  # as recorded
    if cell.endswith("deepspeed-zero0"):
        assert "AdamW steps taken at construction: 1" in done.stdout  # the mechanism the entry names
    if cell.startswith("tiny-transformer") and "hf-trainer" in cell:
        # the script's own model takes the labels the Trainer passes, as the kind's does
        assert record["known_failure"]["id"] == "trainer-averages-rank-means-over-uneven-shares"
        assert "unexpected keyword argument 'labels'" not in done.stdout + done.stderr
    # its ops built in a directory of this torch and DeepSpeed release's, not in the one every release
    # shares, where another release's build of deepspeed_shm_comm once lacked what this one calls
    release = f"torch-{torch_version()}-deepspeed-{importlib.metadata.version('deepspeed')}"
    assert (Path(tempfile.gettempdir(), "repro-torch-extensions", release, "deepspeed_shm_comm")).is_dir()


@needs_deepspeed
@pytest.mark.timeout(DEEPSPEED_TEST_LIMIT_S)
def test_deepspeed_script_names_the_phase_a_rank_died_in(tmp_path_factory, tmp_path):
    """A rank the C++ runtime aborts (hf:dbrx on ZeRO-3: the ranks' parameter gathers no longer pair
    up) kills the script's ranks as it killed the cell's: the script names the phase the rank was
    in, as the matrix names the call its ranks ran, and exits 1, not 2 ("another failure in launch")."""
    cell = "hf:dbrx-fp32-train-cpu-deepspeed-zero3"
    selection = ("--model", "hf:dbrx", "--precision", "fp32", "--mode", "train", "--engine", "deepspeed-zero3")
    run, cells = matrix_run_of({cell: None}, tmp_path_factory.mktemp("dbrx-repro"), *selection)
    assert cells[cell]["outcome"] == "known" and cells[cell]["phase"] == "train_steps", cells[cell]["signature"]
    done, outcome = script_of(cell, run, tmp_path, DEEPSPEED_SCRIPT_LIMIT_S)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert outcome["outcome"] == "reproduced" and outcome["phase"] == "train_steps", outcome
    assert outcome["failure"]["name"] == "rank died" and "SIGABRT" in outcome["failure"]["message"]
    assert "Received data size doesn't match expected size" in done.stderr  # the rank's own words


@needs_deepspeed
@pytest.mark.timeout(DEEPSPEED_TEST_LIMIT_S)
@pytest.mark.parametrize("cell", sorted(c for c, target in DEEPSPEED_CELLS.items() if target is None))
def test_deepspeed_script_of_a_passing_cell_holds_with_the_records_numbers(cell, deepspeed_run, tmp_path):
    run, cells = deepspeed_run
    metrics = cells[cell]["metrics"]
    assert cells[cell]["outcome"] == "passed"
    done, outcome = script_of(cell, run, tmp_path, DEEPSPEED_SCRIPT_LIMIT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().endswith("HOLDS: every check of the cell held")
    against_fp32 = [c for c in outcome["checks"] if c["name"] == "OutOfTolerance"]
    # the evaluation (mid-training, or the evaluation cell's) and its fp32 reference, as the matrix's
    assert against_fp32[0]["value"] == pytest.approx(metrics["eval_loss"], rel=1e-6, abs=0)
    assert against_fp32[0]["reference"] == pytest.approx(metrics["fp32_reference_loss"], rel=1e-6, abs=0)
    if "curve" in metrics:
        steps = [c for c in outcome["checks"] if c["name"] == "CurveDiverged" and c["what"].startswith("torch engine")]
        assert [c["value"] for c in steps] == pytest.approx(metrics["curve"]["losses"], rel=1e-6, abs=0)
    if cell.endswith("deepspeed-zero1"):
        assert "AdamW steps taken at construction: 0" in done.stdout


# ---------------------------------------------------------------- ddp, fsdp2, accelerate-fsdp2 (two gloo ranks each)

# cell -> (phase, check or exception) the script must reproduce (exit 1), or None: it holds (exit 0)
RANK_ENGINE_CELLS = {
    "tiny-llama-bf16-mixed-train-cpu-ddp": None,
    "tiny-llama-bf16-mixed-train-cpu-fsdp2": None,
    "tiny-llama-bf16-mixed-train-cpu-accelerate-fsdp2": None,
    # ddp-bf16-compress-hook-needs-nccl
    "tiny-llama-bf16-mixed-bf16-reduce-train-cpu-ddp": ("train_steps", "TypeError"),
    # torch-encoder-fastpath-autocast: fsdp2's sharded evaluation passes, the gathered weights' fails
    "tiny-transformer-bf16-mixed-eval-cpu-fsdp2": ("checkpoint_save", "RuntimeError"),
    # dcp-optimizer-init-step-writes-nan-into-fp16-weights: save_state leaves NaN weights
    "tiny-transformer-fp16-true-eval-cpu-accelerate-fsdp2": ("checkpoint_reload", "CheckpointMismatch"),
}
RANK_ENGINE_CELLS = sliced(
    RANK_ENGINE_CELLS,
    {"tiny-llama-bf16-mixed-train-cpu-fsdp2", "tiny-llama-bf16-mixed-bf16-reduce-train-cpu-ddp"},
)
RANK_ENGINE_SCRIPT_LIMIT_S = 600  # two spawned gloo ranks and the references: minutes on a loaded 2-core CPU


@pytest.fixture(scope="module")
def rank_engine_run(tmp_path_factory):
    """One matrix run of RANK_ENGINE_CELLS, the scripts' record."""
    selection = (
        "--model", "tiny-llama,tiny-transformer",
        "--precision", "bf16-mixed,bf16-mixed-bf16-reduce,fp16-true",
        "--engine", "ddp,fsdp2,accelerate-fsdp2",
    )  # fmt: skip
    return matrix_run_of(RANK_ENGINE_CELLS, tmp_path_factory.mktemp("rank-engine-repro"), *selection)


@pytest.mark.timeout(RANK_ENGINE_SCRIPT_LIMIT_S + 600)  # the fixture's matrix run comes first
@pytest.mark.parametrize("cell", sorted(c for c, target in RANK_ENGINE_CELLS.items() if target))
def test_rank_engine_script_reproduces_the_catalogued_failure(cell, rank_engine_run, tmp_path):
    run, cells = rank_engine_run
    record = cells[cell]
    phase, name = RANK_ENGINE_CELLS[cell]
    assert record["outcome"] == "known" and record["phase"] == phase, record.get("signature")
    done, outcome = script_of(cell, run, tmp_path, RANK_ENGINE_SCRIPT_LIMIT_S)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith(f"REPRODUCED in {phase}: {name}: ")
    assert outcome["outcome"] == "reproduced" and outcome["phase"] == phase
    assert outcome["failure"]["name"] == name, outcome["failure"]
    assert record["signature"]["message"].startswith(normalize_message(outcome["failure"]["message"]))
    if "eval_loss" in record["metrics"]:  # the evaluation before the failure, as the matrix's
        against_fp32 = [c for c in outcome["checks"] if c["name"] == "OutOfTolerance"]
        assert against_fp32[0]["value"] == pytest.approx(record["metrics"]["eval_loss"], rel=1e-9, abs=0)


@pytest.mark.timeout(RANK_ENGINE_SCRIPT_LIMIT_S + 600)
@pytest.mark.parametrize("cell", sorted(c for c, target in RANK_ENGINE_CELLS.items() if target is None))
def test_rank_engine_script_of_a_passing_cell_holds_with_the_records_numbers(cell, rank_engine_run, tmp_path):
    run, cells = rank_engine_run
    metrics = cells[cell]["metrics"]
    assert cells[cell]["outcome"] == "passed"
    done, outcome = script_of(cell, run, tmp_path, RANK_ENGINE_SCRIPT_LIMIT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().endswith("HOLDS: every check of the cell held")
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    # the gathered mid-training evaluation and its fp32 reference, the curve of the whole batch's
    # losses and the resumed step: the matrix's numbers, on two ranks as the matrix ran them
    against_fp32 = [c for c in outcome["checks"] if c["name"] == "OutOfTolerance"]
    assert against_fp32[0]["value"] == pytest.approx(metrics["eval_loss"], rel=1e-9, abs=0)
    assert against_fp32[0]["reference"] == pytest.approx(metrics["fp32_reference_loss"], rel=1e-9, abs=0)
    steps = [c for c in outcome["checks"] if c["name"] == "CurveDiverged" and c["what"].startswith("torch engine")]
    assert [c["value"] for c in steps] == pytest.approx(metrics["curve"]["losses"], rel=1e-9, abs=0)
    resumed = next(c for c in outcome["checks"] if c["what"] == "step k+1 loss, resumed against uninterrupted")
    assert resumed["value"] == pytest.approx(metrics["resumed_losses"], rel=1e-9, abs=0)
    # rank 0's checks only: each comparison printed once
    assert done.stdout.count("CHECK mid_training_eval OutOfTolerance") == 1


# ---------------------------------------------------------------- accelerate, hf-trainer, lightning (one process each)


def _transformers_within(versions: str) -> bool:
    """Whether the installed transformers is within a catalogue entry's `versions` range."""
    import importlib.metadata

    from packaging.specifiers import SpecifierSet

    return importlib.metadata.version("transformers") in SpecifierSet(versions)


# trainer-num-items-overcounts-causal-lm: where it applies, every causal-LM Trainer training cell
# fails its cross-engine check first; elsewhere the cell passes with the record's numbers
TRAINER_NUM_ITEMS = ("train_steps", "EngineDisagreement") if _transformers_within(">=4.50.0,<5.10.1") else None
# cell -> (phase, check or exception) the script must reproduce (exit 1), or None: it holds (exit 0)
LIBRARY_ENGINE_CELLS = {
    "tiny-llama-bf16-mixed-train-cpu-accelerate": None,
    # rope-buffer-cast-lost-on-reload: the export read back by the kind's own loader
    "tiny-llama-bf16-true-eval-cpu-accelerate": ("checkpoint_reload", "DtypeContractBroken"),
    "tiny-llama-bf16-mixed-train-cpu-hf-trainer": TRAINER_NUM_ITEMS,
    "tiny-llama-fp32-eval-cpu-hf-trainer": None,
    "tiny-llama-bf16-true-eval-cpu-hf-trainer": ("checkpoint_reload", "DtypeContractBroken"),
    "tiny-llama-bf16-mixed-train-cpu-lightning": None,
    "tiny-llama-fp32-eval-cpu-lightning": None,
    # lightning-keeps-from-pretrained-eval-mode: from_pretrained()'s eval mode kept through fit()
    "tiny-llama-bf16-loaded-mixed-train-cpu-lightning": ("train_steps", "TrainedInEvalMode"),
    "tiny-llama-bf16-true-train-cpu-lightning": ("checkpoint_reload", "DtypeContractBroken"),
}
LIBRARY_ENGINE_CELLS = sliced(
    LIBRARY_ENGINE_CELLS,
    {"tiny-llama-bf16-mixed-train-cpu-hf-trainer", "tiny-llama-bf16-loaded-mixed-train-cpu-lightning"},
)
LIBRARY_SCRIPT_LIMIT_S = 600  # a library's import, its loop and the references: minutes on a loaded 2-core CPU


@pytest.fixture(scope="module")
def library_engine_run(tmp_path_factory):
    """One matrix run of LIBRARY_ENGINE_CELLS, the scripts' record."""
    selection = (
        "--model", "tiny-llama",
        "--precision", "fp32,bf16-mixed,bf16-true,bf16-loaded-mixed",
        "--engine", "accelerate,hf-trainer,lightning",
    )  # fmt: skip
    return matrix_run_of(LIBRARY_ENGINE_CELLS, tmp_path_factory.mktemp("library-engine-repro"), *selection)


def checked(outcome, name, what_starts=""):
    """The script's comparisons of one check, in order (those whose description starts so)."""
    return [c for c in outcome["checks"] if c["name"] == name and c["what"].startswith(what_starts)]


@pytest.mark.timeout(LIBRARY_SCRIPT_LIMIT_S + 900)  # the fixture's matrix run comes first
@pytest.mark.parametrize("cell", sorted(c for c, target in LIBRARY_ENGINE_CELLS.items() if target))
def test_library_engine_script_reproduces_the_catalogued_failure(cell, library_engine_run, tmp_path):
    run, cells = library_engine_run
    record = cells[cell]
    phase, name = LIBRARY_ENGINE_CELLS[cell]
    assert record["outcome"] == "known" and record["phase"] == phase, record.get("signature")
    done, outcome = script_of(cell, run, tmp_path, LIBRARY_SCRIPT_LIMIT_S)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith(f"REPRODUCED in {phase}: {name}: ")
    assert outcome["outcome"] == "reproduced" and outcome["phase"] == phase
    assert outcome["failure"]["name"] == name, outcome["failure"]
    assert record["signature"]["message"].startswith(normalize_message(outcome["failure"]["message"]))
    metrics = record["metrics"]
    if "eval_loss" in metrics:  # the evaluation before the failure, as the matrix's
        assert checked(outcome, "OutOfTolerance")[0]["value"] == pytest.approx(metrics["eval_loss"], rel=1e-9, abs=0)
    if "curve" in metrics:  # the library's losses, recorded before its training contract failed
        steps = checked(outcome, "CurveDiverged", "torch engine")
        assert [c["value"] for c in steps] == pytest.approx(metrics["curve"]["losses"], rel=1e-9, abs=0)
    if name == "TrainedInEvalMode":
        (mode,) = checked(outcome, name)
        assert mode["value"] == "eval" and metrics["effective"]["model_training_in_first_forward"] is False
    if name == "EngineDisagreement":  # the Trainer's first loss and the torch loop's, as the matrix's
        (first,) = checked(outcome, name)
        assert first["value"] == pytest.approx(metrics["cross_engine"]["first_step_loss"], rel=1e-9, abs=0)
        assert first["reference"] == pytest.approx(metrics["cross_engine"]["torch_engine_first_step_loss"], rel=1e-9)


@pytest.mark.timeout(LIBRARY_SCRIPT_LIMIT_S + 900)
@pytest.mark.parametrize("cell", sorted(c for c, target in LIBRARY_ENGINE_CELLS.items() if target is None))
def test_library_engine_script_of_a_passing_cell_holds_with_the_records_numbers(cell, library_engine_run, tmp_path):
    run, cells = library_engine_run
    metrics = cells[cell]["metrics"]
    assert cells[cell]["outcome"] == "passed"
    done, outcome = script_of(cell, run, tmp_path, LIBRARY_SCRIPT_LIMIT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().endswith("HOLDS: every check of the cell held")
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    # the library's evaluation (mid-training: held after step k) and its fp32 reference, as the matrix's
    against_fp32 = checked(outcome, "OutOfTolerance")
    assert against_fp32[0]["value"] == pytest.approx(metrics["eval_loss"], rel=1e-9, abs=0)
    assert against_fp32[0]["reference"] == pytest.approx(metrics["fp32_reference_loss"], rel=1e-9, abs=0)
    # against the torch engine: the first step's loss, or the evaluation cell's loss
    (agreement,) = checked(outcome, "EngineDisagreement")
    key = "first_step_loss" if "-train-" in cell else "eval_loss"
    assert agreement["value"] == pytest.approx(metrics["cross_engine"][key], rel=1e-9, abs=0)
    assert agreement["reference"] == pytest.approx(metrics["cross_engine"][f"torch_engine_{key}"], rel=1e-9, abs=0)
    if "-train-" in cell:  # the library's own loop: its losses step by step, and step k+1 after its resume
        steps = checked(outcome, "CurveDiverged", "torch engine")
        assert [c["value"] for c in steps] == pytest.approx(metrics["curve"]["losses"], rel=1e-9, abs=0)
        (resumed,) = checked(outcome, "ResumeDiverged", "step k+1 loss")
        assert resumed["value"] == pytest.approx(metrics["resumed_losses"], rel=1e-9, abs=0)
    # the reload and the library's own resume path, bit for bit
    reloads = checked(outcome, "CheckpointMismatch")
    assert [c["what"] for c in reloads] == ["eval logits", "eval logits of the resumed run"]
    assert all(c["held"] for c in reloads)


@pytest.mark.skipif(
    not EVERY_CELL, reason="Requires: [MATRIX_REPRO_EVERY_CELL=1] (nox -s repro runs every engine's scripts)"
)
@pytest.mark.timeout(RANK_ENGINE_SCRIPT_LIMIT_S + 600)
def test_rank_engine_script_of_a_kind_that_draws_dropout_matches_the_records_numbers(tmp_path):
    """A user's GPT-2 with dropout 0.1 under ddp: each rank draws its rows' masks, so the first step
    is compared with dropout off, and the trained weights are the matrix's only where each
    training forward is seeded as the matrix seeds it (the model's own call, not DDP's)."""
    from conftest import PLUGINS, ROOT, run_matrix_cpu

    cell = "user-gpt2-fp32-train-cpu-ddp"
    selection = ("-p", "user_gpt2", "--model", "user-gpt2", "--engine", "ddp", "--precision", "fp32", "--mode", "train")
    _, document = run_matrix_cpu(tmp_path / "reports", *selection, run_id="run")
    (record,) = document["cells"]
    assert record["id"] == cell and record["outcome"] == "passed", record.get("signature")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REPRO_WORKDIR")}
    env["PYTHONPATH"] = str(PLUGINS)  # the user's kind: its module, and nothing else of this checkout
    script, out = tmp_path / "script.py", tmp_path / "out.json"
    run = tmp_path / "reports" / "run"
    command = [sys.executable, "-m", "matrix", "repro", "-p", "user_gpt2", cell, "--run", str(run)]
    generated = subprocess.run([*command, "-o", str(script)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert "SPLIT_DRAWS = True" in script.read_text()
    done = subprocess.run(
        [sys.executable, str(script), "--json", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=RANK_ENGINE_SCRIPT_LIMIT_S,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checks, metrics = json.loads(out.read_text())["checks"], record["metrics"]
    (dropout_off,) = [c for c in checks if c["what"] == "first step loss dropout off against the torch engine's"]
    assert dropout_off["value"] == pytest.approx(metrics["cross_engine"]["first_step_loss_dropout_off"], rel=1e-9)
    reference = metrics["cross_engine"]["torch_engine_first_step_loss_dropout_off"]
    assert dropout_off["reference"] == pytest.approx(reference, rel=1e-9)
    against_fp32 = [c for c in checks if c["name"] == "OutOfTolerance"]
    assert against_fp32[0]["value"] == pytest.approx(metrics["eval_loss"], rel=1e-9, abs=0)
    resumed = next(c for c in checks if c["what"] == "step k+1 loss, resumed against uninterrupted")
    assert resumed["value"] == pytest.approx(metrics["resumed_losses"], rel=1e-9, abs=0)
