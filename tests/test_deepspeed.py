"""The deepspeed-zero0 ... deepspeed-zero3 engines (matrix/engines/deepspeed_zero.py): what each
precision is called in DeepSpeed's config, the skips that name DeepSpeed's own refusal, and the
cells themselves on two gloo ranks, DeepSpeed's checkpoint and resume included. `nox -s deepspeed`
runs this file with deepspeed installed; elsewhere the cell tests skip, naming it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from matrix.devices import DEVICES
from matrix.engines import ENGINES, deepspeed_zero
from matrix.engines.libraries import deepspeed as ds
from matrix.precisions.policies import PRECISIONS

STAGES = deepspeed_zero.STAGES
ENGINE_NAMES = tuple(f"deepspeed-zero{stage}" for stage in STAGES)
TRAINER_ENGINES = ("hf-trainer-zero2", "hf-trainer-zero3")  # the Trainer with a DeepSpeed config
needs_deepspeed = pytest.mark.skipif(
    ds.installed_version() is None,
    reason=f"Requires: [deepspeed] (not installed: {ds.INSTALL_HINT})",
)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize(
    ("precision", "expected"),
    [
        ("fp32", {}),
        ("bf16-mixed", {"bf16": True}),
        ("bf16-loaded-mixed", {"bf16": True}),
        ("fp16-mixed", {"fp16": True}),
        ("fp16-loaded-mixed", {"fp16": True}),
        ("bf16-true", {}),
        ("fp16-true", {}),
        ("bf16-mixed-bf16-reduce", {"bf16": True, "communication_data_type": "bf16"}),
        ("fp16-mixed-fp16-reduce", {"fp16": True, "communication_data_type": "fp16"}),
        ("nf4-bf16-mixed", {"bf16": True}),
        ("int8-fp16-mixed", {"fp16": True}),
    ],
)
def test_each_precision_is_a_deepspeed_config(stage, precision, expected):
    assert ENGINES[f"deepspeed-zero{stage}"].settings(PRECISIONS[precision]) == {"zero_stage": stage, **expected}


def test_accumulated_fp32_gradients_are_not_wired_in():
    reason = ENGINES["deepspeed-zero2"].unsupported_reason(PRECISIONS["bf16-loaded-mixed-fp32-grads"])
    assert reason.startswith("Requires: [micro-batch accumulation and a gradient dtype wired into the deepspeed-zero2")


def test_without_deepspeed_every_cell_skips_naming_it(monkeypatch):
    find_spec = importlib.util.find_spec  # deepspeed made absent where it is installed (matrix/grid/packages.py looks)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, package=None: None if name == "deepspeed" else find_spec(name, package),
    )
    for name in (*ENGINE_NAMES, *TRAINER_ENGINES):
        reason = ENGINES[name].device_skip_reason(DEVICES["cpu"])
        assert reason == "Requires: [deepspeed] (not installed: pip install '.[deepspeed]')"


@needs_deepspeed
def test_a_half_precision_skips_with_deepspeeds_own_words_where_its_accelerator_refuses_it():
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    engine = ENGINES["deepspeed-zero2"]
    cpu = DEVICES["cpu"]
    fp16 = engine.precision_device_skip_reason(PRECISIONS["fp16-mixed"], cpu)
    if CPU_Accelerator().is_fp16_supported():
        assert fp16 is None
    else:
        assert fp16 == (
            "Requires: [fp16 on DeepSpeed's cpu accelerator] (DeepSpeed: Type fp16 is not supported on your device.)"
        )
    assert engine.precision_device_skip_reason(PRECISIONS["bf16-mixed"], cpu) is None  # DeepSpeed's CPU: always
    assert engine.precision_device_skip_reason(PRECISIONS["fp16-true"], cpu) is None  # no fp16 section: no check


@pytest.fixture(scope="module")
def grid(matrix_cpu, tmp_path_factory):
    """tiny-llama (full weights) and lora (a frozen base) through every stage, fp32 and bf16-mixed,
    train and eval: 32 cells on two gloo ranks."""
    selection = ("--model", "tiny-llama,lora", "--precision", "fp32,bf16-mixed", "--engine", ",".join(ENGINE_NAMES))
    return matrix_cpu(tmp_path_factory.mktemp("deepspeed"), *selection)


@needs_deepspeed
def test_the_cells_run_on_deepspeed_and_fail_only_where_the_catalogue_says(grid):
    done, cells = grid
    assert len(cells) == 32, done.stdout[-3000:]
    outcomes = {cell_id: cell["outcome"] for cell_id, cell in cells.items()}
    known = {cell_id: cell["known_failure"]["id"] for cell_id, cell in cells.items() if cell["outcome"] == "known"}
    # ZeRO-1 writes no frozen parameters: lora's consolidated checkpoint lacks its base (DeepSpeed#5439);
    # ZeRO-0's bf16 wrapper steps AdamW at construction, and tiny-llama's 3-step curve leaves the row
    # its family's right engines were measured to (issue 47)
    assert known == {
        **{
            f"lora-{p}-train-cpu-deepspeed-zero1": "deepspeed-zero1-checkpoint-drops-frozen-parameters"
            for p in ("fp32", "bf16-mixed")
        },
        "tiny-llama-bf16-mixed-train-cpu-deepspeed-zero0": "deepspeed-zero0-bf16-adamw-stepped-at-construction",
    }
    assert {o for i, o in outcomes.items() if i not in known} == {"passed"}, outcomes
    assert done.returncode == 0


@needs_deepspeed
@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_is_deepspeeds_own(grid, stage):
    _, cells = grid
    # a cell that ran every phase: at stage 0 tiny-llama's curve stops it in train_steps (test above)
    model = "lora" if stage == 0 else "tiny-llama"
    cell = cells[f"{model}-bf16-mixed-train-cpu-deepspeed-zero{stage}"]
    effective = cell["metrics"]["engine_effective"]
    assert effective["zero_stage"] == stage and effective["bf16_enabled"] is True
    assert effective["basic_optimizer"] == "AdamW"  # torch_adam: torch.optim.AdamW under DeepSpeed's wrapper
    wrapper = {1: "DeepSpeedZeroOptimizer", 2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}
    if stage:
        assert effective["optimizer"] == wrapper[stage]
    assert effective["module_parameter_dtypes"] == ["bfloat16"]  # DeepSpeed's bf16 casts the module
    files = cell["metrics"]["deepspeed_checkpoint_files"]
    # the module's state: written once, or at ZeRO-3 (which partitions it) once per rank
    model_states = [f for f in files if f.endswith("model_states.pt")]
    assert len(model_states) == (2 if stage == 3 else 1), files
    partitions = [f for f in files if "zero_pp_rank_" in f and f.endswith("optim_states.pt")]
    assert len(partitions) == (2 if stage else 0)  # one optimizer partition per rank from ZeRO-1 on
    expected_source = "get_fp32_state_dict_from_zero_checkpoint" if stage else "the module's trained weights"
    assert effective["plain_checkpoint_from"] == expected_source
    assert cell["metrics"]["reload_max_abs_difference"] == 0.0  # the plain checkpoint, from_pretrained
    assert cell["metrics"]["resume_reload_max_abs_difference"] == 0.0  # load_checkpoint into a fresh engine


@needs_deepspeed
def test_every_resume_equals_the_uninterrupted_run_bit_for_bit(grid):
    _, cells = grid
    resumed = [c for c in cells.values() if c["mode"] == "train" and c["outcome"] == "passed"]
    assert len(resumed) == 13
    for cell in resumed:
        record = cell["metrics"]["resume"]
        assert record["judged"] == "bit for bit (cpu steps are deterministic)", cell["id"]
        assert record["optimizer_state_restored"] is True and record["optimizer_state_tensors"] > 0
        assert record["step_losses"] == record["uninterrupted_step_losses"]
        assert record["tensors_compared"] > 0 and record["tensors_differing"] == 0


@needs_deepspeed
def test_a_silently_lost_optimizer_state_fails_every_stage(forgetful_training):
    forgetful_training(ENGINE_NAMES + TRAINER_ENGINES)


@pytest.fixture(scope="module")
def trainer_grid(matrix_cpu, tmp_path_factory):
    """tiny-llama and lora through the Trainer with a ZeRO-2 and a ZeRO-3 config, fp32 and bf16-mixed."""
    selection = ("--model", "tiny-llama,lora", "--precision", "fp32,bf16-mixed", "--engine", ",".join(TRAINER_ENGINES))
    return matrix_cpu(tmp_path_factory.mktemp("trainer-deepspeed"), *selection)


@needs_deepspeed
def test_the_trainer_trains_saves_and_resumes_through_deepspeed(trainer_grid):
    done, cells = trainer_grid
    assert len(cells) == 16, done.stdout[-3000:]
    known = {i: c["known_failure"]["id"] for i, c in cells.items() if c["outcome"] == "known"}
    # transformers refuses to evaluate before training under ZeRO-2, on purpose
    assert known == {
        f"{m}-{p}-eval-cpu-hf-trainer-zero2": "trainer-zero-inference-needs-stage-3"
        for m in ("tiny-llama", "lora")
        for p in ("fp32", "bf16-mixed")
    }
    assert {c["outcome"] for i, c in cells.items() if i not in known} == {"passed"}
    for stage in (2, 3):
        cell = cells[f"tiny-llama-bf16-mixed-train-cpu-hf-trainer-zero{stage}"]
        effective = cell["metrics"]["engine_effective"]
        assert effective["zero_stage"] == stage and effective["bf16_enabled"] is True
        assert effective["config"]["bf16"] == {"enabled": "auto"}  # the Trainer filled it in from --bf16
        assert "global_step3" in cell["metrics"]["checkpoint_files"]  # DeepSpeed's own checkpoint in the Trainer's
        record = cell["metrics"]["resume"]
        assert record["optimizer_state_restored"] is True and record["tensors_differing"] == 0
        assert record["random_numbers"].startswith("the library's own")
        # the first step's loss, rebuilt from the ranks' token-averaged losses, is the torch engine's
        assert cell["metrics"]["cross_engine"]["spread_abs"] < 2e-2


@pytest.fixture(scope="module")
def trainer_shares(matrix_cpu, tmp_path_factory):
    """The Trainer on ZeRO-2 trains tiny-transformer (3 rows: 2 and 1 over the ranks; a forward that
    takes labels and no num_items_in_batch) and tiny-llama (whose loss is counted across the ranks)."""
    selection = ("--model", "tiny-transformer,tiny-llama", "--precision", "fp32", "--mode", "train")
    return matrix_cpu(tmp_path_factory.mktemp("trainer-shares"), *selection, "--engine", "hf-trainer-zero2")


@needs_deepspeed
def test_the_trainer_on_uneven_shares_trains_on_the_mean_of_its_ranks_means(trainer_shares):
    """trainer-averages-rank-means-over-uneven-shares: the curve the Trainer trains is the one of the
    shares' means (taken again below in one process), not the whole batch's,
    and the AdamW probe read when the Trainer built its engine says it had not stepped."""
    import torch

    from matrix.engines.hf_trainer_deepspeed import EACH_RANKS_MEAN, ITEMS_ACROSS_RANKS
    from matrix.models import MODELS
    from matrix.precisions.policies import PRECISIONS

    _, cells = trainer_shares
    uneven = cells["tiny-transformer-fp32-train-cpu-hf-trainer-zero2"]
    counted = cells["tiny-llama-fp32-train-cpu-hf-trainer-zero2"]
    assert uneven["outcome"] == "known", uneven["signature"]
    assert uneven["known_failure"]["id"] == "trainer-averages-rank-means-over-uneven-shares"
    assert uneven["signature"]["exception"] == "matrix.checks.CurveDiverged"
    assert uneven["metrics"]["engine_effective"]["rank_loss_averaging"] == EACH_RANKS_MEAN
    assert uneven["metrics"]["engine_effective"]["loss_items_per_rank"] == [2, 1]
    assert counted["outcome"] == "passed", counted["signature"]
    assert counted["metrics"]["engine_effective"]["rank_loss_averaging"] == ITEMS_ACROSS_RANKS
    for cell in (uneven, counted):
        assert cell["metrics"]["engine_effective"]["optimizer_steps_at_construction"] == 0

    # the same steps in one process, each share's mean loss averaged: the cell's curve
    kind, device = MODELS["tiny-transformer"], torch.device("cpu")
    batch = kind.batch(device)
    split = {key: torch.tensor_split(value, 2) for key, value in batch.items()}  # 2 rows and 1, as the ranks'
    shares = [{key: parts[rank] for key, parts in split.items()} for rank in range(2)]
    curve = uneven["metrics"]["curve"]
    model = kind.build(PRECISIONS["fp32"], device, Path(tempfile.mkdtemp()))
    model.train()
    decayed = {n for n, _ in model.named_parameters() if not (n.endswith("bias") or "norm" in n)}
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decayed]},
        {"params": [p for n, p in model.named_parameters() if n not in decayed], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=uneven["metrics"]["learning_rate"]["value"])
    losses = []
    for _ in curve["losses"]:
        with torch.no_grad():
            losses.append(kind.loss(model, batch).item())
        optimizer.zero_grad()
        (sum(kind.loss(model, share) for share in shares) / len(shares)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    assert losses == pytest.approx(curve["losses"], rel=1e-5)
    assert curve["torch_engine"]["first_step_outside"] == 2  # the whole batch's mean is the torch engine's


@pytest.fixture(scope="module")
def xlm_zero3(matrix_cpu, tmp_path_factory):
    """hf:xlm trained in fp32 on ZeRO-3: its restored run is a second engine in each rank."""
    selection = ("--model", "hf:xlm", "--precision", "fp32", "--mode", "train", "--engine", "deepspeed-zero3")
    return matrix_cpu(tmp_path_factory.mktemp("xlm-zero3"), *selection)


@needs_deepspeed
def test_a_module_shared_by_every_xlm_model_breaks_the_first_engines_trace_once_a_second_is_built(xlm_zero3):
    """xlm-shared-activation-module-zero3-trace: the uninterrupted run's step k+1, after the restored
    run's engine was built, raises in ZeRO-3's parameter coordinator; every earlier phase passed, and
    the observation names the shared module the entry selects by."""
    _, cells = xlm_zero3
    cell = cells["hf:xlm-fp32-train-cpu-deepspeed-zero3"]
    assert cell["outcome"] == "known", cell["signature"]
    assert cell["known_failure"]["id"] == "xlm-shared-activation-module-zero3-trace"
    assert cell["signature"]["text"].startswith("resumed_step: IndexError: pop from an empty deque")
    assert [p for p, outcome in cell["phases"].items() if outcome != "passed"] == ["resumed_step"]
    assert cell["metrics"]["kind"]["observed"]["shared_across_instances"] == ["transformer.ffns.0.act"]


@pytest.fixture(scope="module")
def dbrx_zero3(matrix_cpu, tmp_path_factory):
    """hf:dbrx trained in fp32 on ZeRO-3: its experts call their mlp once per expert reached."""
    selection = ("--model", "hf:dbrx", "--precision", "fp32", "--mode", "train", "--engine", "deepspeed-zero3")
    return matrix_cpu(tmp_path_factory.mktemp("dbrx-zero3"), *selection)


@needs_deepspeed
def test_ranks_that_call_a_module_unequally_abort_in_zero3s_gathers_and_read_known(dbrx_zero3):
    """zero3-gathers-desync-where-module-calls-vary-across-ranks: hf:dbrx's ranks reach 4 and 3 experts
    of their shares, ZeRO-3 gathers the experts' mlp that many times, and gloo aborts the rank on the
    mismatched sizes. The cell names what the rank's runtime printed before it died; the entry claims
    it by the observed trait (tests/test_observation.py: the modules whose calls vary)."""
    _, cells = dbrx_zero3
    cell = cells["hf:dbrx-fp32-train-cpu-deepspeed-zero3"]
    assert cell["outcome"] == "known", cell["signature"]
    assert cell["known_failure"]["id"] == "zero3-gathers-desync-where-module-calls-vary-across-ranks"
    assert cell["signature"]["text"] == "train_steps: rank died: rank <n> died (killed by SIGABRT) @ <rank process>"
    assert "Received data size doesn't match expected size" in cell["message"], cell["message"][:3000]


@needs_deepspeed
def test_the_trainer_on_zero2_skips_every_step_of_non_finite_gradients_and_reads_known(matrix_cpu, tmp_path):
    """hf:gemma3n_text's left padding gives NaN gradients in fp32 (gemma3n-left-padding-zero-magnitude-nan-
    gradients): DeepSpeed skips each of the Trainer's three steps for them, so its weights never move,
    where the deepspeed-zero engines retry and say the steps kept overflowing. Both read known."""
    selection = ("--model", "hf:gemma3n_text", "--precision", "fp32", "--mode", "train")
    _, cells = matrix_cpu(tmp_path, *selection, "--engine", "hf-trainer-zero2")
    cell = cells["hf:gemma3n_text-fp32-train-cpu-hf-trainer-zero2"]
    assert cell["outcome"] == "known", cell["signature"]
    assert cell["known_failure"]["id"] == "gemma3n-left-padding-zero-magnitude-nan-gradients"
    assert cell["signature"]["text"].startswith("train_steps: matrix.checks.ParametersUnchanged")
    assert cell["metrics"]["steps_skipped_by_grad_scaler"] == 3 and cell["metrics"]["optimizer_steps_applied"] == 0


@pytest.fixture(scope="module")
def user_gpt2_trainer_zero2(matrix_cpu, tmp_path_factory):
    """A user's GPT-2 (tests/plugins/user_gpt2.py: dropout on, GPT2LMHeadModel's loss) trained in fp32
    by the Trainer on ZeRO-2: a kind with dropout is compared with dropout off across ranks."""
    selection = ("--model", "user-gpt2", "--precision", "fp32", "--mode", "train", "--engine", "hf-trainer-zero2")
    return matrix_cpu(tmp_path_factory.mktemp("user-gpt2-zero2"), "-p", "user_gpt2", *selection)


@needs_deepspeed
def test_the_dropout_off_comparison_goes_through_the_trainers_own_loss(user_gpt2_trainer_zero2):
    """trainer-num-items-overcounts-unmapped-causal-lm on the Trainer with DeepSpeed, for a kind with
    dropout: the first loss with dropout off is the Trainer's compute_loss with the item count it
    passes (the 38 labels, unshifted), not the model's own mean over its 34 prediction targets. The
    kind's own loss, which this comparison took before, agreed with the torch engine's and read as
    fixed."""
    done, cells = user_gpt2_trainer_zero2
    cell = cells["user-gpt2-fp32-train-cpu-hf-trainer-zero2"]
    assert cell["outcome"] == "known", (cell["signature"], done.stdout[-2000:])
    assert cell["known_failure"]["id"] == "trainer-num-items-overcounts-unmapped-causal-lm"
    compared = cell["metrics"]["cross_engine"]
    assert compared["random_numbers"].startswith("none: dropout off")
    targets = sum(cell["metrics"]["engine_effective"]["loss_items_per_rank"])
    assert targets == 34
    ratio = compared["first_step_loss_dropout_off"] / compared["torch_engine_first_step_loss_dropout_off"]
    assert ratio == pytest.approx(targets / 38, rel=1e-5)  # 38: every label, position 0 of each row counted


@pytest.fixture(scope="module")
def qlora_zero3(matrix_cpu, tmp_path_factory):
    """qlora's nf4 evaluation on ZeRO-3: an evaluation of the 4-bit base, then DeepSpeed's save."""
    report_dir = tmp_path_factory.mktemp("qlora-zero3")
    selection = ("--model", "qlora", "--precision", "nf4-bf16-mixed", "--mode", "eval", "--engine", "deepspeed-zero3")
    _, cells = matrix_cpu(report_dir, *selection)
    return report_dir / "run", cells["qlora-nf4-bf16-mixed-eval-cpu-deepspeed-zero3"]


@needs_deepspeed
@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="Requires: [bitsandbytes]")
def test_a_quantized_zero3_cells_script_fails_where_and_as_the_cell_did(qlora_zero3, tmp_path):
    """The script's checks read a quantized base's weights as the harness does (ds.plain_copy), not
    through state_dict(): on a CPU where bitsandbytes packs 4-bit weights for inference
    (AVX512-BF16), a 4-bit layer's state_dict() undoes the packing, so a script that read the
    weights that way after its evaluation saved a base the cell never saved, got past the
    cell's failure in checkpoint_save (bnb-cpu-packed-4bit-state-dict-under-zero3) and failed in
    checkpoint_reload instead. Where bitsandbytes packs nothing the two agree either way."""
    from matrix.releases.repro.generate import generate

    run_dir, cell = qlora_zero3
    script = tmp_path / "repro.py"
    script.write_text(generate(cell["id"], run_dir))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of this project importable
    done = subprocess.run(
        [sys.executable, str(script), "--json", str(tmp_path / "out.json")],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600,
    )  # fmt: skip
    outcome = json.loads((tmp_path / "out.json").read_text())
    if cell["outcome"] == "passed":
        assert done.returncode == 0 and outcome["failure"] is None, done.stdout[-3000:]
        return
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    name = cell["signature"]["exception"].rsplit(".", 1)[-1]
    assert (outcome["phase"], outcome["failure"]["name"]) == (cell["phase"], name), done.stdout[-3000:]


CLIPPING_OF_A_SCRIPT = """
import json, runpy, sys
import deepspeed.runtime.constants as constants
constants.GRADIENT_CLIPPING_DEFAULT = float(sys.argv[2])  # as an older release's constants.py says
script = runpy.run_path(sys.argv[1], run_name="read-not-run")  # its settings and parts; main not run
print(json.dumps(script["MAX_GRAD_NORM"]))
"""


@needs_deepspeed
@pytest.mark.parametrize(
    "cell", ["tiny-llama-fp32-train-cpu-deepspeed-zero1", "tiny-llama-fp32-train-cpu-hf-trainer-zero2"]
)
def test_a_scripts_torch_loop_clips_as_the_deepspeed_that_runs_it(cell, tmp_path):
    """DeepSpeed clips to its own default where the config names no gradient_clipping: none up to
    0.19.2, 1.0 from 0.19.3. A script written on one release and run on another held DeepSpeed's
    curve to a torch loop clipped as the writer's release clips: fp32 ZeRO-1 on 0.15.4-0.19.0
    read 'CurveDiverged at step 2' where the harness passes. The harness reads the default where
    the cell runs (ds.default_gradient_clipping); the script must too."""
    from matrix.releases.repro.generate import generate

    script = tmp_path / f"{cell}.py"
    script.write_text(generate(cell))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of this project importable
    clipped = {}
    for default in ("0.0", "1.0"):
        done = subprocess.run(
            [sys.executable, "-c", CLIPPING_OF_A_SCRIPT, str(script), default],
            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        clipped[default] = json.loads(done.stdout.strip().splitlines()[-1])
    assert clipped == {"0.0": None, "1.0": 1.0}
    assert ds.default_gradient_clipping() == ENGINES[cell.rsplit("-cpu-", 1)[1]].max_grad_norm


@needs_deepspeed
def test_a_release_row_whose_cell_this_machine_cannot_run_is_not_run_here(monkeypatch):
    """DeepSpeed refuses fp16 on a CPU without fp16 support (this AVX2 machine's does): the matrix skips
    deepspeed-zero0-bf16-adamw-stepped-at-construction's fp16 cell here, so its script on 0.15.4 said
    'Type fp16 is not supported' and its row read 'differs'. The row names the missing capability
    instead; where the accelerator takes fp16 it goes on to run."""
    from matrix.catalogue.entries import load
    from matrix.releases.entry_releases import needs, plan

    entry = next(e for e in load().entries if e.id == "deepspeed-zero0-bf16-adamw-stepped-at-construction")
    baseline = {"torch": "2.13.0", "transformers": "5.24.0", "accelerate": "1.15.0", "deepspeed": "0.19.8"}

    def row():
        (made,) = [r for r in plan([entry], {"deepspeed": ["0.15.4", "0.19.8"]}) if r["release"] == "0.15.4"]
        return made

    said = "Requires: [fp16 on DeepSpeed's cpu accelerator] (DeepSpeed: Type fp16 is not supported on your device.)"
    monkeypatch.setattr(ds, "accelerator_refusal", lambda device, dtype: said if dtype == "fp16" else None)
    reason = needs(entry, row(), baseline, {"deepspeed": ["0.15.4", "0.19.8"]})
    assert reason == f"needs what the matrix skips the cell for on this machine: {said}"
    monkeypatch.setattr(ds, "accelerator_refusal", lambda device, dtype: None)
    assert needs(entry, row(), baseline, {"deepspeed": ["0.15.4", "0.19.8"]}) is None


@needs_deepspeed
@pytest.mark.parametrize("onednn_fp16", [False, True])
def test_zero0_reduces_float16_gradients_only_where_onednn_computes_float16(onednn_fp16, tmp_path):
    """DeepSpeed's CPU accelerator lists float16 among the dtypes its ZeRO-0 engine all-reduces only
    where oneDNN computes it (deepspeed-cpu-reduces-no-fp16-gradient-without-onednn-fp16). oneDNN's
    answer emulated both ways (tests/cpu_emulation, in the ranks too), whatever this CPU has: without
    it fp16-true training stops at the reduction, the hardware fact says why and the entry claims it;
    with it the gradients are reduced and the cell goes on, to fp16 AdamW's own failure."""
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env.update(PYTHONPATH=str(root / "tests" / "cpu_emulation"), MATRIX_EMULATE_ONEDNN_FP16=str(int(onednn_fp16)))
    selection = ["--model", "tiny-transformer", "--precision", "fp16-true", "--mode", "train", "--device", "cpu"]
    command = [sys.executable, "-m", "matrix", "run", "cases", *selection, "--engine", "deepspeed-zero0"]
    command += ["--report-dir", str(tmp_path), "--run-id", "onednn"]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    document = json.loads((tmp_path / "onednn" / "results.json").read_text())
    assert document["environment"]["hardware"]["cpu_onednn_fp16"] is onednn_fp16
    (cell,) = document["cells"]
    signature = cell["signature"]["text"]
    assert cell["outcome"] == "known", (signature, done.stdout[-2000:])
    if onednn_fp16:
        assert "unsupported grad type" not in signature
        assert cell["known_failure"]["id"] == "adamw-fp16-eps-underflow", signature
    else:
        refusal = "train_steps: AssertionError: attempting to reduce an unsupported grad type: torch.float16"
        assert signature.startswith(refusal), signature
        assert cell["known_failure"]["id"] == "deepspeed-cpu-reduces-no-fp16-gradient-without-onednn-fp16"
    assert done.returncode == 0
