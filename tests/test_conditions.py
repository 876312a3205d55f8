"""Catalogue conditions (matrix/catalogue/conditions.py) and engine traits (matrix/engines/traits.py): an
entry in force only where its mechanism applies. Every condition has a context in which it does
not hold, and there the entry does not claim the cell; a hardware condition that does not hold
makes a passing cell "inapplicable", never "fixed"."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from matrix.catalogue import conditions
from matrix.catalogue import entries as catalogue
from matrix.catalogue.entries import Catalogue, Context, classify
from matrix.engines import ENGINES
from matrix.engines.traits import ENGINE_TRAITS
from matrix.grid.cell import Cell

ROOT = Path(__file__).resolve().parents[1]
ENTRY = """
[[entry]]
id = "demo"
title = "demo entry"
kind = "bug"
upstream = []
signature = 'RuntimeError: boom'
cells = [{ model = ["tiny-transformer"], device = ["cpu"] }]
versions = { torch = ">=2" }
workaround = "none"
"""
CELL = Cell("tiny-transformer", "bf16-mixed", "eval", "cpu", "torch")
INSTALLED = {"torch": "2.13.0"}
AVX512_BF16 = {
    "cpu_capability": "AVX512",
    "cpu_avx512_bf16": True,
    "cpu_amx_tile": True,
    "cpu_vnni": True,
    "cpu_onednn_fp16": True,
    "bitsandbytes_cpu_avx512_bf16": True,
    "cuda_compute_capabilities": ["9.0"],
    "selected_cuda_device": 0,
}
# an AMD EPYC with AVX2 only (issue 46): nothing above AVX2, bitsandbytes detects no AVX512-BF16
AVX2 = {
    "cpu_capability": "AVX2",
    "cpu_avx512_bf16": False,
    "cpu_amx_tile": False,
    "cpu_vnni": False,
    "cpu_onednn_fp16": False,
    "bitsandbytes_cpu_avx512_bf16": False,
    "cuda_compute_capabilities": ["7.0"],
    "selected_cuda_device": 0,
}


def entry_when(*names: str, extra: str = "") -> catalogue.Entry:
    (entry,) = catalogue.parse(
        ENTRY.replace('workaround = "none"', f'workaround = "none"\nwhen = {json.dumps(list(names))}{extra}')
    ).entries
    return entry


def run_context(steps: int = 3, hardware: dict | None = None) -> Context:
    return Context(hardware=AVX512_BF16 if hardware is None else hardware, run={"train_steps": steps})


HARDWARE_CONDITIONS = [
    "cpu-avx512",
    "cpu-avx512-bf16",
    "cpu-amx",
    "cpu-avx512-vnni",
    "cpu-onednn-fp16",
    "bnb-cpu-avx512-bf16",
    "cuda-sm80",
]


@pytest.mark.parametrize("name", HARDWARE_CONDITIONS)
def test_a_hardware_condition_that_does_not_hold_claims_nothing_and_a_pass_is_inapplicable(name):
    entry = entry_when(name)
    found = Catalogue([entry])
    # holds on the AVX512-BF16 machine: in force, a pass is fixed
    assert found.in_force(CELL, INSTALLED, run_context()) == [entry]
    assert found.inapplicable(CELL, INSTALLED, run_context()) == []
    assert classify("passed", None, [entry]) == ("fixed", entry)
    # does not hold on the AVX2 machine: claims nothing; a pass is not applicable here, a failure is new
    avx2 = run_context(hardware=AVX2)
    assert found.in_force(CELL, INSTALLED, avx2) == []
    assert found.inapplicable(CELL, INSTALLED, avx2) == [entry]
    assert classify("passed", None, [], inapplicable=[entry]) == ("inapplicable", entry)
    assert classify("failed", "evaluate: RuntimeError: boom", [], inapplicable=[entry]) == ("failed", None)


def test_a_negated_hardware_condition_is_in_force_where_the_condition_does_not_hold():
    entry = entry_when("not:bnb-cpu-avx512-bf16")
    found = Catalogue([entry])
    assert found.in_force(CELL, INSTALLED, run_context(hardware=AVX2)) == [entry]
    assert found.in_force(CELL, INSTALLED, run_context()) == []
    assert [str(r) for r in entry.when] == ["not:bnb-cpu-avx512-bf16"]


def test_a_hardware_condition_that_holds_but_a_selector_that_does_not_is_neither_in_force_nor_inapplicable():
    entry = entry_when("cpu-avx512")
    other = Cell("tiny-llama", "bf16-mixed", "eval", "cpu", "torch")  # the entry selects tiny-transformer only
    for hardware in (AVX512_BF16, AVX2):
        assert Catalogue([entry]).in_force(other, INSTALLED, run_context(hardware=hardware)) == []
        assert Catalogue([entry]).inapplicable(other, INSTALLED, run_context(hardware=hardware)) == []


def test_cuda_capability_conditions_read_the_selected_device():
    hopper_and_volta = {"cuda_compute_capabilities": ["9.0", "7.0"], "selected_cuda_device": 1}
    assert not conditions.lookup("cuda-sm80").holds(Context(hardware=hopper_and_volta))
    assert conditions.lookup("cuda-sm80").holds(Context(hardware={**hopper_and_volta, "selected_cuda_device": 0}))
    assert not conditions.lookup("cuda-sm80").holds(Context(hardware={}))  # no GPU


def test_a_run_condition_replaces_min_curve_steps():
    """curve-steps-at-least-<n>: the failure only a curve of n steps shows is not in force (and so
    not fixed) in a run of fewer steps; `min_curve_steps = n` is the same condition."""
    entry = entry_when("curve-steps-at-least-8")
    found = Catalogue([entry])
    assert found.in_force(CELL, INSTALLED, run_context(steps=3)) == []
    assert found.inapplicable(CELL, INSTALLED, run_context(steps=3)) == []  # a run setting: no status of its own
    assert found.in_force(CELL, INSTALLED, run_context(steps=8)) == [entry]
    (older,) = catalogue.parse(ENTRY.replace('kind = "bug"', 'kind = "bug"\nmin_curve_steps = 8')).entries
    assert [str(r) for r in older.when] == ["curve-steps-at-least-8"]


def test_a_cell_condition_decides_after_the_run_from_the_cells_metrics():
    """optimizer-stepped-at-construction: the probe the deepspeed engines record. Where the count
    is 0 (ZeRO-1, or a fixed DeepSpeed) a failure with the signature is new; where it is above 0
    the failure is known; a pass with the mechanism present is passed (may_pass), not fixed."""
    entry = entry_when("optimizer-stepped-at-construction", extra="\nmay_pass = true")
    stepped = {"engine_effective": {"optimizer_steps_at_construction": 1}}
    not_stepped = {"engine_effective": {"optimizer_steps_at_construction": 0}}
    failure = "train_steps: RuntimeError: boom"
    assert Catalogue([entry]).in_force(CELL, INSTALLED, run_context()) == [entry]  # before the run: may claim
    assert classify("failed", failure, [entry], stepped) == ("known", entry)
    assert classify("failed", failure, [entry], not_stepped) == ("failed", None)
    assert classify("failed", failure, [entry], {}) == ("failed", None)  # an engine that records no probe
    assert classify("passed", None, [entry], stepped) == ("passed", None)
    # without may_pass the same entry would call a pass with the mechanism present fixed
    strict = entry_when("optimizer-stepped-at-construction")
    assert classify("passed", None, [strict], stepped) == ("fixed", strict)
    assert classify("passed", None, [strict], not_stepped) == ("passed", None)


def test_rank_means_over_uneven_shares_holds_only_where_each_rank_took_its_own_mean_of_unequal_shares():
    """rank-means-averaged-over-uneven-shares, as the Trainer engines on DeepSpeed record it
    (matrix/engines/hf_trainer_deepspeed.py rank_loss_averaging)."""
    from matrix.engines.hf_trainer_deepspeed import EACH_RANKS_MEAN, ITEMS_ACROSS_RANKS

    entry = entry_when("rank-means-averaged-over-uneven-shares", extra="\nmay_pass = true")
    failure = "train_steps: RuntimeError: boom"

    def effective(how, shares):
        return {"engine_effective": {"rank_loss_averaging": how, "loss_items_per_rank": shares}}

    assert Catalogue([entry]).in_force(CELL, INSTALLED, run_context()) == [entry]  # before the run: may claim
    assert classify("failed", failure, [entry], effective(EACH_RANKS_MEAN, [2, 1])) == ("known", entry)
    assert classify("failed", failure, [entry], effective(EACH_RANKS_MEAN, [1, 1])) == ("failed", None)  # even shares
    assert classify("failed", failure, [entry], effective(ITEMS_ACROSS_RANKS, [11, 1])) == ("failed", None)
    assert classify("failed", failure, [entry], {}) == ("failed", None)  # an engine that records nothing of it
    assert classify("passed", None, [entry], effective(EACH_RANKS_MEAN, [2, 1])) == ("passed", None)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('when = ["cpu-avx1024"]', "field 'when': unknown condition 'cpu-avx1024' .registered: cpu-avx512, "),
        ('when = "cpu-avx512"', "field 'when' must be a list of condition names"),
        ("may_pass = 1", "field 'may_pass' must be true or false"),
        ("may_pass = true", "field 'may_pass' needs a cell condition"),
    ],
)
def test_a_malformed_when_is_refused_naming_the_field(text, problem):
    with pytest.raises(catalogue.CatalogueError, match=problem):
        catalogue.parse(ENTRY.replace('workaround = "none"', f'workaround = "none"\n{text}'))


def test_every_condition_has_a_description_and_reads_one_of_three_things():
    for condition in conditions.CONDITIONS.values():
        assert condition.description and condition.reads in conditions.READS
    assert {c.reads for c in conditions.CONDITIONS.values()} == set(conditions.READS) - {"run"}  # run: a family
    assert conditions.lookup("curve-steps-at-least-4").reads == "run"


# ---------------------------------------------------------------- engine traits


def test_every_declared_engine_trait_is_described():
    for engine in ENGINES.values():
        assert engine.traits <= set(ENGINE_TRAITS), engine.name
        assert engine.compiled_traits <= set(ENGINE_TRAITS), engine.name


def test_a_compiled_twin_has_its_engines_traits_and_its_compiled_ones():
    assert ENGINES["fsdp2-compile"].traits == {"casts-parameters"}
    assert ENGINES["torch"].traits == frozenset() and ENGINES["torch-compile"].traits == {"compiles-under-autocast"}
    assert ENGINES["accelerate-compile"].traits == frozenset()  # accelerate autocasts inside the compiled forward


TRAIT_ENTRY = ENTRY.replace('cells = [{ model = ["tiny-transformer"], device = ["cpu"] }]', "cells = [{ %s }]")


@pytest.mark.parametrize(
    ("engine", "with_trait", "without_trait"),
    [
        ("torch", False, True),
        ("fsdp2", True, False),
        ("deepspeed-zero0", True, False),
        ("hf-trainer-zero3", True, False),
        ("accelerate", False, True),
        ("a-users-engine", False, True),  # declares no trait: no engine_trait selector matches it
    ],
)
def test_engine_trait_selectors_match_the_engines_that_declare_the_trait(engine, with_trait, without_trait):
    (selected,) = catalogue.parse(TRAIT_ENTRY % 'engine_trait = ["casts-parameters"]').entries
    (excluded,) = catalogue.parse(TRAIT_ENTRY % 'not_engine_trait = ["casts-parameters"]').entries
    cell = Cell("tiny-transformer", "bf16-mixed", "train", "cpu", engine)
    assert selected.selects(cell, frozenset()) is with_trait
    assert excluded.selects(cell, frozenset()) is without_trait


def test_an_unknown_engine_trait_is_refused():
    with pytest.raises(catalogue.CatalogueError, match=r"cells\[0\]\.engine_trait has unknown value 'casts'"):
        catalogue.parse(TRAIT_ENTRY % 'engine_trait = ["casts"]')


# The selectors the engine traits replaced, as HEAD had them: every engine the new selector
# claims, the old one claimed, and no other (over every registered engine, twins included).
OLD_FASTPATH_BF16 = [
    "accelerate-fsdp2", "deepspeed-zero0", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3",
    "hf-trainer-zero2", "hf-trainer-zero3",
]  # fmt: skip
OLD_FLOAT8 = [
    "torch-compile", "lightning-compile", "ddp-compile", "fsdp2", "accelerate-fsdp2",
    "deepspeed-zero0", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3", "hf-trainer-zero2", "hf-trainer-zero3",
]  # fmt: skip


@pytest.mark.parametrize(
    ("entry_id", "cell", "old_not_engine"),
    [
        ("torch-encoder-fastpath-autocast", ("tiny-transformer", "bf16-mixed", "eval", "cpu"), OLD_FASTPATH_BF16),
        ("torchao-float8-ignores-cpu-autocast", ("tiny-llama", "float8-rowwise-gw-hp", "train", "cpu"), OLD_FLOAT8),
    ],
)
def test_the_engine_trait_selectors_claim_the_engines_the_not_engine_lists_claimed(entry_id, cell, old_not_engine):
    entry = catalogue.load().by_id(entry_id)
    (old,) = catalogue.parse(TRAIT_ENTRY % f"not_engine = {json.dumps(old_not_engine)}").entries
    for engine in ENGINES:
        now = Cell(*cell, engine)
        assert entry.selects(now, frozenset()) is old.selects(now, frozenset()), engine


# ---------------------------------------------------------------- the shipped entries


def test_the_4bit_cpu_packing_entries_apply_only_where_bitsandbytes_detects_avx512_bf16():
    shipped = catalogue.load()
    for entry_id in (
        "bnb-cpu-4bit-inference-needs-whole-blocks",
        "bnb-cpu-4bit-save-after-inference-rounds-absmax",
        "bnb-cpu-packed-4bit-state-dict-under-zero3",
    ):
        entry = shipped.by_id(entry_id)
        assert [str(r) for r in entry.when] == ["bnb-cpu-avx512-bf16"]
        cell = Cell("lora", "nf4-bf16-mixed", "eval", "cpu", "deepspeed-zero3")
        assert entry.selects(cell, frozenset({"adapters"}))
        assert not entry.unmet(run_context(), "hardware") and entry.unmet(run_context(hardware=AVX2), "hardware")


def test_the_mkl_alignment_entry_is_in_force_only_where_a_run_computed_without_mkls_reproducible_mode():
    """The cells run with MKL_CBWR=AUTO (matrix/devices/cpu.py REPRODUCIBLE_BLAS), under which MKL rounds
    misaligned weights as aligned ones: there the entry claims nothing and a pass of its cell is
    inapplicable. A run with the mode off (MKL_CBWR empty), or recorded before the fact, is in force."""
    entry = catalogue.load().by_id("cpu-grouped-mm-depends-on-weight-alignment")
    assert [str(r) for r in entry.when] == ["mkl-reproducible-off"]
    found, cell = Catalogue([entry]), Cell("hf:zaya", "fp32", "eval", "cpu", "torch")
    installed = {"torch": "2.13.0", "transformers": "5.24.0"}
    reproducible = run_context(hardware={**AVX512_BF16, "mkl_cbwr": "AUTO"})
    assert found.in_force(cell, installed, reproducible) == []
    assert found.inapplicable(cell, installed, reproducible) == [entry]
    for off in ({**AVX512_BF16, "mkl_cbwr": ""}, AVX512_BF16):
        assert found.in_force(cell, installed, run_context(hardware=off)) == [entry]


def test_the_afmoe_thaw_entry_claims_every_engine():
    entry = catalogue.load().by_id("from-pretrained-thaws-frozen-parameters")
    for engine in ENGINES:
        assert entry.selects(Cell("tiny-llama", "fp32", "train", "cpu", engine), frozenset({"frozen-parameters"}))
        assert not entry.selects(Cell("tiny-llama", "fp32", "train", "cpu", engine), frozenset({"full-weights"}))
    for text in (  # the sweep's three signatures of afmoe under the engines HEAD's entry left out
        "checkpoint_reload: matrix.checks.FrozenParameterThawed: after reload: a parameter the model is created with "
        "requires_grad=False is trainable @ matrix.checks:check_frozen_kept",
        "train_steps: matrix.checks.FrozenParameterThawed: after build: a parameter the model is created with "
        "requires_grad=False is trainable @ matrix.checks:check_frozen_kept",
        "evaluate: matrix.checks.FrozenParameterThawed: after build: a parameter the model is created with "
        "requires_grad=False is trainable @ matrix.checks:check_frozen_kept",
    ):
        assert entry.matches(text)


# ---------------------------------------------------------------- this machine, and another CPU emulated

PROBE = "import json; from matrix.devices import hardware_facts; print(json.dumps(hardware_facts()))"


def facts_in_a_process(**env) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env}, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_avx2_cpu_emulated_reads_as_one():
    """ATEN_CPU_CAPABILITY=avx2 lowers what torch dispatches on, and tests/cpu_emulation answers
    bitsandbytes' native detection with no: the conditions see the AVX2 machine, while the CPU's
    own features (cpuinfo) are still this machine's."""
    here = facts_in_a_process()
    emulated = facts_in_a_process(ATEN_CPU_CAPABILITY="avx2", PYTHONPATH=str(ROOT / "tests" / "cpu_emulation"))
    assert emulated["cpu_capability"] == "AVX2"
    assert emulated["bitsandbytes_cpu_avx512_bf16"] is False
    assert emulated["cpu_avx512_bf16"] == here["cpu_avx512_bf16"]
    assert not conditions.lookup("cpu-avx512").holds(Context(hardware=emulated))
    assert not conditions.lookup("bnb-cpu-avx512-bf16").holds(Context(hardware=emulated))


def test_bitsandbytes_detection_is_read_from_the_imported_library_where_it_is_imported(monkeypatch):
    """A test that patches bitsandbytes' detection sees the hardware facts follow it."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional

    from matrix.devices import cpu, hardware_facts

    monkeypatch.setattr(bitsandbytes.functional, "has_avx512bf16", lambda: False)
    hardware_facts.cache_clear()
    try:
        assert cpu.bitsandbytes_avx512_bf16() == (False, "bitsandbytes.functional.has_avx512bf16()")
        assert hardware_facts()["bitsandbytes_cpu_avx512_bf16"] is False
    finally:
        hardware_facts.cache_clear()


def test_every_report_records_the_hardware_facts():
    from matrix.devices.fingerprint import capture

    hardware = capture(0)["hardware"]
    keys = ("cpu_capability", "cpu_avx512_bf16", "cpu_amx_tile", "cpu_vnni", "cpu_onednn_fp16")
    for key in (*keys, "bitsandbytes_cpu_avx512_bf16", "mkl_cbwr"):
        assert key in hardware
    assert hardware["cpu_capability"] == __import__("torch").backends.cpu.get_cpu_capability()
    assert hardware["mkl_cbwr"] == os.environ.get("MKL_CBWR", "AUTO")  # as the cells and the scripts run


# ---------------------------------------------------------------- reports


def test_reports_show_an_inapplicable_cell_as_its_own_status(tmp_path):
    """summary.md, index.html, compatibility.md and diff name an inapplicable cell; it is neither
    fixed nor new, and its entry says which hardware condition does not hold."""
    import jsonschema

    from matrix.precisions.policies import table
    from matrix.results import compare, html, markdown
    from matrix.results.compatibility import compatibility_markdown
    from matrix.results.document import results_document
    from matrix.results.files import SCHEMA_FILE
    from matrix.results.records import CellRecord, known_failure_record

    entry = catalogue.load().by_id("bnb-cpu-4bit-inference-needs-whole-blocks")
    run = {
        "id": "run-b", "command": "python -m matrix run cases", "started_at": "2026-01-01T00:00:00Z",
        "finished_at": "2026-01-01T00:00:01Z", "duration_s": 1.0, "pytest_exit_status": 0,
        "selection": {"device": ["cpu"]}, "axes": {}, "git_commit": None, "git_dirty": None,
    }  # fmt: skip
    env = {
        "python": "3.11", "cpu": "AMD EPYC", "cpu_count": 2,
        "packages": {"torch": "2.13.0", "transformers": "5", "peft": "0", "accelerate": "1"},
        "cuda_devices": [], "selected_cuda_device": None, "env": {}, "warnings": [], "hardware": AVX2,
    }  # fmt: skip
    cells = [
        CellRecord.of(
            Cell(model, "nf4-bf16-mixed", "eval", "cpu", "torch"),
            "inapplicable",
            known_failure=known_failure_record(entry, not_holding=["bnb-cpu-avx512-bf16"]),
        ).as_dict()
        for model in ("lora", "hf:qwen2")
    ]
    document = results_document(run, env, cells, (), table())
    jsonschema.validate(document, json.loads(SCHEMA_FILE.read_text()))
    assert document["counts"]["inapplicable"] == 2 and document["counts"]["fixed"] == 0
    assert sorted(document["known_failures"][entry.id]["inapplicable_cells"]) == sorted(c["id"] for c in cells)
    summary = markdown.summary_markdown(document)
    assert "2 not applicable here**" in summary and f"➖ n/a `{entry.id}`" in summary
    assert f"entry `{entry.id}` (`bnb-cpu-avx512-bf16` does not hold)" in summary
    assert (
        "torch dispatches on AVX2; CPU has none of AVX512-BF16, AMX, VNNI, oneDNN float16; "
        "bitsandbytes detects AVX512-BF16: no" in summary
    )
    page = html.html_report(document)
    assert 'class="outcome-inapplicable"' in page and f"n/a {entry.id}" in page
    assert f"➖ `{entry.id}`" in compatibility_markdown(document)  # the entry by its id, as every page names it
    before = json.loads(json.dumps(document))
    for cell in before["cells"]:
        cell.update(outcome="fixed")
    changes = compare.diff(before, document).changes
    assert [c["cell"] for c in changes["inapplicable"]] == sorted(c["id"] for c in cells)
    assert changes["new"] == [] and changes["fixed"] == []


def test_the_probe_counts_a_torch_optimizers_steps_and_is_none_without_one():
    """matrix/engines/libraries/deepspeed.py steps_taken: what engine_effective.optimizer_steps_at_construction
    records; ZeRO-3's inference engine (DeepSpeedZeRoOffload) holds no optimizer state at all."""
    import torch

    from matrix.engines.libraries.deepspeed import steps_taken

    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([weight])
    assert steps_taken(optimizer) == 0
    weight.grad = torch.zeros(2)
    optimizer.step()  # as DeepSpeed's fp16/bf16 wrappers do on zero gradients when they are built
    assert steps_taken(optimizer) == 1
    assert steps_taken(object()) is None
    assert not conditions.lookup("optimizer-stepped-at-construction").holds(
        Context(metrics={"engine_effective": {"optimizer_steps_at_construction": None}})
    )


LIGHTNING_COMPILE = Cell("tiny-llama", "bf16-mixed", "train", "cuda", "lightning-compile")
MIXED_API = (
    "mid_training_eval: RuntimeError: PyTorch is checking the matmul precision without a specific backend name,"
    "Current status indicate that you have used mix of the legacy and new APIs to set the matmul precision. "
    "@ lightning.fabric.accelerators.cuda:_check_cuda_matmul_precision"
)


@pytest.mark.parametrize(
    ("outcome", "signature", "refused", "verdict"),
    [
        ("failed", MIXED_API, True, "known"),
        ("passed", None, True, "fixed"),  # the getter refused and Lightning did not ask it: news
        ("passed", None, False, "passed"),  # the H100 of issue 47: the compile wrote no per-backend setting
        ("failed", MIXED_API, False, "failed"),  # the signature without the mechanism recorded: not this entry
    ],
)
def test_the_matmul_api_entry_claims_the_cells_whose_getter_refused(outcome, signature, refused, verdict):
    entry = catalogue.load().by_id("torch-mixed-matmul-precision-api-after-inductor")
    assert entry.selects(LIGHTNING_COMPILE)
    metrics = {"effective": {"legacy_matmul_getter_refused": refused}}
    assert classify(outcome, signature, [entry], metrics)[0] == verdict


def test_every_cell_records_whether_the_legacy_matmul_getter_refused_when_its_phases_ended(tmp_path):
    """The probe the entry above reads, on a CPU: a cell in a process whose fp32 precision APIs
    agree records false; in one where the per-backend API was written (what Inductor does while it
    compiles on CUDA), true."""
    import torch

    from matrix.execute.cell_run import run_cell

    cell = Cell("tiny-transformer", "fp32", "eval", "cpu", "torch")
    assert run_cell(cell, tmp_path / "agree").metrics.effective.legacy_matmul_getter_refused is False
    before = torch.backends.cuda.matmul.fp32_precision
    legacy = torch.get_float32_matmul_precision()
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32" if before != "tf32" else "ieee"
        assert run_cell(cell, tmp_path / "mixed").metrics.effective.legacy_matmul_getter_refused is True
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
        torch.set_float32_matmul_precision(legacy)


def test_the_h100_lightning_compile_cells_get_verdicts_that_hold_in_both_orders():
    """Runs O1 and O2 of docs/gpu-runs/h100-2026-11-27-issue47 (torch 2.11.0+cu130): the same
    cells in two orders. Judged by the two compile entries (on the stack they ran on), no cell is
    called fixed (the mechanisms did not act: no per-backend write, or a cache that held the cell's
    own dtype), and the fp16-mixed training cell served by AOTAutograd's cache (its curve follows
    bf16's) is known, in both orders."""
    import gzip
    from pathlib import Path

    runs = Path(__file__).resolve().parent.parent / "docs" / "gpu-runs" / "h100-2026-11-27-issue47"
    entries = [
        catalogue.load().by_id(name)
        for name in ("torch-mixed-matmul-precision-api-after-inductor", "aot-autograd-cache-ignores-autocast-dtype")
    ]
    verdicts = {}
    for run in ("O1", "O2"):
        cells = json.loads(gzip.decompress((runs / run / "results.json.gz").read_bytes()))["cells"]
        for record in cells:
            cell = Cell(record["model"], record["precision"], record["mode"], record["device"], record["engine"])
            if record["engine"] != "lightning-compile" or record["outcome"] not in ("failed", "passed", "fixed"):
                continue  # known by another entry (rope-buffer-cast-lost-on-reload)
            selecting = [e for e in entries if e.selects(cell)]
            outcome = "failed" if record["outcome"] == "failed" else "passed"
            text = (record.get("signature") or {}).get("text")
            verdict, entry = classify(outcome, text, selecting, record["metrics"])
            verdicts.setdefault(record["id"], set()).add((verdict, entry.id if entry else None))
    assert verdicts == {
        "tiny-llama-fp32-eval-cuda-lightning-compile": {("passed", None)},
        "tiny-llama-fp32-train-cuda-lightning-compile": {("passed", None)},
        "tiny-llama-bf16-mixed-eval-cuda-lightning-compile": {("passed", None)},
        "tiny-llama-bf16-mixed-train-cuda-lightning-compile": {("passed", None)},
        "tiny-llama-fp16-mixed-eval-cuda-lightning-compile": {("passed", None)},
        "tiny-llama-fp16-mixed-train-cuda-lightning-compile": {("known", "aot-autograd-cache-ignores-autocast-dtype")},
    }
