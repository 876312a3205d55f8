"""Quantized bases (matrix/quantization.py): the precision rows that declare them, the skips
without bitsandbytes or without adapters to train, the storage check against real bitsandbytes
layers, the checks' own hands off the model they check, and the quantized cells through the
engines (the CI slice), for our kinds and for a user's QLoRA written the usual way
(tests/plugins/user_qlora.py)."""

from pathlib import Path

import pytest
import torch
from packaging.version import Version

from matrix import quantization
from matrix.cell import Cell
from matrix.checks import DtypeContractBroken
from matrix.models import MODELS
from matrix.plugin import skip_reason
from matrix.precisions import PRECISIONS

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
    from matrix.cell_state import CellState
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


@pytest.fixture(scope="module")
def slice_run(tmp_path_factory, matrix_cpu):
    """The CI slice of the quantized cells: lora and qlora, each quantized precision, through the
    torch loop and the Trainer."""
    return matrix_cpu(
        tmp_path_factory.mktemp("quantized"),
        "--model",
        "lora,qlora",
        "--precision",
        ",".join(QUANTIZED),
        "--engine",
        "torch,hf-trainer",
    )


@needs_bitsandbytes
def test_the_quantized_slice_has_no_unexplained_failure(slice_run):
    done, cells = slice_run
    assert done.returncode == 0, done.stdout[-3000:]
    assert len(cells) == 2 * 3 * 2 * 2
    assert [i for i, c in cells.items() if c["outcome"] in ("failed", "fixed")] == []
    # seed 000's configuration trains and saves on a CPU, every save read back bit for bit
    for engine in ("torch", "hf-trainer"):
        for model in ("lora", "qlora"):
            cell = cells[f"{model}-int8-fp16-mixed-train-cpu-{engine}"]
            assert cell["outcome"] == "passed", cell
            record = cell["metrics"]["quantized"]
            assert record["storage"]["storage_dtype"] == "int8"
            assert record["prequantized_reload_max_abs_difference"] == 0.0
            assert record["merged_reload_max_abs_difference"] == 0.0
            assert cell["metrics"]["reload_max_abs_difference"] == 0.0
            assert cell["metrics"]["loss_decrease"]["relative"] > 0


@needs_bitsandbytes
def test_each_quantized_cell_records_both_deviations_within_their_rows(slice_run):
    _, cells = slice_run
    measured = [c for c in cells.values() if c["metrics"].get("quantized", {}).get("unquantized_loss") is not None]
    assert {c["precision"] for c in measured} == set(QUANTIZED)  # qlora's 4-bit cells evaluate
    for cell in measured:
        metrics = cell["metrics"]
        own, unquantized = metrics["fp32_deviation_abs"], metrics["quantized"]["unquantized_deviation_abs"]
        assert metrics["quantized"]["fp32_reference"].startswith("the same quantized base")
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
    assert cells["user-qlora-int8-fp16-mixed-train-cpu-torch"]["outcome"] == "passed"
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
