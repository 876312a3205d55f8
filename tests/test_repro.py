"""Standalone reproduction scripts: generated from a real run, run with nothing of this
project importable, they reproduce the same signature: an exception of the stack, or a check of
the matrix with its numbers (exit 1); every check holds where the cell passed (exit 0), with the
numbers the matrix recorded."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from matrix.releases import repro
from matrix.results.signatures import normalize_message

ROOT = Path(__file__).resolve().parent.parent

FAILING = ["tiny-transformer-bf16-mixed-eval-cpu-torch", "tiny-llama-fp16-loaded-mixed-train-cpu-torch"]
PASSING = ["gemma-cache-fp32-eval-cpu-torch", "lora-fp16-loaded-mixed-train-cpu-torch"]
CHECK_FAILURE = "tiny-llama-bf16-true-eval-cpu-torch"  # found by a matrix check, not raised by the stack


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    reports = tmp_path_factory.mktemp("reports")
    selection = " or ".join(f"test_cell[{cell}]" for cell in [*FAILING, *PASSING, CHECK_FAILURE])
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "cases",
            "--report-dir",
            str(reports),
            "--engine",
            "torch",
            "--device",
            "cpu",
            "-k",
            selection.replace("[", " and ").replace("]", ""),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    (latest,) = [p for p in reports.iterdir() if p.is_dir() and p.name != "latest"]
    return latest


def generate(cell, run_dir, tmp_path):
    """`python -m matrix repro` itself: its exit status and one-line refusals are the subject."""
    script = tmp_path / f"{cell}.py"
    done = subprocess.run(
        [sys.executable, "-m", "matrix", "repro", cell, "--run", str(run_dir), "-o", str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return done, script


def write_script(cell, run_dir, tmp_path) -> Path:
    """The script `python -m matrix repro` writes, generated in this process: the script, run
    on its own, is the subject (the command's own path is the test above and below)."""
    script = tmp_path / f"{cell}.py"
    script.write_text(repro.generate(cell, run_dir))
    return script


def run_standalone(script, tmp_path, *args, env_extra: dict | None = None):
    """The script run on its own, with a temporary directory of its own: whatever its end, the
    directory it made for its checkpoints (its ranks' too) is gone with it (every run left one)."""
    temporary = tmp_path / "tmp"
    temporary.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REPRO_WORKDIR")}
    env |= {"TMPDIR": str(temporary), **(env_extra or {})}
    done = subprocess.run(
        [sys.executable, str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert not list(temporary.glob("repro-*")), done.stdout[-2000:]
    return done


def record_of(run_dir, cell) -> dict:
    return next(c for c in json.loads((run_dir / "results.json").read_text())["cells"] if c["id"] == cell)


@pytest.mark.parametrize("cell", [*FAILING, CHECK_FAILURE])
def test_a_script_reproduces_the_failing_cells_signature(cell, run_dir, tmp_path):
    record = record_of(run_dir, cell)
    script = write_script(cell, run_dir, tmp_path)
    text = script.read_text()
    assert "matrix" not in "".join(line for line in text.splitlines() if line.startswith(("import", "from")))
    assert "pip install torch==" in text and record["signature"]["text"] in text
    done = run_standalone(script, tmp_path, "--json", str(tmp_path / "out.json"))
    assert done.returncode == 1, done.stdout + done.stderr
    reproduced = done.stdout.strip().splitlines()[-1]
    name = record["signature"]["exception"].rsplit(".", 1)[-1]
    assert reproduced.startswith(f"REPRODUCED in {record['phase']}: {name}: ")
    assert normalize_message(reproduced.split(": ", 2)[2]) == record["signature"]["message"]
    outcome = json.loads((tmp_path / "out.json").read_text())
    assert outcome["outcome"] == "reproduced" and outcome["failure"]["name"] == name
    assert outcome["environment"]["torch"] and outcome["environment"]["cpu_capability"]


def test_a_check_failure_shows_its_numbers_and_allowance(run_dir, tmp_path):
    """A check the matrix made (not an exception of the stack): the script prints the comparison
    that failed, with both sides and what was allowed."""
    kept = tmp_path / "kept"  # a REPRO_WORKDIR given is the user's: the script writes there and leaves it
    done = run_standalone(
        write_script(CHECK_FAILURE, run_dir, tmp_path), tmp_path, env_extra={"REPRO_WORKDIR": str(kept)}
    )
    assert (kept / "checkpoint").is_dir(), done.stdout[-2000:]
    failed = [line for line in done.stdout.splitlines() if line.startswith("CHECK ") and line.endswith("FAILED")]
    assert failed == [
        "CHECK checkpoint_reload DtypeContractBroken: after reload: 2 tensors changed dtype against 0, "
        "allowed none: FAILED"
    ], done.stdout


@pytest.mark.parametrize("cell", PASSING)
def test_a_script_for_a_passing_cell_holds_with_the_records_numbers(cell, run_dir, tmp_path):
    done = run_standalone(write_script(cell, run_dir, tmp_path), tmp_path, "--json", str(tmp_path / "out.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("HOLDS: every check of the cell held")
    metrics = record_of(run_dir, cell)["metrics"]
    checks = json.loads((tmp_path / "out.json").read_text())["checks"]
    against_fp32 = [c for c in checks if c["name"] == "OutOfTolerance"]
    assert against_fp32, checks
    # the same evaluation and the same fp32 reference as the matrix's, to the last bit on a CPU
    assert against_fp32[-1]["value"] == metrics["eval_loss"]
    assert against_fp32[-1]["reference"] == metrics["fp32_reference_loss"]
    if "curve" in metrics:
        curve = [c["value"] for c in checks if c["name"] == "CurveDiverged" and "fp32 twin" in c["what"]]
        assert curve == metrics["curve"]["losses"]
    if metrics.get("grad_scale") is not None and record_of(run_dir, cell)["mode"] == "train":
        # the resumed run's grad scaler against the saved one, as matrix/harness/resume.py check_restored
        scaler = [c for c in checks if c["what"] == "grad scaler state after reload"]
        assert scaler and scaler[0]["held"] and scaler[0]["value"] == scaler[0]["reference"], checks
        assert scaler[0]["value"]["scale"] == metrics["grad_scale"]


def test_a_distributed_script_starts_the_ranks_its_cell_had(run_dir, tmp_path):
    """A run made with --world-size 1 (one GPU): the script starts one rank, in a process group of
    its own, not the matrix's default two; without a record, --world-size (default 2) decides."""
    from matrix.results.metrics import CellMetrics, Distributed

    cell = "tiny-llama-bf16-mixed-train-cpu-ddp"
    document = json.loads((run_dir / "results.json").read_text())
    record = dict(record_of(run_dir, PASSING[0]), id=cell, engine="ddp", model="tiny-llama", precision="bf16-mixed")
    record["metrics"] = CellMetrics(distributed=Distributed(world_size=1, backend="gloo")).as_dict()
    document["cells"] = [record]
    (tmp_path / "results.json").write_text(json.dumps(document))
    settings = {
        line.split(" = ", 1)[0]: line.split(" = ", 1)[1]
        for line in repro.generate(cell, tmp_path / "results.json").splitlines()
        if line.startswith(("WORLD_SIZE = ", "DISTRIBUTED = "))
    }
    assert settings == {"WORLD_SIZE": "1", "DISTRIBUTED": "True"}
    assert "WORLD_SIZE = 2\n" in repro.generate(cell)
    assert "WORLD_SIZE = 3\n" in repro.generate(cell, world=3)
    script = tmp_path / "one_rank.py"
    script.write_text(repro.generate(cell, tmp_path / "results.json"))
    done = run_standalone(script, tmp_path)  # its rank worked in the script's directory, removed at the end
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_a_script_that_meets_another_failure_exits_2(run_dir, tmp_path):
    """The failure the run recorded is looked for; another one is named as such, with exit 2."""
    cell = PASSING[0]
    text = write_script(cell, run_dir, tmp_path).read_text()
    wanted = "TARGET = {'phase': 'evaluate', 'name': 'OutOfTolerance', 'text': 'as if the run had seen it'}"
    script = tmp_path / "other.py"
    script.write_text(
        text.replace("TARGET = None", wanted).replace(
            "def checkpoint_reload(cell):",
            "def checkpoint_reload(cell):\n    raise KeyError('not the failure the run saw')",
        )
    )
    done = run_standalone(script, tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("ANOTHER FAILURE in checkpoint_reload: KeyError: ")


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        ("no-such-cell", "no cell 'no-such-cell'"),
    ],
)
def test_what_cannot_be_written_says_why(cell, message, run_dir, tmp_path):
    generated, _ = generate(cell, run_dir, tmp_path)
    assert generated.returncode == 2
    assert generated.stderr.strip().startswith("python -m matrix repro: ") and message in generated.stderr


@pytest.mark.parametrize(
    ("variant", "outcome"),
    [
        ('{"seq_len":1,"padding":"right","pad_counts":[0]}', 1),  # an exploration's minimal finding
        ('{"seq_len":1,"padding":"none","pad_counts":[0]}', 0),  # its base: no padding mask at all
    ],
)
def test_a_script_carries_an_explorations_variant(variant, outcome, tmp_path):
    cell = "tiny-transformer-bf16-mixed-eval-cpu-torch"
    script = tmp_path / "variant.py"
    generated = subprocess.run(
        [sys.executable, "-m", "matrix", "repro", cell, "--variant", variant, "-o", str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert generated.returncode == 0, generated.stderr
    text = script.read_text()
    assert variant in text and "torch.tensor([[" in text
    done = run_standalone(script, tmp_path)
    assert done.returncode == outcome, done.stdout + done.stderr
    if outcome:
        assert "REPRODUCED in evaluate: RuntimeError: expected scalar type Float but found BFloat16" in done.stdout
    else:
        assert done.stdout.strip().endswith("HOLDS: every check of the cell held")


def test_a_variant_the_model_cannot_take_is_refused(tmp_path):
    cell = "tiny-llama-bf16-mixed-eval-cpu-torch"
    generated = subprocess.run(
        [sys.executable, "-m", "matrix", "repro", cell, "--variant", '{"num_heads":3}'],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert generated.returncode == 2 and "Traceback" not in generated.stderr
    assert generated.stderr.startswith("python -m matrix repro: --variant: ")


def test_a_compiled_twins_script_compares_with_its_eager_twin_as_the_matrix_does(tmp_path):
    """The compiled-vs-eager check (matrix/harness/pipeline.py check_against_eager) in the script: the
    same compiled evaluation and eager twin as the matrix recorded, the same row, and the logits'
    dtype compared (the aot-autograd-cache entry's check)."""
    cell = "tiny-llama-bf16-mixed-eval-cpu-torch-compile"
    reports = tmp_path / "reports"
    subprocess.run(
        [sys.executable, "-m", "pytest", "cases", "--report-dir", str(reports), "--engine", "torch-compile",
         "--device", "cpu", "--model", "tiny-llama", "-k", "bf16-mixed and eval", "-p", "no:cacheprovider", "-q"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    (run,) = [p for p in reports.iterdir() if p.is_dir() and p.name != "latest"]
    metrics = record_of(run, cell)["metrics"]
    assert record_of(run, cell)["outcome"] == "passed"
    done = run_standalone(write_script(cell, run, tmp_path), tmp_path, "--json", str(tmp_path / "out.json"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checks = json.loads((tmp_path / "out.json").read_text())["checks"]
    (loss,) = [c for c in checks if c["what"] == "compiled eval loss against the eager twin"]
    assert loss["held"] and loss["value"] == metrics["eval_loss"]
    assert loss["reference"] == metrics["compiled"]["eager_loss"]
    (dtype,) = [c for c in checks if c["what"] == "compiled eval logits dtype"]
    assert dtype["value"] == dtype["reference"] == f"torch.{metrics['compiled']['eager_logits_dtype']}"


def test_a_reload_allows_what_the_class_keeps_in_fp32_as_the_matrix_does(tmp_path):
    """XLNet keeps some of its attention weights fp32 when from_pretrained loads it in bf16: the matrix's
    reload check allows what the class declares and creates fp32 (matrix/models/declared_dtypes.py),
    whatever the cell's weights came from, and the reloaded model then fails in its einsum. The
    script allows the same tensors, so it fails where the cell fails and with the same error (it
    once counted only _keep_in_fp32_modules, and only for loaded weights, and stopped at a dtype
    change instead)."""
    cell = "hf:xlnet-bf16-true-eval-cpu-torch"
    reports = tmp_path / "reports"
    command = [sys.executable, "-m", "matrix", "run", "cases", "--model", "hf:xlnet", "--precision", "bf16-true"]
    command += ["--mode", "eval", "--engine", "torch", "--device", "cpu", "--report-dir", str(reports), "--run-id", "x"]
    subprocess.run([*command, "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    record = record_of(reports / "x", cell)
    assert record["phase"] == "checkpoint_reload" and record["signature"]["exception"] == "RuntimeError", record
    script = write_script(cell, reports / "x", tmp_path)
    done = run_standalone(script, tmp_path)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    reproduced = done.stdout.strip().splitlines()[-1]
    assert reproduced.startswith("REPRODUCED in checkpoint_reload: RuntimeError: "), reproduced
    assert normalize_message(reproduced.split(": ", 2)[2]) == record["signature"]["message"]


def test_a_scripts_failure_message_is_the_one_the_matrix_reads(run_dir, tmp_path):
    """The script records the whole message, as the matrix's signature reads it (message_of): a
    load_state_dict error names its missing keys on the second line, which a catalogue pattern
    matches; the script once kept the first line only, and its failure matched no entry."""
    import ast

    from matrix.results.signatures import message_of

    script = write_script(FAILING[0], run_dir, tmp_path)
    tree = ast.parse(script.read_text())
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("message_of", "first_line")]
    namespace: dict = {}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(script), "exec"), namespace)
    missing = RuntimeError(
        'Error(s) in loading state_dict for PeftModel:\n\tMissing key(s) in state_dict: "base.weight".'
    )
    gathered = RuntimeError(
        "CheckpointException ranks:dict_keys([0])\nTraceback (most recent call last):\n  ...\nValueError: no"
    )
    for exc in (missing, gathered, RuntimeError("one line"), RuntimeError()):
        assert namespace["message_of"](exc) == message_of(exc)
    assert namespace["first_line"](str(missing)) == "Error(s) in loading state_dict for PeftModel:"
