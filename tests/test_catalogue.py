"""The known-failure catalogue: parsing (with errors that name file and field), selectors,
version specifiers, classification, and the outcomes a real run gets from it."""

import json
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from matrix.catalogue import entries as catalogue
from matrix.devices import fingerprint as environment
from matrix.execute.cell_run import run_cell
from matrix.grid.cell import Cell
from matrix.models import MODELS
from matrix.models.tiny_transformer import TinyTransformer

ENTRY = """
[[entry]]
id = "demo"
title = "demo entry"
kind = "bug"
upstream = ["pytorch/pytorch#1"]
signature = 'RuntimeError: expected scalar type Float but found (BFloat16|Half)'
cells = [{ model = ["tiny-transformer"], precision = ["bf16-mixed", "fp16-mixed"], device = ["cpu"] }]
versions = { torch = ">=2.3,<3" }
workaround = "none"
"""


def test_the_shipped_catalogue_parses_and_every_entry_is_complete():
    shipped = catalogue.load()
    assert len(shipped.entries) >= 6
    for entry in shipped.entries:
        assert entry.kind in catalogue.KINDS and entry.title and entry.workaround and entry.selectors


@pytest.mark.parametrize(
    ("cell", "selected"),
    [
        (Cell("tiny-transformer", "bf16-mixed", "eval", "cpu", "torch"), True),
        (Cell("tiny-transformer", "fp16-mixed", "train", "cpu", "lightning"), True),
        (Cell("tiny-transformer", "bf16-mixed", "eval", "cuda", "torch"), False),  # device not selected
        (Cell("tiny-llama", "bf16-mixed", "eval", "cpu", "torch"), False),  # model not selected
        (Cell("tiny-transformer", "fp32", "eval", "cpu", "torch"), False),  # precision not selected
    ],
)
def test_selectors_match_axes_and_leave_out_axes_open(cell, selected):
    (entry,) = catalogue.parse(ENTRY).entries
    assert entry.selects(cell) is selected


EXCEPT_ENTRY = ENTRY.replace('device = ["cpu"] }', 'not_engine = ["deepspeed-zero1", "deepspeed-zero2"] }')


@pytest.mark.parametrize(
    ("engine", "selected"),
    [("torch", True), ("deepspeed-zero0", True), ("deepspeed-zero1", False), ("deepspeed-zero2", False)],
)
def test_a_not_selector_matches_every_value_of_its_axis_but_those_it_names(engine, selected):
    (entry,) = catalogue.parse(EXCEPT_ENTRY).entries
    assert entry.selects(Cell("tiny-transformer", "bf16-mixed", "eval", "cuda", engine)) is selected


def test_a_not_selector_names_a_real_axis_and_real_values(tmp_path):
    with pytest.raises(catalogue.CatalogueError, match=r"names unknown axis 'not_gpu'"):
        catalogue.parse(ENTRY.replace('device = ["cpu"]', 'not_gpu = ["a100"]'))
    with pytest.raises(catalogue.CatalogueError, match=r"cells\[0\]\.not_engine has unknown value 'deepspeed'"):
        catalogue.parse(ENTRY.replace('device = ["cpu"]', 'not_engine = ["deepspeed"]'))
    with pytest.raises(catalogue.CatalogueError, match=r"names unknown axis 'not_trait'"):
        catalogue.parse(ENTRY.replace('device = ["cpu"]', 'not_trait = ["adapters"]'))


@pytest.mark.parametrize(
    ("installed", "holds"),
    [
        ({"torch": "2.13.0+cpu"}, True),  # local version labels count as the release
        ({"torch": "2.3.0"}, True),
        ({"torch": "2.2.2"}, False),
        ({"torch": "3.0.0"}, False),
        ({"torch": None}, False),  # not installed: not in force
        ({}, False),
    ],
)
def test_versions_are_pep440_specifiers_against_installed_versions(installed, holds):
    (entry,) = catalogue.parse(ENTRY).entries
    assert entry.versions_hold(installed) is holds


SIG = "evaluate: RuntimeError: expected scalar type Float but found BFloat16 @ torch.nn.modules.transformer:forward"


def test_classification():
    (entry,) = catalogue.parse(ENTRY).entries
    assert catalogue.classify("failed", SIG, [entry]) == ("known", entry)
    assert catalogue.classify("failed", "evaluate: ValueError: other @ x:y", [entry]) == ("failed", None)
    assert catalogue.classify("failed", SIG, []) == ("failed", None)
    assert catalogue.classify("passed", None, [entry]) == ("fixed", entry)
    assert catalogue.classify("passed", None, []) == ("passed", None)


@given(st.sampled_from(["BFloat16", "Half"]), st.sampled_from(["evaluate", "mid_training_eval"]))
def test_a_pattern_matches_its_whole_family_of_signatures(dtype, phase):
    (entry,) = catalogue.parse(ENTRY).entries
    assert entry.matches(f"{phase}: RuntimeError: expected scalar type Float but found {dtype} @ torch.x:forward")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ('versions = { torch = ">=2.3,<3" }', 'versions = { torch = "newest" }'),
            "versions.torch is not a PEP 440 specifier",
        ),
        (('device = ["cpu"]', 'device = ["tpu"]'), "cells[0].device has unknown value 'tpu'"),
        (('device = ["cpu"]', 'gpu = ["cpu"]'), "cells[0] names unknown axis 'gpu'"),
        (('kind = "bug"', 'kind = "feature"'), "field 'kind' is 'feature'"),
        (('workaround = "none"', ""), "missing field 'workaround'"),
        (('"pytorch/pytorch#1"', '"pytorch issue 1"'), "expected owner/repo#number"),
        (("(BFloat16|Half)", "(BFloat16|Half"), "field 'signature' is not a regular expression"),
        (("[[entry]]", "[[entry]"), "not valid TOML"),
        (("[[entry]]", "[entry]"), "entry: must be an array of tables"),
        (('model = ["tiny-transformer"]', 'model = ["gpt"]'), "cells[0].model has unknown value 'gpt'"),
    ],
)
def test_a_malformed_catalogue_names_the_file_and_the_field(change, message, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(ENTRY.replace(*change))
    with pytest.raises(catalogue.CatalogueError) as info:
        catalogue.load(path)
    assert str(info.value).startswith(str(path))
    assert message in str(info.value)


def test_known_fixed_and_new_failures_in_a_real_run(run_pytest, tmp_path):
    path = tmp_path / "catalogue.toml"
    path.write_text(
        textwrap.dedent(
            """
            [[entry]]
            id = "broken-backward"
            title = "custom Function multiplies half grads with fp32 weights"
            kind = "bug"
            signature = 'train_steps: RuntimeError: expected m1 and m2 .*c10::BFloat16 != float'
            cells = [{ model = ["broken-matmul"], precision = ["bf16-mixed"] }]
            workaround = "torch.amp.custom_fwd/custom_bwd"

            [[entry]]
            id = "claims-fp32-fails"
            title = "an entry that is too wide"
            kind = "bug"
            signature = 'anything'
            cells = [{ model = ["broken-matmul"], precision = ["fp32"] }]
            workaround = "narrow me"
            """
        )
    )
    args = (
        "-p",
        "broken_models",
        "--engine",
        "torch",
        "--model",
        "broken-matmul",
        "--mode",
        "train",
        "--precision",
        "fp32,bf16-mixed,fp16-mixed",
        "--device",
        "cpu",
        "--catalogue",
        str(path),
    )
    done = run_pytest(*args)
    results = json.loads((tmp_path / "reports" / "latest" / "results.json").read_text())
    outcomes = {c["precision"]: (c["outcome"], (c["known_failure"] or {}).get("id")) for c in results["cells"]}
    assert outcomes == {
        "bf16-mixed": ("known", "broken-backward"),
        "fp32": ("fixed", "claims-fp32-fails"),
        "fp16-mixed": ("failed", None),  # the same bug in fp16: no entry says so, so it is new
    }
    assert done.returncode == 1  # the new failure
    assert "1 xfailed" in done.stdout and "1 xpassed" in done.stdout
    summary = (tmp_path / "reports" / "latest" / "summary.md").read_text()
    assert "**1 failure not in the catalogue, 1 fixed, 1 known failure," in summary
    fixed = summary.split("## Fixed")[1].split("##")[0]
    assert "- entry `claims-fp32-fails`: **1 cell**" in fixed and "`broken-matmul-fp32-train-cpu-torch`" in fixed

    strict = run_pytest(*args, "--precision", "fp32,bf16-mixed", "--strict-known", report_dir=tmp_path / "strict")
    assert strict.returncode == 1 and "XPASS(strict)" in strict.stdout
    relaxed = run_pytest(*args, "--precision", "fp32,bf16-mixed", report_dir=tmp_path / "relaxed")
    assert relaxed.returncode == 0, relaxed.stdout[-2000:]  # known and fixed alone do not fail a run


def test_a_malformed_catalogue_is_a_usage_error(run_pytest, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(ENTRY.replace('device = ["cpu"]', 'device = ["tpu"]'))
    done = run_pytest("--catalogue", str(path), "--collect-only", "-q")
    assert done.returncode == 4
    assert f"--catalogue: {path}: entry 'demo': cells[0].device has unknown value 'tpu'" in done.stderr
    assert "Traceback" not in done.stderr


TRAIT_ENTRY = ENTRY.replace('model = ["tiny-transformer"], ', 'trait = ["full-weights"], ')


def test_a_trait_selector_matches_the_kinds_that_declare_the_trait():
    (entry,) = catalogue.parse(TRAIT_ENTRY).entries
    cell = Cell("a-users-model", "bf16-mixed", "eval", "cpu", "torch")
    assert entry.selects(cell, traits=frozenset({"full-weights"}))
    assert not entry.selects(cell, traits=frozenset({"adapters"}))
    assert not entry.selects(cell)  # no kind is registered under that name: it has no traits
    assert entry.selects(Cell("tiny-llama", "bf16-mixed", "eval", "cpu", "torch"))  # observed on the built model
    assert not entry.selects(Cell("lora", "bf16-mixed", "eval", "cpu", "torch"))


@pytest.mark.parametrize(
    ("model", "selected"),
    [
        ("tiny-llama", True),
        ("lora", True),  # PeftModel's forward passes the count on to LlamaForCausalLM's loss
        ("hf:gpt_neox", True),  # docs/entry-releases.md's "differs" row at transformers 5.0.0
        ("hf:mbart", False),  # its loss ignores the count: trainer-scales-a-loss-that-ignores-num-items
        ("tiny-transformer", False),  # no transformers loss for the Trainer's count to reach
    ],
)
def test_the_trainers_over_count_is_known_by_its_mechanism_on_any_causal_lm(model, selected):
    """trainer-num-items-overcounts-causal-lm selects by next-token-loss-takes-num-items, not by a
    list of kinds: on transformers 5.9.0 the Trainer's first-step loss of lora, qlora, hf:gpt_neox and
    hf:olmo2 is the same 14/15-style fraction of the torch engine's as tiny-llama's, and read as new."""
    entry = catalogue.load().by_id("trainer-num-items-overcounts-causal-lm")
    assert entry.selects(Cell(model, "fp32", "train", "cpu", "hf-trainer")) is selected
    assert not entry.selects(Cell(model, "fp32", "train", "cpu", "accelerate"))
    assert entry.versions_hold({"transformers": "5.9.0"}) and not entry.versions_hold({"transformers": "5.10.1"})


def test_an_unknown_trait_is_refused_naming_the_known_ones(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(TRAIT_ENTRY.replace('"full-weights"', '"big"'))
    with pytest.raises(catalogue.CatalogueError, match=r"cells\[0\]\.trait has unknown value 'big'"):
        catalogue.load(path)


@pytest.mark.parametrize(
    ("cell", "entry_id"),
    [
        # the first GPU run (docs/gpu-runs/h100-2026-11-22): fp16-true train NaN in every engine on cuda
        (Cell("tiny-llama", "fp16-true", "train", "cuda", "hf-trainer"), "adamw-fp16-eps-underflow"),
        (Cell("gemma-cache", "fp16-true", "train", "cuda", "accelerate"), "adamw-fp16-eps-underflow"),
        (Cell("lora", "fp16-true", "train", "cuda", "lightning"), "adamw-fp16-eps-underflow"),
        # and on cuda the libraries really scale fp16: the GradScaler refuses fp16 gradients
        (
            Cell("tiny-transformer", "fp16-loaded-mixed", "train", "cuda", "accelerate"),
            "gradscaler-refuses-fp16-gradients",
        ),
        (Cell("tiny-llama", "fp16-loaded-mixed", "train", "cuda", "lightning"), "gradscaler-refuses-fp16-gradients"),
        # on a CPU they do not: the same cells hit AdamW's fp16 eps instead
        (Cell("tiny-llama", "fp16-loaded-mixed", "train", "cpu", "accelerate"), "adamw-fp16-eps-underflow"),
    ],
)
def test_the_shipped_catalogue_covers_the_cuda_evidence(cell, entry_id):
    in_force = catalogue.load().in_force(cell, environment.package_versions())
    assert entry_id in [e.id for e in in_force]


@pytest.mark.parametrize(
    "cell",
    [
        Cell("lora", "fp16-true", "train", "cuda", "torch"),  # fp32 adapters train: no NaN (cpu and cuda alike)
        Cell("lora", "fp16-loaded-mixed", "train", "cuda", "accelerate"),
        Cell("tiny-llama", "fp16-loaded-mixed", "train", "cpu", "hf-trainer"),  # no scaler on a CPU
    ],
)
def test_the_cuda_scope_claims_no_more_than_the_evidence(cell):
    in_force = {e.id for e in catalogue.load().in_force(cell, environment.package_versions())}
    assert "gradscaler-refuses-fp16-gradients" not in in_force
    if cell.model == "lora":
        assert "adamw-fp16-eps-underflow" not in in_force


class UsersEncoder(TinyTransformer):
    """A user's own kind: nothing in the catalogue names it."""

    name = "users-encoder"


class UsersAdapterEncoder(UsersEncoder):
    name = "users-adapter-encoder"
    traits = frozenset({"adapters"})


@pytest.mark.parametrize(("kind", "expected"), [(UsersEncoder(), "known"), (UsersAdapterEncoder(), "failed")])
def test_a_users_model_gets_the_known_class_its_trait_says(kind, expected, monkeypatch, tmp_path, registered):
    registered(MODELS, kind)
    cell = Cell(kind.name, "fp16-true", "train", "cpu", "torch")
    result = run_cell(cell, tmp_path)
    assert result.signature.text == (
        "train_steps: matrix.checks.NonFiniteValue: parameters are not finite after the optimizer step "
        "@ matrix.checks:check_finite_parameters"
    )
    in_force = catalogue.load().in_force(cell, environment.package_versions())
    outcome, entry = catalogue.classify(result.outcome, result.signature.text, in_force)
    assert outcome == expected  # an adapter model whose adapters went NaN anyway is news
    assert (entry.id if entry else None) == ("adamw-fp16-eps-underflow" if expected == "known" else None)


@pytest.mark.parametrize(
    ("precision", "engine", "entry_id"),
    [
        ("fp16-loaded-mixed", "torch", "gradscaler-refuses-fp16-gradients"),
        ("fp16-loaded-mixed", "lightning", "lightning-cpu-bf16-autocast-over-fp16-weights"),
    ],
)
def test_the_other_known_classes_reach_a_users_model_by_trait(
    precision, engine, entry_id, monkeypatch, tmp_path, registered
):
    """A user's encoder (full weights, torch LayerNorm) gets the GradScaler rule and Lightning's
    CPU LayerNorm failure as known, as the built-in encoder does, without being named."""
    kind = UsersEncoder()
    registered(MODELS, kind)
    cell = Cell(kind.name, precision, "train", "cpu", engine)
    result = run_cell(cell, tmp_path)
    in_force = catalogue.load().in_force(cell, environment.package_versions())
    outcome, entry = catalogue.classify(result.outcome, result.signature.text if result.signature else None, in_force)
    assert (outcome, entry.id if entry else None) == ("known", entry_id), result.message


def test_an_entry_that_only_a_long_curve_shows_is_in_force_only_in_runs_that_long(monkeypatch):
    """min_curve_steps: a failure the default 3-step curve cannot show (DeepSpeed ZeRO-0's AdamW
    stepped at construction leaves tiny-llama's curve at step 4) is neither expected nor called
    fixed in a run of 3 steps, and is known in a run of 8."""
    from matrix.grid import schedule

    (entry,) = catalogue.parse(ENTRY.replace('kind = "bug"', 'kind = "bug"\nmin_curve_steps = 4')).entries
    cell = Cell("tiny-transformer", "bf16-mixed", "eval", "cpu", "torch")
    found = catalogue.Catalogue([entry])
    monkeypatch.delenv(schedule.CURVE_STEPS_VARIABLE, raising=False)
    assert [str(r) for r in entry.when] == ["curve-steps-at-least-4"] and found.in_force(
        cell, {"torch": "2.13.0"}
    ) == []
    monkeypatch.setenv(schedule.CURVE_STEPS_VARIABLE, "8")
    assert found.in_force(cell, {"torch": "2.13.0"}) == [entry]
    with pytest.raises(catalogue.CatalogueError, match="field 'min_curve_steps' must be a whole number"):
        catalogue.parse(ENTRY.replace('kind = "bug"', 'kind = "bug"\nmin_curve_steps = "4"'))


@pytest.mark.parametrize(
    ("cell", "signature_text", "entry_id"),
    [
        # the H100 run of 2026-11-27 (docs/gpu-runs/h100-2026-11-27), triaged in issue 47
        (
            Cell("tiny-llama", "float8-rowwise", "train", "cuda", "ddp-compile"),
            "train_steps: torch._dynamo.exc.BackendCompilerFailed: backend='compile_fn' raised: RuntimeError: "
            "Expected self.size(<n>) to be divisible by <n>, but got self.size(<n>)=<n> Set TORCHDYNAMO_VERBOSE=<n> "
            "@ torch:_check_with",
            "torchao-float8-inner-dims-multiple-of-16",
        ),
        (
            Cell("gemma-cache", "fp16-mixed", "eval", "cuda", "accelerate-fsdp2"),
            "checkpoint_save: AssertionError: Attempted step but _scale is None. This may indicate your script did "
            "not use scaler.scale(loss or outputs) earlier in the iteration. @ torch.amp.grad_scaler:"
            "_check_scale_growth_tracker",
            "accelerate-fsdp2-checkpoint-steps-through-grad-scaler",
        ),
        (
            Cell("tiny-llama", "fp16-mixed", "train", "cuda", "accelerate-fsdp2"),
            "resumed_step: matrix.checks.CheckpointMismatch: grad scaler state differs after reload @ "
            "matrix.resume:check_restored",
            "accelerate-fsdp2-checkpoint-steps-through-grad-scaler",
        ),
        *[
            (
                Cell(model, precision, "train", "cuda", engine),
                "checkpoint_reload: matrix.checks.CheckpointMismatch: eval logits of the saved merged model differ "
                "after reload @ matrix.checks:check_outputs_equal",
                "transformers-prequantized-reload-casts-saved-fp32-tensors",
            )
            for model, precision, engine in [
                ("lora", "int8-fp16-mixed", "torch"),
                ("qlora", "nf4-bf16-mixed", "lightning"),
                ("lora", "nf4-fp16-mixed", "hf-trainer"),
            ]
        ],
    ],
)
def test_the_cuda_findings_of_the_h100_run_are_claimed_by_their_entries(cell, signature_text, entry_id):
    """The signatures that run recorded as new, as written there, each matched and selected by the
    entry issue 47 triaged it into (the selection by cell, whatever the installed versions)."""
    entry = catalogue.load().by_id(entry_id)
    assert entry.selects(cell) and entry.matches(signature_text)
    # and the CPU twin of the cell is not claimed: accelerate makes no GradScaler there
    if entry_id.startswith("accelerate-fsdp2"):
        assert not entry.selects(Cell(cell.model, cell.precision, cell.mode, "cpu", cell.engine))


def test_the_merged_save_entry_is_in_force_on_the_releases_that_cast_and_not_after():
    """transformers 5.17.0 to 5.20.2 cast a pre-quantized checkpoint's saved fp32 tensors on reload
    (run on the CPU and the H100); 5.21.0 keeps them: the entry names exactly those releases."""
    entry = catalogue.load().by_id("transformers-prequantized-reload-casts-saved-fp32-tensors")
    assert entry.versions_hold({"transformers": "5.17.0"}) and entry.versions_hold({"transformers": "5.20.2"})
    assert not entry.versions_hold({"transformers": "5.21.0"}) and not entry.versions_hold({"transformers": "5.24.0"})


def test_the_h100_run_of_stop_54_is_explained_by_the_catalogue_on_its_own_stack():
    """Run N of docs/gpu-runs/h100-2026-11-27-stop54 (torch 2.11.0+cu130, one rank): judged now by
    the built-in catalogue, on the versions and hardware the run recorded, every failed cell is
    known (its 16 new cells then: accelerate-fsdp2's fp16-loaded-mixed scaler, FSDP2's integer
    parameters) and no cell is fixed. Run B, the code before the package's folders, gave the same
    outcome and signature id in each of the 658 cells that ran."""
    import gzip

    from matrix.catalogue.conditions import Context

    runs = Path(__file__).resolve().parent.parent / "docs" / "gpu-runs" / "h100-2026-11-27-stop54"
    documents = {run: json.loads(gzip.decompress((runs / run / "results.json.gz").read_bytes())) for run in "NB"}
    known = catalogue.load()
    recorded = documents["N"]["environment"]
    installed = {
        name: info.get("version") if isinstance(info, dict) else info for name, info in recorded["packages"].items()
    }
    context = Context(hardware=recorded["hardware"], run={"train_steps": documents["N"]["run"]["curve_steps"]})
    verdicts = Counter()
    for record in documents["N"]["cells"]:
        if record["outcome"] in ("skipped", "not applicable"):
            continue
        cell = Cell(record["model"], record["precision"], record["mode"], record["device"], record["engine"])
        outcome = "failed" if record["outcome"] in ("failed", "known") else "passed"
        text = (record.get("signature") or {}).get("text")
        verdict, entry = catalogue.classify(
            outcome,
            text,
            known.in_force(cell, installed, context),
            record["metrics"],
            known.inapplicable(cell, installed, context),
        )
        verdicts[verdict] += 1
        assert verdict not in ("failed", "fixed"), (record["id"], verdict, text, entry and entry.id)
    assert verdicts["known"] == 230 and sum(verdicts.values()) == 658, verdicts
    before = {c["id"]: (c["outcome"], (c.get("signature") or {}).get("id")) for c in documents["B"]["cells"]}
    now = {c["id"]: (c["outcome"], (c.get("signature") or {}).get("id")) for c in documents["N"]["cells"]}
    assert before == now
