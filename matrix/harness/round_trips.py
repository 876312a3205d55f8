"""The reload: the export read back by the kind's own loader gives back the dtypes and the outputs
bit for bit, and over a quantized base its two other saves (the pre-quantized base with its
adapters, the merged model) give back what the run evaluated. checkpoint_reload runs these
(matrix/harness/pipeline.py)."""

from __future__ import annotations

import torch

from matrix.checks import assertions as checks
from matrix.checks.tolerances import (
    CHECKPOINT_ROUND_TRIP,
)
from matrix.harness.cell_state import CellState, Saved
from matrix.harness.consensus import agreed
from matrix.harness.measurements import (
    evaluate_in_precision,
)
from matrix.models import declared_dtypes
from matrix.models.observation import observe
from matrix.results.metrics import given


def evaluate_as_run(state: CellState, model):
    """Evaluation of a plain model under the autocast the engine's run really had in its forward
    (observed by the first-forward hook; it can differ from the precision's: on a CPU, accelerate
    and the Trainer run fp16 mixed precision without autocast, Lightning runs 16-mixed as bf16),
    else the precision's own: the saved weights and their reload are evaluated alike, in the way
    the cell already ran."""
    observed = given(state.metrics.effective.autocast_dtype_in_forward, "not observed")
    if observed == "not observed":
        return evaluate_in_precision(state, model)
    model.eval()
    from contextlib import nullcontext

    context = torch.autocast(state.device_type, dtype=getattr(torch, observed)) if observed else nullcontext()
    with state.eval_grad_context(), context:
        return state.kind.evaluate(model, state.batch)


def check_reload(state: CellState, reloaded, saved: Saved) -> None:
    """The kind's plain load of the export reproduces the dtypes and the outputs, bit for bit,
    of what was saved (saved.exported); over a quantized base, its two other saves too."""
    declared = {}
    if state.kind.loaded_in_dtype(state.precision, reloaded=True):  # from_pretrained applies the declarations
        dtype = state.precision.weights_dtype
        patterns = declared_dtypes.fp32_patterns(reloaded, dtype)
        created = declared_dtypes.created_fp32(reloaded, dtype)
        for kind, tensors in (("parameter", reloaded.named_parameters()), ("buffer", reloaded.named_buffers())):
            for name, _ in tensors:
                if reason := declared_dtypes.fp32_reason(name, patterns, created):
                    declared[f"{kind} {name}"] = reason
    checks.check_same_dtypes(checks.tensor_dtypes(saved.exported), reloaded, "after reload", declared)
    checks.check_frozen_kept(observe(state.kind).frozen_parameters, reloaded, "after reload")
    if state.precision.quantization is None:
        outputs = evaluate_as_run(state, reloaded).logits
        state.metrics.reload_max_abs_difference = checks.check_outputs_equal(
            "eval logits", saved.exported_logits, outputs, CHECKPOINT_ROUND_TRIP
        )
        return
    from matrix.precisions.quantization import check_storage

    check_storage(reloaded, state.precision.quantization, "after reload")
    # the adapters as the reloaded model holds them, saved before it is evaluated (an evaluation
    # can change a quantized layer's state on a CPU: bitsandbytes packs its weights there). One
    # rank saves, as transformers does in a group, and checks the other saves; so the ranks'
    # models differ from here on, and they agree on the outcome before going on
    adapters = state.workdir / "quantized-saves" / "adapters"

    def reload_and_saves() -> None:
        if state.group.writes:
            adapters.mkdir(parents=True, exist_ok=True)
            state.kind.save(reloaded, adapters)
        outputs = evaluate_as_run(state, reloaded).logits
        state.metrics.reload_max_abs_difference = checks.check_outputs_equal(
            "eval logits", saved.exported_logits, outputs, CHECKPOINT_ROUND_TRIP
        )
        if state.group.writes:
            check_quantized_saves(state, adapters)

    agreed(state, reload_and_saves)


def check_quantized_saves(state: CellState, adapters) -> None:
    """The two other ways users save a quantized fine-tune, each read back bit for bit: the
    quantized base itself (save_pretrained of the base, as pre-quantized checkpoints are shared)
    with the adapters over it; and the adapters merged into the quantized base, saved and read
    back. Each starts from the adapters `adapters` holds over a base quantized anew, and is
    evaluated before it is saved, as a user evaluates a model before sharing it. Both run; a
    mismatch in the first is raised after the second was measured too."""
    mismatches = []
    for check in (_check_prequantized_save, _check_merged_save):
        try:
            check(state, adapters)
        except checks.CheckpointMismatch as mismatch:  # recorded in the metrics; raised below
            mismatches.append(mismatch)
    if mismatches:
        raise mismatches[0]


def _check_prequantized_save(state: CellState, adapters) -> None:
    from matrix.precisions.quantization import check_storage

    kind, precision, record = state.kind, state.precision, state.metrics.quantized
    directory = adapters.parent / "quantized-base"
    model = kind.load(adapters, precision, state.device, state.workdir)
    before = evaluate_as_run(state, model).logits
    kind.save_quantized_base(model, directory)
    record.prequantized_files = sorted(p.name for p in directory.iterdir())
    again = kind.load_over_quantized_base(directory, adapters, precision, state.device, state.workdir)
    check_storage(again, precision.quantization, "after reading the saved quantized base")
    outputs = evaluate_as_run(state, again).logits
    record.prequantized_reload_max_abs_difference = (outputs.float() - before.float()).abs().max().item()
    checks.check_outputs_equal("eval logits over the saved quantized base", before, outputs, CHECKPOINT_ROUND_TRIP)


def _check_merged_save(state: CellState, adapters) -> None:
    from matrix.precisions.quantization import check_storage

    kind, precision, record = state.kind, state.precision, state.metrics.quantized
    directory = adapters.parent / "merged"
    as_adapters = evaluate_as_run(state, kind.load(adapters, precision, state.device, state.workdir)).logits
    merged = kind.merge_quantized(kind.load(adapters, precision, state.device, state.workdir))
    merged_outputs = evaluate_as_run(state, merged).logits
    record.merged_deviation_max_abs = (merged_outputs.float() - as_adapters.float()).abs().max().item()
    kind.save_merged(merged, directory)
    reread = kind.load_merged(directory, precision, state.device)
    check_storage(reread, precision.quantization, "after reading the saved merged model")
    outputs = evaluate_as_run(state, reread).logits
    record.merged_reload_max_abs_difference = (outputs.float() - merged_outputs.float()).abs().max().item()
    checks.check_outputs_equal("eval logits of the saved merged model", merged_outputs, outputs, CHECKPOINT_ROUND_TRIP)
