"""Standalone reproduction scripts of the precisions the plain parts do not cover: a quantized base
(parts/quantized.py: the BitsAndBytesConfig the harness loads with, peft's preparation, the fp32
reference in fp32 compute, the unquantized model with the trained adapters, the two other saves of
the reload), float8 (parts/float8.py: torchao's conversion), and the one-line refusals (a user's
loop, a library that converts to float8 itself). Scripts are generated from a real run made here
and run with nothing of this project importable (tests/test_repro.py's helpers)."""

import json
import os
import subprocess
import sys

import pytest
from test_repro import ROOT, record_of, run_standalone, write_script

from conftest import python_path
from matrix.grid import packages
from matrix.precisions import quantization
from matrix.precisions.float8 import REQUIREMENT as TORCHAO
from matrix.releases.repro import generate

INT8 = "lora-int8-fp16-mixed-eval-cpu-torch"
# bnb-cpu-4bit-save-after-inference-rounds-absmax: a check (CheckpointMismatch) in the reload's saves
ABSMAX = "qlora-nf4-bf16-mixed-eval-cpu-torch"
ABSMAX_ENTRY = "bnb-cpu-4bit-save-after-inference-rounds-absmax"
FLOAT8 = "tiny-llama-float8-tensorwise-train-cpu-torch"

needs_bitsandbytes = pytest.mark.skipif(
    quantization.skip_reason() is not None, reason=quantization.skip_reason() or "bitsandbytes is installed"
)


@pytest.fixture(scope="module")
def quantized_run(tmp_path_factory):
    reports = tmp_path_factory.mktemp("reports")
    selection = f"({INT8} and not q{INT8}) or {ABSMAX}"  # -k matches substrings: qlora's int8 cell left out
    command = [sys.executable, "-m", "pytest", "cases", "--report-dir", str(reports), "--engine", "torch"]
    subprocess.run(
        [*command, "--device", "cpu", "--mode", "eval", "--model", "lora,qlora", "-k", selection],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    (latest,) = [p for p in reports.iterdir() if p.is_dir() and p.name != "latest"]
    return latest


def checks_of(tmp_path) -> list[dict]:
    return json.loads((tmp_path / "out.json").read_text())["checks"]


@needs_bitsandbytes
def test_an_int8_script_applies_the_quantized_checks_with_the_records_numbers(quantized_run, tmp_path):
    record = record_of(quantized_run, INT8)
    assert record["outcome"] in ("passed", "inapplicable"), record.get("message")
    script = write_script(INT8, quantized_run, tmp_path)
    text = script.read_text()
    assert "BitsAndBytesConfig(load_in_8bit=True)" in text and "prepare_model_for_kbit_training(base)" in text
    done = run_standalone(script, tmp_path, "--json", str(tmp_path / "out.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    checks = checks_of(tmp_path)
    metrics = record["metrics"]
    fp32, unquantized = [c for c in checks if c["name"] == "OutOfTolerance"]
    # the same evaluation, the same fp32 reference (the quantized weights in fp32 compute) and the
    # same unquantized fp32 model with the adapters as the matrix's, to the last bit on a CPU
    assert fp32["value"] == unquantized["value"] == metrics["eval_loss"]
    assert fp32["reference"] == metrics["fp32_reference_loss"]
    assert unquantized["reference"] == metrics["quantized"]["unquantized_loss"]
    assert unquantized["allowance"].startswith("0.0112 (atol 0.002 + rtol 0.002")  # QUANTIZED_VS_UNQUANTIZED's int8
    reloads = [c["what"] for c in checks if c["name"] == "CheckpointMismatch"]
    assert reloads == [
        "eval logits",
        "eval logits over the saved quantized base",
        "eval logits of the saved merged model",
        "eval logits of the resumed run",
    ]
    storage = [c["what"] for c in checks if c["name"] == "DtypeContractBroken" and "int8 layers" in c["what"]]
    assert len(storage) == 4 and all(c["held"] for c in checks)


@needs_bitsandbytes
def test_a_catalogued_bitsandbytes_failure_exits_1_with_its_check(quantized_run, tmp_path):
    record = record_of(quantized_run, ABSMAX)
    if (record.get("known_failure") or {}).get("id") != ABSMAX_ENTRY or record["outcome"] != "known":
        pytest.skip("Requires: [bnb-cpu-avx512-bf16] (bitsandbytes repacks 4-bit weights on this CPU only there)")
    script = write_script(ABSMAX, quantized_run, tmp_path)
    done = run_standalone(script, tmp_path, "--json", str(tmp_path / "out.json"))
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith(f"REPRODUCED in checkpoint_reload: CheckpointMismatch: {record['signature']['message']}")
    failed = [c for c in checks_of(tmp_path) if not c["held"]]
    assert failed[0]["what"] == "eval logits over the saved quantized base"
    # the matrix's number: the largest difference the save-and-read-back made
    recorded = record["metrics"]["quantized"]["prequantized_reload_max_abs_difference"]
    assert failed[0]["value"] == f"max |difference| {recorded:.3g}"


def test_a_float8_script_converts_with_torchaos_recipe():
    text = generate(FLOAT8)
    assert "convert_to_float8_training(" in text and 'Float8LinearConfig.from_recipe_name(float8["recipe"])' in text
    assert "'float8': {'recipe': 'tensorwise'}" in text and "FLOAT8_DIVISOR = 16" in text
    # the part comes after the phases it wraps and before main runs; a quantized base's does not come
    precision = text.split(
        "# ---------------------------------------------------------------- what the precision adds"
    )[1]
    assert precision.index("ENGINE.start = start_in_float8") < precision.index('if __name__ == "__main__":')
    assert "def quantized_base" not in text


def test_a_float8_script_holds_where_the_matrix_cell_passes(tmp_path):
    if packages.skip_reason((TORCHAO,)) is not None:
        pytest.skip(packages.skip_reason((TORCHAO,)))
    script = tmp_path / f"{FLOAT8}.py"
    script.write_text(generate(FLOAT8))
    done = run_standalone(script, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CHECK train_steps CheckFailure: float8 layers after prepare" in done.stdout


@pytest.mark.parametrize(
    ("cell", "plugin", "words"),
    [
        ("tiny-llama-bf16-mixed-train-cpu-user-loop", "user_loop", "is a user's loop (user_loop)"),
        ("tiny-llama-float8-tensorwise-train-cpu-accelerate", None, "converts the model to float8 itself"),
    ],
)
def test_what_a_script_cannot_write_is_refused_in_one_line(cell, plugin, words, tmp_path):
    command = [sys.executable, "-m", "matrix", "repro", cell, "-o", str(tmp_path / "x.py")]
    command += ["-p", plugin] if plugin else []
    env = {**os.environ, "PYTHONPATH": python_path(ROOT / "tests" / "plugins")}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("python -m matrix repro: ") and words in done.stderr


# bnb-cpu-int8-product-autocast-to-fp16-without-avx512, on a CPU without AVX-512 as tests/cpu_emulation
# makes one (issue 46): the evaluation against the unquantized model with the adapters leaves its row
EMULATED = "qlora-int8-fp16-mixed-eval-cpu-torch"
EMULATED_ENTRY = "bnb-cpu-int8-product-autocast-to-fp16-without-avx512"
EMULATION = {"ATEN_CPU_CAPABILITY": "avx2", "PYTHONPATH": str(ROOT / "tests" / "cpu_emulation")}


@needs_bitsandbytes
def test_the_int8_product_under_fp16_autocast_shows_against_the_unquantized_model(tmp_path):
    reports = tmp_path / "reports"
    command = [sys.executable, "-m", "pytest", "cases", "--report-dir", str(reports), "--engine", "torch"]
    command += ["--device", "cpu", "--mode", "eval", "--model", "qlora", "--precision", "int8-fp16-mixed"]
    env = {**os.environ, **EMULATION, "PYTHONPATH": python_path(ROOT / "tests" / "cpu_emulation")}
    subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    (run,) = [p for p in reports.iterdir() if p.is_dir() and p.name != "latest"]
    record = record_of(run, EMULATED)
    if (record.get("known_failure") or {}).get("id") != EMULATED_ENTRY or record["outcome"] != "known":
        pytest.skip("Requires: [bitsandbytes >= 0.50 taking its portable int8 product] (the entry's condition)")
    script = write_script(EMULATED, run, tmp_path)
    # the script runs on the machine the record describes: the same emulation, nothing of the project
    done = subprocess.run(
        [sys.executable, str(script), "--json", str(tmp_path / "out.json")],
        cwd=tmp_path,
        env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **EMULATION},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("REPRODUCED in evaluate: OutOfTolerance: ")
    (failed,) = [c for c in checks_of(tmp_path) if not c["held"]]
    assert "against the unquantized fp32 model" in failed["what"]
    assert failed["value"] == record["metrics"]["eval_loss"]
    assert failed["reference"] == record["metrics"]["quantized"]["unquantized_loss"]
