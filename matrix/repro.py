"""Standalone reproduction scripts: `python -m matrix repro <cell-id> [--run reports/<run-id>]`.

The script imports only the upstream libraries (torch, transformers, peft, safetensors), with
the model config, the batch, the precision's settings and the phases up to the failing one
written out, and the pins of the run in its docstring. It exits 1 and prints the exception
when the bug is present, 0 when every phase completes.

Written so far for the torch engine (the hand-written loop, which is plain torch already) and
for failures the stack raises; a failure found by one of the matrix's own checks
(matrix.checks.*) has no exception of the stack's to reproduce.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from matrix.environment import package_versions
from matrix.kind_traits import kind_learning_rate
from matrix.models import MODELS, ModelKind
from matrix.packages import PINNED_IN_REPRO
from matrix.pipeline import PHASE_NAMES
from matrix.precisions import PRECISIONS
from matrix.results.metrics import CellMetrics
from matrix.schedule import MAX_STEP_ATTEMPTS, train_steps
from matrix.selection import cell_from_id
from matrix.variants import InvalidVariant
from matrix.variants import from_json as variant_from_json


class ReproError(ValueError):
    """This cell cannot be written as a standalone script (yet): one line, exit status 2."""


def _dtype(dtype: torch.dtype | None) -> str:
    return f"torch.{str(dtype).removeprefix('torch.')}" if dtype is not None else "None"


def _batch_literal(kind: ModelKind) -> str:
    batch = kind.batch(torch.device("cpu"))
    lines = ["BATCH = {"]
    for key, tensor in batch.items():
        lines.append(f"    {key!r}: torch.tensor({tensor.tolist()!r}, dtype={_dtype(tensor.dtype)}).to(DEVICE),")
    lines.append("}")
    return "\n".join(lines)


PHASES = """
WEIGHTS_DTYPE = {weights}
AUTOCAST_DTYPE = {autocast}
GRAD_SCALER = {scaler}
WEIGHTS_FROM = {weights_from!r}  # "cast": module.to(dtype); "load": from_pretrained(dtype=...) of fp32 weights
DEVICE = {device!r}
WORKDIR = tempfile.mkdtemp()


def autocast():
    if AUTOCAST_DTYPE is None:
        return contextlib.nullcontext()
    return torch.autocast(DEVICE, dtype=AUTOCAST_DTYPE)


def build():
    torch.manual_seed(0)
    model = create()
    if WEIGHTS_FROM == "load":
        os.makedirs(WORKDIR + "/fp32", exist_ok=True)
        save(model, WORKDIR + "/fp32")
        return load_weights(WORKDIR + "/fp32", WEIGHTS_DTYPE).to(DEVICE)
    return model.to(device=DEVICE, dtype=WEIGHTS_DTYPE)


def reload(directory):
    return load_weights(directory, WEIGHTS_DTYPE).to(DEVICE)


def train_steps(state):
    model = state["model"] = build()
    model.train()
    optimizer = state["optimizer"] = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr={lr})
    scaler = state["scaler"] = torch.amp.GradScaler(DEVICE) if GRAD_SCALER else None
    applied = attempts = 0
    while applied < {steps} and attempts < {attempts}:
        attempts += 1
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_of(model, BATCH)
        if scaler is None:
            loss.backward()
            optimizer.step()
            applied += 1
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            applied += scaler.get_scale() >= scale


def evaluate_now(state):
    model = state["model"]
    model.eval()
    with torch.no_grad(), autocast():
        return evaluate_model(model, BATCH)


def mid_training_eval(state):
    evaluate_now(state)
    state["model"].train()


def checkpoint_save(state):
    os.makedirs(WORKDIR + "/checkpoint", exist_ok=True)
    save(state["model"], WORKDIR + "/checkpoint")


def checkpoint_reload(state):
    state["model"] = reload(WORKDIR + "/checkpoint")
"""

MAIN = """

def main():
    state = {{}}
    for phase in {phases}:
        print("phase", phase.__name__, flush=True)
        try:
            phase(state)
        except Exception as exc:
            traceback.print_exc()
            print(f"REPRODUCED in {{phase.__name__}}: {{type(exc).__name__}}: {{exc}}")
            return 1
    print("not reproduced: every phase completed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
"""


def learning_rate_of(kind, record: dict | None) -> float:
    """The rate the cell trained at: as its run recorded it, else the kind's (declared or
    calibrated, matrix/learning_rate.py)."""
    recorded = CellMetrics.from_dict((record or {}).get("metrics") or {}).learning_rate
    return recorded.value if recorded else kind_learning_rate(kind).value


def generate(cell_id: str, run: Path | None = None, variant: str | None = None) -> str:
    """The script for a cell; `variant` (JSON, as an exploration records it) changes its settings."""
    cell = cell_from_id(cell_id)
    if cell is None:
        raise ReproError(f"no cell {cell_id!r} (ids look like tiny-transformer-bf16-mixed-eval-cpu-torch)")
    if cell.engine != "torch":
        raise ReproError(f"{cell_id}: only torch-engine cells are written as standalone scripts so far")
    kind = MODELS[cell.model]
    if variant is not None:
        try:
            kind = kind.with_variant(variant_from_json(variant, kind.grid_variant))
        except (InvalidVariant, ValueError) as error:
            raise ReproError(f"--variant: {error}") from None
    unsupported = [
        name
        for name, value in (
            ("grad_accumulation", kind.variant.grad_accumulation),
            ("eval_grad_mode", kind.variant.eval_grad_mode),
        )
        if value not in (None, 1, "no_grad")
    ]
    if unsupported:
        raise ReproError(f"--variant: {', '.join(unsupported)} are not written into standalone scripts yet")
    precision = PRECISIONS[cell.precision]
    if precision.contradictions():
        raise ReproError(f"{cell_id}: precision {precision.name!r} fails in the matrix's own policy check")
    versions, record = package_versions(), None
    if run is not None:
        path = run / "results.json" if run.is_dir() else run
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ReproError(f"--run: cannot read {path}: {error}") from None
        versions = document.get("environment", {}).get("packages", versions)
        record = next((c for c in document.get("cells", []) if c.get("id") == cell_id), None)
        if record is None:
            raise ReproError(f"--run: {path} has no cell {cell_id!r}")
    phase = record["phase"] if record and record.get("phase") else None
    if record and record["signature"] and record["signature"]["exception"].startswith("matrix."):
        raise ReproError(
            f"{cell_id}: failed a matrix check ({record['signature']['exception']}), not a stack exception"
        )
    names = PHASE_NAMES[cell.mode]
    wanted = list(names[: names.index(phase) + 1]) if phase in names else list(names)
    runnable = [n for n in wanted if n != "resumed_step"]
    pins = " ".join(f"{name}=={versions[name]}" for name in PINNED_IN_REPRO if versions.get(name))
    seen = f"\nSignature in the matrix run: {record['signature']['text']}" if record and record["signature"] else ""
    variant_line = (
        f"\n\nSettings changed from the matrix grid's (an exploration's finding): {variant}" if variant else ""
    )
    interpreter = ""
    if cell.model == "liger-llama" and cell.device == "cpu":  # before triton is imported
        interpreter = '\nos.environ.setdefault("TRITON_INTERPRET", "1")  # Liger\'s Triton kernels on CPU tensors\n'
    header = f'''#!/usr/bin/env python3
"""Standalone reproduction of precision-matrix cell {cell_id}.{seen}

    pip install {pins}

Model {cell.model}, precision {cell.precision} ({precision.summary}), mode {cell.mode}, device
{cell.device}; phases: {", ".join(wanted)}. Exits 1 printing the exception when the failure
is present, 0 when every phase completes. Imports nothing but the upstream libraries.{variant_line}
"""

import contextlib
import os
import sys
import tempfile
import traceback
{interpreter}
import torch
'''
    evaluate_phase = "\n\ndef evaluate(state):\n    state['model'] = build()\n    evaluate_now(state)\n"
    body = kind.standalone_code() + "\n" + _batch_literal(kind)
    phases = PHASES.format(
        weights=_dtype(precision.weights_dtype),
        autocast=_dtype(precision.autocast_dtype),
        scaler=precision.grad_scaler,
        weights_from=precision.weights_from,
        device=cell.device,
        lr=learning_rate_of(kind, record),
        steps=train_steps(),
        attempts=MAX_STEP_ATTEMPTS,
    )
    return header + phases + body + evaluate_phase + MAIN.format(phases="[" + ", ".join(runnable) + "]")
