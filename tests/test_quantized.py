"""Quantized bases (matrix/precisions/quantization.py): the precision rows that declare them, the skips
without bitsandbytes or without adapters to train, the storage check against real bitsandbytes
layers, the checks' own hands off the model they check, and the quantized cells through the
engines (the CI slice), for our kinds and for a user's QLoRA written the usual way
(tests/plugins/user_qlora.py)."""

import json
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from matrix.checks.assertions import DtypeContractBroken
from matrix.grid.cell import Cell
from matrix.models import MODELS
from matrix.plugin.parametrize import skip_reason
from matrix.precisions import quantization
from matrix.precisions.policies import PRECISIONS

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = Path(__file__).resolve().parent / "plugins"
QUANTIZED = ("nf4-bf16-mixed", "nf4-fp16-mixed", "int8-fp16-mixed")
needs_bitsandbytes = pytest.mark.skipif(
    quantization.skip_reason() is not None, reason=quantization.skip_reason() or "bitsandbytes is installed"
)


def test_each_quantized_row_declares_its_scheme_compute_dtype_autocast_and_scaler():
    declared = {name: PRECISIONS[name].settings() for name in QUANTIZED}
    assert declared["nf4-bf16-mixed"]["quantization"] == {
        "scheme": "nf4",
        "bits": 4,
        "compute_dtype": "bfloat16",
        "double_quant": True,
        "prepare_for_kbit_training": True,
        "library": "bitsandbytes",
    }
    assert declared["nf4-bf16-mixed"]["autocast_dtype"] == "bfloat16" and not declared["nf4-bf16-mixed"]["grad_scaler"]
    assert declared["nf4-fp16-mixed"]["quantization"]["compute_dtype"] == "float16"
    assert declared["nf4-fp16-mixed"]["autocast_dtype"] == "float16" and declared["nf4-fp16-mixed"]["grad_scaler"]
    # seed 000: llama-recipes loads in 8-bit with dtype=float16 and trains under fp16 autocast + GradScaler
    int8 = declared["int8-fp16-mixed"]
    assert int8["quantization"]["scheme"] == "int8" and int8["quantization"]["compute_dtype"] is None
    assert (int8["weights_dtype"], int8["autocast_dtype"], int8["grad_scaler"]) == ("float16", "float16", True)
    assert all(PRECISIONS[name].weights_from == "load" for name in QUANTIZED)
    assert PRECISIONS["bf16-mixed"].settings()["quantization"] is None
    assert PRECISIONS["int8-fp16-mixed"].quantization.storage_dtype == torch.int8
    assert PRECISIONS["nf4-fp16-mixed"].quantization.storage_dtype == torch.uint8


def test_a_row_that_cannot_hold_together_is_refused_when_declared():
    with pytest.raises(ValueError, match="one of nf4, fp4, int8"):
        quantization.Quantization("int4", torch.bfloat16)
    with pytest.raises(ValueError, match="declares its compute dtype"):
        quantization.Quantization("nf4")
    with pytest.raises(ValueError, match="int8 has none"):
        quantization.Quantization("int8", torch.float16)


@pytest.mark.parametrize(
    ("installed", "reason"),
    [
        (None, r"Requires: \[bitsandbytes >= 0\.46\.1\] \(not installed: pip install -e '\.\[quantized\]'\)"),
        (
            "0.45.5",
            r"Requires: \[bitsandbytes >= 0\.46\.1\] "
            r"\(0\.45\.5 installed: its 4-bit and 8-bit layers run on CUDA only\)",
        ),
        (
            "0.46.0",
            r"Requires: \[bitsandbytes >= 0\.46\.1\] "
            r"\(0\.46\.0 installed: transformers' quantized loading refuses it\)",
        ),
        ("0.46.1", None),
        ("0.50.2", None),
    ],
)
def test_without_bitsandbytes_on_a_cpu_the_cells_skip_naming_it(monkeypatch, installed, reason):
    monkeypatch.setattr(quantization, "installed_bitsandbytes", lambda: installed)
    for name in QUANTIZED:
        found = skip_reason(Cell("lora", name, "train", "cpu", "torch"), 0)
        assert (found is None) if reason is None else (found is not None and __import__("re").fullmatch(reason, found))
    assert (
        skip_reason(Cell("lora", "bf16-mixed", "train", "cpu", "torch"), 0) is None
    )  # no quantization: no requirement


def test_a_kind_that_trains_its_own_weights_skips_a_quantized_base_and_says_why():
    for model in ("tiny-llama", "tiny-transformer", "gemma-cache"):
        reason = skip_reason(Cell(model, "nf4-bf16-mixed", "train", "cpu", "torch"), 0)
        assert reason == (
            f"Requires: [adapters to train over a quantized base] ({model} trains its own weights; "
            "nf4 weights take no gradient)"
        )
    assert MODELS["lora"].quantizable and MODELS["qlora"].quantizable


def _built(model: str, precision: str, tmp_path):
    return MODELS[model].build(PRECISIONS[precision], torch.device("cpu"), tmp_path)


@needs_bitsandbytes
def test_the_storage_check_passes_what_from_pretrained_quantized_and_catches_what_it_did_not(tmp_path):
    import bitsandbytes as bnb

    model = _built("qlora", "nf4-bf16-mixed", tmp_path)
    record = quantization.check_storage(model, PRECISIONS["nf4-bf16-mixed"].quantization, "after build")
    assert record == {
        "quantized_layers": 14,
        "storage_dtype": "uint8",
        "kept_unquantized": ["base_model.model.lm_head"],
    }
    # the same model declared as another scheme or compute dtype is refused
    with pytest.raises(DtypeContractBroken, match=r"a fp4 layer's quant_type is nf4, not fp4"):
        quantization.check_storage(model, quantization.Quantization("fp4", torch.bfloat16, True), "after build")
    with pytest.raises(DtypeContractBroken, match=r"compute_dtype is torch\.bfloat16, not torch\.float16"):
        quantization.check_storage(model, quantization.Quantization("nf4", torch.float16, True), "after build")
    with pytest.raises(DtypeContractBroken, match=r"int8 layer's dtype is torch\.uint8, not torch\.int8"):
        quantization.check_storage(model, PRECISIONS["int8-fp16-mixed"].quantization, "after build")
    # one layer left in full precision, as a quantization that skipped a module would leave it
    layer = model.base_model.model.model.layers[0].mlp.down_proj
    assert isinstance(layer.base_layer, bnb.nn.Linear4bit)
    layer.base_layer = torch.nn.Linear(128, 64, bias=False)
    with pytest.raises(DtypeContractBroken, match="linear layers left unquantized in a nf4 base") as caught:
        quantization.check_storage(model, PRECISIONS["nf4-bf16-mixed"].quantization, "after build")
    assert "mlp.down_proj.base_layer" in caught.value.details


@needs_bitsandbytes
def test_the_expected_dtypes_of_a_prepared_quantized_base(tmp_path):
    from matrix.harness.cell_state import CellState
    from matrix.results.metrics import CellMetrics

    for name, storage in (("nf4-bf16-mixed", torch.uint8), ("int8-fp16-mixed", torch.int8)):
        kind, precision = MODELS["qlora"], PRECISIONS[name]
        state = CellState(
            Cell("qlora", name, "eval", "cpu", "torch"), kind, precision, torch.device("cpu"), tmp_path, CellMetrics()
        )
        model = _built("qlora", name, tmp_path)
        expected = state.expected_dtypes(model)
        assert expected["base_model.model.model.layers.1.self_attn.o_proj.base_layer.weight"][0] == storage
        # prepare_model_for_kbit_training casts what is not quantized to fp32: norms, embeddings, lm_head
        assert expected["base_model.model.model.norm.weight"] == (
            torch.float32,
            "prepare_model_for_kbit_training casts the unquantized weights to fp32",
        )
        assert expected["base_model.model.lm_head.weight"][0] == torch.float32
        assert all(p.dtype == expected[n][0] for n, p in kind.precision_weights(model).items())
        # the adapters are the trainable parameters, in fp32 (peft's autocast_adapter_dtype)
        trainable = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
        assert trainable and all("lora_" in n and d == torch.float32 for n, d in trainable.items())


@needs_bitsandbytes
def test_the_checks_do_not_change_the_model_they_check(tmp_path):
    """A bitsandbytes 4-bit layer that ran a CPU inference rewrites itself in state_dict() (the
    catalogue's bnb-cpu-4bit-save-after-inference-rounds-absmax); copying the weights for a
    reference must not go through it."""
    model = _built("qlora", "nf4-bf16-mixed", tmp_path).eval()
    batch = MODELS["qlora"].batch(torch.device("cpu"))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        before = model(**batch).logits
    copy = _built("qlora", "nf4-bf16-mixed", tmp_path)
    assert quantization.copy_float_weights(model, copy) == []
    twin = _built("qlora", "fp32", tmp_path)
    assert quantization.copy_float_weights(model, twin, trainable_only=True) == []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(**batch).logits, before)
        assert torch.equal(copy.eval()(**batch).logits, before)


@needs_bitsandbytes
def test_fp32_compute_multiplies_the_same_quantized_weights_in_fp32_and_restores(tmp_path):
    import bitsandbytes as bnb

    model = _built("qlora", "nf4-fp16-mixed", tmp_path).eval()
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    with quantization.fp32_compute(model):
        assert {m.compute_dtype for m in layers} == {torch.float32}
    assert {m.compute_dtype for m in layers} == {torch.float16}


# bitsandbytes >= 0.50 multiplies int8 by int8 on a CPU with torch._int_mm only where torch dispatches
# at AVX512; elsewhere its portable kernel runs inside the forward's fp16 autocast, and the torch
# loop's evaluations of an 8-bit base move off their references (known_failures.toml, this entry;
# docs/upstream-bitsandbytes/cpu_int8_matmul_under_autocast.py)
INT8_UNDER_FP16_AUTOCAST = "bnb-cpu-int8-product-autocast-to-fp16-without-avx512"


def int8_product_rounded_here(hardware: dict) -> bool:
    """Whether the run's CPU took bitsandbytes' portable int8 product (no AVX512 as torch dispatches,
    the facts its report records), where fp16 autocast rounds it."""
    from matrix.catalogue.conditions import Context, lookup

    avx512 = lookup("cpu-avx512").holds(Context(hardware=hardware))
    return not avx512 and Version(quantization.installed_bitsandbytes()) >= Version("0.50")


def out_of_a_row(cell: dict) -> bool:
    """Whether either of a quantized cell's evaluations left its row (the one that failed it)."""
    metrics, allowed = cell["metrics"], lambda tolerance, reference: tolerance["atol"] + tolerance["rtol"] * reference
    if metrics.get("fp32_deviation_abs", 0) > allowed(metrics["fp32_tolerance"], metrics["fp32_reference_loss"]):
        return True
    record = metrics.get("quantized", {})
    return record.get("unquantized_loss") is not None and record["unquantized_deviation_abs"] > allowed(
        record["unquantized_tolerance"], record["unquantized_loss"]
    )


def check_int8_under_fp16_autocast(cells: dict, hardware: dict) -> dict[str, str]:
    """The cells the entry names, by id, with their outcomes. It names only int8 cells whose forward
    autocast to fp16 (the torch loop's, not the Trainer's). Where the product is exact it claims none:
    they pass, "inapplicable" here. Where it rounds, each cell it claims fails an evaluation's row."""
    named = {i: c for i, c in cells.items() if (c.get("known_failure") or {}).get("id") == INT8_UNDER_FP16_AUTOCAST}
    for cell_id, cell in named.items():
        assert cell["precision"] == "int8-fp16-mixed", cell_id
        assert cell["metrics"]["effective"]["autocast_dtype_in_forward"] == "float16", cell_id
    outcomes = {i: c["outcome"] for i, c in named.items()}
    if not int8_product_rounded_here(hardware):
        assert set(outcomes.values()) <= {"inapplicable"}, outcomes
        return outcomes
    assert set(outcomes.values()) <= {"known"}, outcomes  # a claimed cell that passes is passed (may_pass)
    for cell_id, cell in named.items():
        assert cell["phase"] in ("evaluate", "mid_training_eval") and out_of_a_row(cell), cell_id
    return outcomes


AVX2_FACTS = {"cpu_capability": "AVX2"}
AVX512_FACTS = {"cpu_capability": "AVX512"}
INT8_SIGNATURES = {
    "train": "mid_training_eval: matrix.checks.OutOfTolerance: mid-training eval loss <n> is off the fp32 reference "
    "<n> by <n> (allowed: atol <n> + rtol <n> * |reference|) @ matrix.checks:check_within_tolerance",
    "eval": "evaluate: matrix.checks.OutOfTolerance: eval loss against the unquantized model <n> is off the fp32 "
    "reference <n> by <n> (allowed: atol <n> + rtol <n> * |reference|) @ matrix.checks:check_within_tolerance",
}


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize(
    ("hardware", "autocast", "bitsandbytes", "expected"),
    [
        (AVX2_FACTS, "float16", "0.50.2", "known"),  # the portable product, autocast to fp16
        (AVX2_FACTS, "float16", "0.50.0", "known"),
        (AVX512_FACTS, "float16", "0.50.2", "failed"),  # torch._int_mm: exact, so a deviation is news
        (AVX2_FACTS, "bfloat16", "0.50.2", "failed"),  # Lightning's bf16 rounds, never overflows
        (AVX2_FACTS, None, "0.50.2", "failed"),  # accelerate and the Trainer do not autocast on a CPU
        (AVX2_FACTS, "float16", "0.49.2", "failed"),  # torch._int_mm on every CPU before 0.50
    ],
)
def test_the_int8_product_entry_claims_a_deviation_only_where_its_mechanism_is(
    mode, hardware, autocast, bitsandbytes, expected
):
    """The catalogue's entry on the evidence the cells record: the CPU torch dispatches on (the
    report's environment.hardware) and the autocast their forward saw. Holds on any machine: the
    facts are given, not probed."""
    from matrix.catalogue import entries as catalogue
    from matrix.catalogue.conditions import Context

    shipped = catalogue.load()
    entry = shipped.by_id(INT8_UNDER_FP16_AUTOCAST)
    cell = Cell("qlora", "int8-fp16-mixed", mode, "cpu", "torch")
    installed = {"bitsandbytes": bitsandbytes, "torch": "2.13.0"}
    in_force = [e for e in shipped.in_force(cell, installed, Context(hardware=hardware)) if e is entry]
    metrics = {"effective": {"autocast_dtype_in_forward": autocast}}
    outcome, found = catalogue.classify("failed", INT8_SIGNATURES[mode], in_force, metrics)
    assert (outcome, found.id if found else None) == (expected, entry.id if expected == "known" else None)
    # a claimed cell whose deviation stays within its rows (lora's evaluation) is passed, not fixed
    assert catalogue.classify("passed", None, in_force, metrics) == ("passed", None)
    # a CPU entry: a cuda cell takes bitsandbytes' CUDA kernels, whatever the host CPU
    on_gpu = Cell("qlora", "int8-fp16-mixed", mode, "cuda", "torch")
    assert entry not in shipped.in_force(on_gpu, installed, Context(hardware=AVX2_FACTS))


@pytest.mark.parametrize(
    ("hardware", "autocast", "expected"),
    [
        (AVX2_FACTS, "float16", "passed"),  # in force, and lora's evaluation stays within its rows
        (AVX512_FACTS, "float16", "inapplicable"),  # it would claim the cell on a CPU without AVX-512
        (AVX512_FACTS, None, "passed"),  # the Trainer's: not claimed on any CPU, so not inapplicable
        (AVX512_FACTS, "bfloat16", "passed"),
    ],
)
def test_a_passing_int8_cell_is_inapplicable_only_where_the_entry_would_claim_it_elsewhere(
    hardware, autocast, expected
):
    from matrix.catalogue import entries as catalogue
    from matrix.catalogue.conditions import Context

    shipped = catalogue.load()
    entry = shipped.by_id(INT8_UNDER_FP16_AUTOCAST)
    cell = Cell("lora", "int8-fp16-mixed", "eval", "cpu", "torch")
    installed, facts = {"bitsandbytes": "0.50.2", "torch": "2.13.0"}, Context(hardware=hardware)
    in_force = [e for e in shipped.in_force(cell, installed, facts) if e is entry]
    elsewhere = [e for e in shipped.inapplicable(cell, installed, facts) if e is entry]
    metrics = {"effective": {"autocast_dtype_in_forward": autocast}}
    outcome, _ = catalogue.classify("passed", None, in_force, metrics, inapplicable=elsewhere)
    assert outcome == expected


@pytest.fixture(scope="module")
def slice_run(tmp_path_factory, matrix_cpu):
    """The CI slice of the quantized cells: lora and qlora, each quantized precision, through the
    torch loop and the Trainer; with the hardware facts its report records."""
    directory = tmp_path_factory.mktemp("quantized")
    done, cells = matrix_cpu(
        directory,
        "--model",
        "lora,qlora",
        "--precision",
        ",".join(QUANTIZED),
        "--engine",
        "torch,hf-trainer",
    )
    hardware = json.loads((directory / "run" / "results.json").read_text())["environment"]["hardware"]
    return done, cells, hardware


@needs_bitsandbytes
def test_the_quantized_slice_has_no_unexplained_failure(slice_run):
    done, cells, hardware = slice_run
    assert done.returncode == 0, done.stdout[-3000:]
    assert len(cells) == 2 * 3 * 2 * 2
    assert [i for i, c in cells.items() if c["outcome"] in ("failed", "fixed")] == []
    named = check_int8_under_fp16_autocast(cells, hardware)
    torch_training = {"lora-int8-fp16-mixed-train-cpu-torch", "qlora-int8-fp16-mixed-train-cpu-torch"}
    # the torch loop's training cells autocast to fp16: known to fail their evaluation after training
    # where the product rounds, named as inapplicable where it is exact; the Trainer's, never named
    assert {i for i in named if i.endswith("-train-cpu-torch")} == torch_training
    # seed 000's configuration trains and saves on a CPU, every save read back bit for bit
    for engine in ("torch", "hf-trainer"):
        for model in ("lora", "qlora"):
            cell = cells[f"{model}-int8-fp16-mixed-train-cpu-{engine}"]
            if named.get(cell["id"]) == "known":
                continue
            assert cell["outcome"] == ("inapplicable" if cell["id"] in named else "passed"), cell
            record = cell["metrics"]["quantized"]
            assert record["storage"]["storage_dtype"] == "int8"
            assert record["prequantized_reload_max_abs_difference"] == 0.0
            assert record["merged_reload_max_abs_difference"] == 0.0
            assert cell["metrics"]["reload_max_abs_difference"] == 0.0
            assert cell["metrics"]["loss_decrease"]["relative"] > 0


@needs_bitsandbytes
def test_each_quantized_cell_records_both_deviations_within_their_rows(slice_run):
    _, cells, hardware = slice_run
    named = check_int8_under_fp16_autocast(cells, hardware)  # each it claims out of a row, as it fails
    claimed = {i for i, outcome in named.items() if outcome == "known"}
    measured = [c for c in cells.values() if c["metrics"].get("quantized", {}).get("unquantized_loss") is not None]
    assert {c["precision"] for c in measured} == set(QUANTIZED)  # qlora's 4-bit cells evaluate
    for cell in measured:
        metrics = cell["metrics"]
        assert metrics["quantized"]["fp32_reference"].startswith("the same quantized base")
        if cell["id"] in claimed:
            continue
        own, unquantized = metrics["fp32_deviation_abs"], metrics["quantized"]["unquantized_deviation_abs"]
        tolerance = metrics["quantized"]["unquantized_tolerance"]
        assert unquantized <= tolerance["atol"] + tolerance["rtol"] * metrics["quantized"]["unquantized_loss"]
        assert (
            own
            <= metrics["fp32_tolerance"]["atol"] + metrics["fp32_tolerance"]["rtol"] * metrics["fp32_reference_loss"]
        )


@needs_bitsandbytes
def test_a_users_qlora_runs_the_quantized_precisions_with_no_failure_of_the_harness(tmp_path, matrix_cpu):
    done, cells = matrix_cpu(
        tmp_path,
        "-p",
        "user_qlora",
        "--model",
        "user-qlora",
        "--precision",
        ",".join(("fp32", "bf16-mixed", *QUANTIZED)),
        "--engine",
        "torch,hf-trainer",
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert [i for i, c in cells.items() if c["outcome"] in ("failed", "fixed")] == []
    hardware = json.loads((tmp_path / "run" / "results.json").read_text())["environment"]["hardware"]
    named = check_int8_under_fp16_autocast(cells, hardware)
    expected = "known" if int8_product_rounded_here(hardware) else "inapplicable"
    assert named.get("user-qlora-int8-fp16-mixed-train-cpu-torch") == expected
    assert cells["user-qlora-int8-fp16-mixed-train-cpu-hf-trainer"]["outcome"] == "passed"
    assert cells["user-qlora-bf16-mixed-train-cpu-hf-trainer"]["outcome"] == "passed"
    storage = cells["user-qlora-nf4-bf16-mixed-train-cpu-torch"]["metrics"]["quantized"]["storage"]
    assert storage["quantized_layers"] == 14 and storage["storage_dtype"] == "uint8"
    # Qwen2's q/k/v biases are observed (Llama has none), and from bitsandbytes 0.50 a 4-bit
    # layer's forward rewrites its fp32 bias in the compute dtype: the dtype check sees it
    trained = cells["user-qlora-nf4-bf16-mixed-train-cpu-torch"]
    assert "frozen-linear-bias" in trained["metrics"]["kind"]["traits"]
    assert trained["metrics"]["kind"]["observed"]["frozen_linear_biases"] == 6  # q, k, v in 2 layers
    if Version(quantization.installed_bitsandbytes()) >= Version("0.50"):
        assert trained["outcome"] == "known", trained
        assert trained["known_failure"]["id"] == "bnb-linear4bit-casts-its-bias-to-compute-dtype"
        assert trained["signature"]["text"].startswith(
            "train_steps: matrix.checks.DtypeContractBroken: after training: a parameter was torch.float32, "
            "is now torch.bfloat16"
        )


def test_a_view_of_what_a_library_cast_keeps_the_library_dtypes():
    """DeepSpeed casts every floating parameter to its half dtype, over a quantized base too; the
    harness's plain view of its module (libraries/deepspeed.plain_copy) must show that dtype,
    where a copy into a fresh model's own dtypes would show fp32 whatever the library held."""
    source = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)).half()
    into_own = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    into_source = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    assert quantization.copy_float_weights(source, into_own) == []
    assert quantization.copy_float_weights(source, into_source, source_dtypes=True) == []
    assert {p.dtype for p in into_own.parameters()} == {torch.float32}
    assert {p.dtype for p in into_source.parameters()} == {torch.float16}
    assert torch.equal(into_source[0].weight, source[0].weight)
    assert into_source[0].weight.data_ptr() != source[0].weight.data_ptr()  # a copy, not the library's tensor
