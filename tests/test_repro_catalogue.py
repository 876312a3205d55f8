"""Every catalogued bug has a cell whose standalone script shows it: REPRESENTATIVE names, for each
entry of kind "bug", one cell the entry selects. Where the entry is in force on this stack and the
cell runs here, the matrix's run of the cell is "known" under the entry and the script `python -m
matrix repro` writes for it, run with nothing of this project importable, exits 1 with the
entry's check (or exception) in the entry's phase. A CPU selection runs in this session; the rest
run where their releases, extras or device are (the row says which)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from matrix.catalogue import load
from matrix.environment import package_versions
from matrix.selection import cell_from_id
from matrix.signatures import normalize_message

ROOT = Path(__file__).resolve().parent.parent

# entry id -> a cell it selects, whose script shows it
REPRESENTATIVE = {
    "torch-encoder-fastpath-autocast": "tiny-transformer-bf16-mixed-eval-cpu-torch",
    "lightning-cpu-bf16-autocast-over-fp16-weights": "hf:gpt2-fp16-loaded-mixed-eval-cpu-lightning",
    "accelerate-fp32-conversion-hybridcache": "gemma-cache-bf16-loaded-mixed-eval-cpu-accelerate",
    "trainer-num-items-overcounts-causal-lm": "tiny-llama-fp32-train-cpu-hf-trainer",
    "trainer-num-items-overcounts-unmapped-causal-lm": "hf:gpt2-fp32-train-cpu-hf-trainer",
    "generate-reuses-cache-made-in-inference-mode": "gemma-cache-fp32-eval-cpu-lightning",
    "liger-flce-dtype-from-cuda-autocast-query": "liger-llama-bf16-mixed-train-cuda-torch",
    "liger-flce-logits-not-cast-before-addmm": "liger-llama-bf16-mixed-train-cpu-torch",
    "dcp-optimizer-init-step-writes-nan-into-fp16-weights": "tiny-llama-fp16-true-eval-cpu-accelerate-fsdp2",
    "accelerate-fsdp2-upcast-is-a-no-op": "tiny-llama-bf16-loaded-mixed-train-cpu-accelerate-fsdp2",
    "accelerate-fsdp2-load-state-drops-optimizer-state": "tiny-llama-fp32-train-cpu-accelerate-fsdp2",
    "accelerate-fsdp2-input-embeddings-sharded-twice": "hf:xlm-roberta-xl-fp32-eval-cpu-accelerate-fsdp2",
    "from-pretrained-thaws-frozen-parameters": "hf:afmoe-fp32-eval-cpu-torch",
    "dbrx-moe-index-add-under-autocast": "hf:dbrx-bf16-mixed-eval-cpu-torch",
    "xmod-lang-adapter-index-put-under-autocast": "hf:xmod-bf16-mixed-eval-cpu-torch",
    "inkling2-router-weight-cast-by-to": "hf:inkling2_text-bf16-true-eval-cpu-torch",
    "deepseek-v4-fp16-load-keeps-projections-fp32": "hf:deepseek_v4-fp16-loaded-mixed-eval-cpu-hf-trainer",
    "xlstm-cache-state-rounded-to-64": "hf:xlstm-fp32-eval-cpu-torch",
    "blt-cache-config-has-no-num-hidden-layers": "hf:blt-fp32-eval-cpu-torch",
    "gemma3n-left-padding-zero-magnitude-nan-gradients": "hf:gemma3n_text-fp32-train-cpu-torch",
    "reformer-generate-hashing-chunk-shorter-than-prompt": "hf:reformer-fp32-eval-cpu-torch",
    "cpu-grouped-mm-depends-on-weight-alignment": "hf:zaya-fp32-eval-cpu-torch",
    "youtu-init-zeroes-loaded-pad-embedding": "hf:youtu-fp32-train-cpu-torch",
    "trainer-resume-validates-config-with-base-class": "hf:dory-fp32-train-cpu-hf-trainer",
    "xlnet-half-load-keeps-attention-weights-fp32": "hf:xlnet-bf16-true-eval-cpu-torch",
    "bnb-cpu-4bit-inference-needs-whole-blocks": "lora-nf4-bf16-mixed-eval-cpu-torch",
    "bnb-cpu-4bit-save-after-inference-rounds-absmax": "lora-nf4-bf16-mixed-train-cpu-torch",
    "bnb-linear4bit-state-dict-does-not-load-back": "lora-nf4-bf16-mixed-train-cpu-accelerate",
    "fsdp2-shard-drops-int8-weight-state": "lora-int8-fp16-mixed-train-cpu-fsdp2",
    # a user's kind (-p tests.plugins.user_qlora): the entry was found through it
    "bnb-linear4bit-casts-its-bias-to-compute-dtype": "user-qlora-nf4-bf16-mixed-train-cpu-torch",
    "bnb-params4bit-quant-state-not-attributes-for-dcp": "lora-nf4-bf16-mixed-train-cpu-accelerate-fsdp2",
    "bnb-int8-saved-base-reloads-wrong": "lora-int8-fp16-mixed-train-cpu-torch",
    "bnb-0.46-cpu-int8-training-goes-nan": "lora-int8-fp16-mixed-train-cpu-accelerate",
    "bnb-cpu-int8-product-autocast-to-fp16-without-avx512": "lora-int8-fp16-mixed-eval-cpu-torch",
    "deepspeed-zero1-checkpoint-drops-frozen-parameters": "lora-fp32-train-cpu-deepspeed-zero1",
    "bnb-cpu-packed-4bit-state-dict-under-zero3": "lora-nf4-bf16-mixed-eval-cpu-deepspeed-zero3",
    "deepspeed-zero3-hooks-split-self-attention": "tiny-transformer-fp32-eval-cpu-deepspeed-zero3",
    "trainer-resume-skips-weight-conversion": "hf:gpt_neox-fp32-train-cpu-hf-trainer",
    "deepspeed-0.15-checkpoint-not-weights-only-loadable": "tiny-llama-fp32-train-cpu-deepspeed-zero1",
    "deepspeed-0.15-cpu-zero3-needs-numactl": "tiny-llama-fp32-eval-cpu-deepspeed-zero3",
    "deepspeed-zero0-bf16-gradients-not-zeroed": "tiny-llama-bf16-mixed-train-cpu-deepspeed-zero0",
    "deepspeed-zero0-bf16-adamw-stepped-at-construction": "tiny-llama-fp16-mixed-train-cpu-deepspeed-zero0",
    "deepspeed-0.17-stage0-bf16-load-checkpoint": "tiny-llama-bf16-mixed-train-cpu-deepspeed-zero0",
    "deepspeed-0.18.7-zero12-split-view-modified-inplace": "tiny-llama-fp32-train-cpu-deepspeed-zero1",
    "torchao-float8-ignores-cpu-autocast": "tiny-llama-float8-rowwise-gw-hp-train-cpu-torch",
    "torchao-float8-training-tensor-inference-mode": "tiny-llama-float8-rowwise-eval-cpu-lightning",
    "torch-mixed-matmul-precision-api-after-inductor": "tiny-llama-bf16-mixed-train-cuda-lightning-compile",
    "aot-autograd-cache-ignores-autocast-dtype": "tiny-llama-bf16-mixed-eval-cuda-torch-compile",
    "inductor-float8-rowwise-nonfinite-weight-gradient": "gemma-cache-float8-rowwise-train-cpu-ddp-compile",
    # triaged in issue 47
    "accelerate-auto-wrap-needs-every-no-split-class": "hf:mbart-fp32-eval-cpu-accelerate-fsdp2",
    "accelerate-fsdp2-tail-group-splits-tied-output-bias": "hf:roc_bert-fp32-eval-cpu-accelerate-fsdp2",
    "dcp-resume-needs-optimizer-state-of-every-parameter": "hf:mbart-fp32-train-cpu-fsdp2",
    "trainer-scales-a-loss-that-ignores-num-items": "hf:mbart-fp32-train-cpu-hf-trainer-zero2",
    "accelerate-fsdp2-checkpoint-steps-through-grad-scaler": "tiny-llama-fp16-mixed-eval-cuda-accelerate-fsdp2",
    "transformers-prequantized-reload-casts-saved-fp32-tensors": "lora-int8-fp16-mixed-train-cpu-torch",
}

# the CPU selection the tests session runs (cheap cells of the torch engine); nox -s repro
# (MATRIX_REPRO_EVERY_CELL=1) adds cells of the other engines of the tests' environment
RUN_HERE = ["torch-encoder-fastpath-autocast", "from-pretrained-thaws-frozen-parameters"]
if os.environ.get("MATRIX_REPRO_EVERY_CELL") == "1":
    RUN_HERE += [
        "youtu-init-zeroes-loaded-pad-embedding",
        "xlstm-cache-state-rounded-to-64",
        "trainer-num-items-overcounts-unmapped-causal-lm",
        "accelerate-auto-wrap-needs-every-no-split-class",
        "accelerate-fsdp2-tail-group-splits-tied-output-bias",
        "dcp-resume-needs-optimizer-state-of-every-parameter",
    ]


def bug_entries():
    return [entry for entry in load().entries if entry.kind == "bug"]


def test_every_catalogued_bug_has_a_representative_cell_it_selects():
    import tests.plugins.user_qlora  # noqa: F401  (a user's kind: its entry was found through it)

    catalogue = {entry.id: entry for entry in bug_entries()}
    assert set(REPRESENTATIVE) == set(catalogue), (
        f"without a representative: {sorted(set(catalogue) - set(REPRESENTATIVE))}; "
        f"no longer bugs: {sorted(set(REPRESENTATIVE) - set(catalogue))}"
    )
    for entry_id, cell_id in REPRESENTATIVE.items():
        cell = cell_from_id(cell_id)
        assert cell is not None, f"{entry_id}: {cell_id} is no cell of the grid"
        assert catalogue[entry_id].selects(cell), f"{entry_id} does not select {cell_id}"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    reports = tmp_path_factory.mktemp("reports")
    cells = [REPRESENTATIVE[entry] for entry in RUN_HERE]
    models = sorted({cell_from_id(c).model for c in cells})
    engines = sorted({cell_from_id(c).engine for c in cells})
    selection = " or ".join(f"test_cell[{c}]" for c in cells)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "cases", "--report-dir", str(reports), "--engine", ",".join(engines),
         "--device", "cpu", "--model", ",".join(models), "-k", selection.replace("[", " and ").replace("]", ""),
         "-p", "no:cacheprovider", "-q"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    runs = [p for p in reports.iterdir() if p.is_dir() and p.name != "latest"]
    assert len(runs) == 1, done.stdout[-3000:] + done.stderr[-3000:]
    return runs[0]


@pytest.mark.parametrize("entry_id", RUN_HERE)
def test_the_representatives_script_shows_the_bug_without_the_harness(entry_id, run_dir, tmp_path):
    from matrix.repro import generate

    entry = next(e for e in bug_entries() if e.id == entry_id)
    if not entry.versions_hold(package_versions()):
        pytest.skip(f"{entry_id} is not in force on this stack ({entry.versions}): run where its releases are")
    cell = REPRESENTATIVE[entry_id]
    record = next(c for c in json.loads((run_dir / "results.json").read_text())["cells"] if c["id"] == cell)
    assert record["outcome"] == "known" and record["known_failure"]["id"] == entry_id, record.get("outcome")
    script = tmp_path / "repro.py"
    script.write_text(generate(cell, run_dir))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, str(script), "--json", str(tmp_path / "out.json")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    outcome = json.loads((tmp_path / "out.json").read_text())
    name = record["signature"]["exception"].rsplit(".", 1)[-1]
    assert (outcome["phase"], outcome["failure"]["name"]) == (record["phase"], name)
    # the entry's own signature matches what the script saw, written as the matrix writes it
    signature = record["signature"]
    message = normalize_message(outcome["failure"]["message"])
    seen = f"{outcome['phase']}: {signature['exception']}: {message} @ {signature['origin']}"
    assert entry.matches(seen), seen
