"""A cell written out as one standalone script (`python -m matrix repro CELL [--run RUN]`).

The script holds, as text: the environment it was made on (a fingerprint in its docstring), the
cell's settings with every allowance the matrix applied (SETTINGS), the model kind's code, the
batch as literals, the harness's measurements and rules (parts/measure.py), the engine's own
library calls (parts/engine_<name>.py) and the phases with their checks (parts/phases.py). It
imports the upstream libraries only (a user's kind: its own module). It exits 1 when the cell's
failure shows (the same check, or the same exception, in the same phase), 0 when every check
holds, 2 on another failure, printing each comparison's numbers and allowance.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import torch

from matrix.devices.cpu import REPRODUCIBLE_BLAS
from matrix.devices.fingerprint import package_versions
from matrix.grid.packages import PINNED_IN_REPRO
from matrix.grid.schedule import FIRST_FORWARD_SEED, MAX_STEP_ATTEMPTS, RESUME_SEED, TRAIN_STEPS, train_steps
from matrix.grid.variants import InvalidVariant
from matrix.grid.variants import from_json as variant_from_json
from matrix.harness.kind_traits import kind_learning_rate
from matrix.models import MODELS, ModelKind
from matrix.precisions.policies import PRECISIONS, Precision
from matrix.results.metrics import CellMetrics
from matrix.selection.cells import cell_from_id

PARTS = Path(__file__).parent / "parts"


def engine_part(engine) -> Path:
    """The part that writes an engine's library calls out: parts/engine_<its module>.py (an
    engine and its compiled twin share it; their settings tell them apart)."""
    return PARTS / f"engine_{type(engine).__module__.rsplit('.', 1)[-1]}.py"


def engine_refusal(cell_id: str, engine) -> str:
    """Why an engine without a part cannot be written out, in one line: a user's loop (registered
    from their plugin module) is driven by the harness through the cell's state (its kind, batch,
    settings and learning rate), which a standalone script does not have."""
    module = type(engine).__module__
    if module.split(".", 1)[0] != "matrix":
        return (
            f"{cell_id}: the {engine.name} engine is a user's loop ({module}): the harness drives it through "
            "the cell's state, which a standalone script does not have; `python -m matrix run` reruns the cell"
        )
    return f"{cell_id}: the {engine.name} engine is not written into standalone scripts yet"


class ReproError(ValueError):
    """This cell cannot be written as a standalone script (yet): one line, exit status 2."""


def part(name: str) -> str:
    """A part's code, its module docstring left out (it documents the part, not the script)."""
    text = (PARTS / name).read_text()
    return re.sub(r'\A"""(?:.|\n)*?"""\n', "", text, count=1).strip() + "\n"


def literal(value) -> str:
    """Python source for a settings value: dtypes as torch.<name>, the rest as repr."""
    if isinstance(value, torch.dtype):
        return f"torch.{str(value).removeprefix('torch.')}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(literal(v) for v in value)
        return f"[{inner}]"
    if isinstance(value, float) and value != value:
        return "float('nan')"
    return repr(value)


def precision_settings(precision: Precision) -> dict:
    return {
        "name": precision.name,
        "weights": precision.weights_dtype,
        "autocast": precision.autocast_dtype,
        "grad_scaler": bool(precision.grad_scaler),
        "weights_from": precision.weights_from,
        "grad_accumulation": precision.grad_accumulation,
        "grad_dtype": precision.grad_dtype,
        "quantization": quantization_settings(precision),
        "float8": None if precision.float8 is None else {"recipe": precision.float8.recipe},
    }


def quantization_settings(precision: Precision) -> dict | None:
    """The quantized base as parts/quantized.py reads it (BitsAndBytesConfig's fields), or None."""
    quantization = precision.quantization
    if quantization is None:
        return None
    return {
        "scheme": quantization.scheme,
        "bits": quantization.bits,
        "compute_dtype": quantization.compute_dtype,
        "double_quant": quantization.double_quant,
        "prepare_for_kbit_training": quantization.prepare_for_kbit_training,
    }


def precision_refusal(cell_id: str, precision: Precision, engine, kind: ModelKind) -> str | None:
    """Why a quantized or float8 cell cannot be written out (yet), in one line, or None."""
    if precision.float8 is not None and getattr(engine, "converts_float8", False):
        return (
            f"{cell_id}: the {engine.name} engine's library converts the model to float8 itself "
            "(its fp8 mixed precision); that conversion is not written into standalone scripts yet"
        )
    if precision.quantization is not None and "load_quantized" not in kind.standalone_code():
        return (
            f"{cell_id}: the {kind.name} model kind's standalone code has no quantized loading (load_quantized): "
            "a user's kind builds its quantized base and adapters in its own build(), which no script writes out"
        )
    return None


def precision_parts(precision: Precision) -> list[str]:
    """The parts a quantized base or a float8 precision adds after the phases (they replace or
    wrap what the phases call), with the settings they read."""
    from matrix.checks.tolerances import QUANTIZED_VS_UNQUANTIZED
    from matrix.precisions.float8 import DIVISOR

    parts = []
    if precision.quantization is not None:
        row = QUANTIZED_VS_UNQUANTIZED[precision.quantization.scheme].as_dict()
        parts += [f"QUANTIZED_ROW = {literal(row)}", part("quantized.py")]
    if precision.float8 is not None:
        parts += [f"FLOAT8_DIVISOR = {DIVISOR}", part("float8.py")]
    return parts


def _before_main(phases: str, parts: list[str]) -> list[str]:
    """The phases' text with `parts` placed after their definitions and before the script's main guard."""
    if not parts:
        return [phases]
    guard = '\nif __name__ == "__main__":\n'
    head, tail = phases.rsplit(guard, 1)
    return [
        head.rstrip("\n") + "\n",
        "# ---------------------------------------------------------------- what the precision adds",
        *parts,
        guard.strip("\n") + "\n" + tail,
    ]


def batch_literal(kind: ModelKind) -> str:
    lines = ["BATCH = {"]
    for key, tensor in kind.batch(torch.device("cpu")).items():
        lines.append(f"    {key!r}: torch.tensor({tensor.tolist()!r}, dtype={literal(tensor.dtype)}).to(DEVICE),")
    lines.append("}")
    return "\n".join(lines)


def read_record(run: Path, cell_id: str) -> tuple[dict, dict]:
    path = run / "results.json" if run.is_dir() else run
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ReproError(f"--run: cannot read {path}: {error}") from None
    record = next((c for c in document.get("cells", []) if c.get("id") == cell_id), None)
    if record is None:
        raise ReproError(f"--run: {path} has no cell {cell_id!r}")
    return document, record


def target_of(record: dict | None) -> dict | None:
    """The failure the script looks for: the phase and the check's (or exception's) name."""
    if not record or not record.get("signature") or not record.get("phase"):
        return None
    exception = record["signature"]["exception"]
    return {"phase": record["phase"], "name": exception.rsplit(".", 1)[-1], "text": record["signature"]["text"]}


def fingerprint(document: dict | None) -> list[str]:
    """The machine the cell ran on (the run's record) or the one generating: versions, device, CPU."""
    from matrix.devices import hardware_facts

    if document is not None:
        environment = document.get("environment", {})
        packages, hardware = environment.get("packages", {}), environment.get("hardware", {})
        where = "the run this cell is from"
    else:
        packages, hardware, where = package_versions(), hardware_facts(), "this machine, when the script was written"
    lines = [f"Made on ({where}):"]
    lines.append("  " + ", ".join(f"{k} {v}" for k, v in sorted(packages.items()) if v))
    facts = ", ".join(f"{k} {v}" for k, v in sorted(hardware.items()) if v not in (None, "", [], {}))
    if facts:
        lines.append("  " + facts)
    return lines


def ranks_of(metrics, default: int) -> int:
    """The ranks the run's cell had (a run made with --world-size 1 on one GPU), else `default`."""
    from matrix.results.metrics import given

    group = given(metrics.distributed)
    recorded = given(group.world_size) if group is not None else None
    return recorded if isinstance(recorded, int) and recorded > 0 else default


def generate(cell_id: str, run: Path | None = None, variant: str | None = None, world: int | None = None) -> str:
    """The script for a cell; `run` (a report directory or results.json): its pins, the failure
    to look for and what the run observed (the ranks its cell had among them); `variant` (JSON, as
    an exploration records it); `world`: the ranks of a distributed engine where no run says."""
    try:
        return write_script(cell_id, run, variant, world)
    except ModuleNotFoundError as error:  # the engine's library settles the script's settings (DeepSpeed's clipping)
        raise ReproError(f"{cell_id}: writing its script needs {error.name}, which is not installed here") from error


def write_script(cell_id: str, run: Path | None, variant: str | None, world: int | None) -> str:
    from matrix.checks.tolerances import (
        LOSS_FALL_VS_FP32,
        compiled_vs_eager_tolerance,
        curve_vs_fp32_twin,
        curve_vs_torch_engine,
        eval_loss_tolerance,
        loss_decrease_bound,
        resume_tolerance,
    )
    from matrix.devices import DEVICES
    from matrix.engines import ENGINES
    from matrix.engines.distributed import world_size
    from matrix.engines.traits import curve_family
    from matrix.harness.against_references import is_fp32_twin
    from matrix.harness.compiling import BACKEND
    from matrix.harness.kind_traits import fp32_twin_fall
    from matrix.harness.pipeline import PHASE_NAMES
    from matrix.models import observation

    cell = cell_from_id(cell_id)
    if cell is None:
        raise ReproError(f"no cell {cell_id!r} (ids look like tiny-transformer-bf16-mixed-eval-cpu-torch)")
    engine = ENGINES[cell.engine]
    if not engine_part(engine).is_file():
        raise ReproError(engine_refusal(cell_id, engine))
    kind = MODELS[cell.model]
    if variant is not None:
        try:
            kind = kind.with_variant(variant_from_json(variant, kind.grid_variant))
        except (InvalidVariant, ValueError) as error:
            raise ReproError(f"--variant: {error}") from None
    precision = PRECISIONS[cell.precision]
    if precision.contradictions():
        raise ReproError(f"{cell_id}: precision {precision.name!r} fails in the matrix's own policy check")
    refusal = precision_refusal(cell_id, precision, engine, kind)
    if refusal is not None:
        raise ReproError(refusal)
    document = record = None
    if run is not None:
        document, record = read_record(run, cell_id)
    versions = (document or {}).get("environment", {}).get("packages") or package_versions()
    metrics = CellMetrics.from_dict((record or {}).get("metrics") or {})
    device = DEVICES[cell.device]
    rate = metrics.learning_rate.value if metrics.learning_rate else kind_learning_rate(kind).value
    steps = train_steps()

    # what the run was seen computing in: its autocast in the forward (None: none), else the precision's
    from matrix.results.metrics import given

    observed = (
        given(metrics.effective.autocast_dtype_in_forward, "not observed") if metrics.effective else "not observed"
    )
    run_autocast = precision.autocast_dtype if observed == "not observed" else observed and getattr(torch, observed)
    compute = precision.compute_dtype
    if isinstance(run_autocast, torch.dtype) and torch.finfo(run_autocast).eps > torch.finfo(compute).eps:
        compute = run_autocast

    # the rules, with the allowances the matrix applies to this cell
    twin = is_fp32_twin(precision)
    split_draws = engine.distributed and observation.observe(kind).stochastic_training_forward
    family = curve_family(engine.traits)  # the rows of the engine's family, for the kind (as record_curve)
    scheme = precision.quantization.scheme if precision.quantization else None
    curve_torch = None
    if cell.engine != "torch" and not split_draws:
        curve_torch = curve_vs_torch_engine(compute, family, kind.name).as_dict()
    curve_twin = None if twin or split_draws else curve_vs_fp32_twin(compute, scheme, family, kind.name).as_dict()
    loss_fall = None
    if kind.variant == kind.grid_variant:
        absolute = loss_decrease_bound(cell.model).min_relative
        if twin:
            loss_fall = absolute
        else:
            established = kind_learning_rate(kind)
            if established.fp32_fall.relative >= absolute:
                fall = established.fp32_fall.relative
                if steps != TRAIN_STEPS:
                    fall = fp32_twin_fall(kind, established.value, steps)
                loss_fall = LOSS_FALL_VS_FP32 * fall
    resume_row = None
    if not device.deterministic_steps:
        row = resume_tolerance(precision.compute_dtype)
        resume_row = {"loss": row.loss.as_dict(), "tensors": row.tensors.as_dict()}
    fp32 = precision_settings(PRECISIONS["fp32"])
    with tempfile.TemporaryDirectory(prefix="matrix-repro-") as scratch:  # the names weight decay applies to
        decayed = engine.decayed_parameters(kind.build(PRECISIONS["fp32"], torch.device("cpu"), Path(scratch)))
    settings = {
        "CELL_ID": cell_id,
        "ENGINE_NAME": cell.engine,
        "MODE": cell.mode,
        "PHASE_ORDER": list(PHASE_NAMES[cell.mode]),  # the pipeline's order (matrix/harness/pipeline.py PHASES)
        "TRAINING": cell.mode == "train",
        "DEVICE": cell.device if cell.device == "cpu" else f"{cell.device}:0",
        "DEVICE_TYPE": cell.device,
        "CELL": precision_settings(precision),
        # the kind's reload goes through from_pretrained in the precision's dtype, which keeps what
        # the class declares fp32 (ModelKind.loaded_in_dtype): the reload's dtype check allows those
        "RELOAD_KEEPS_DECLARED_FP32": kind.loaded_in_dtype(precision, reloaded=True),
        "FP32": fp32,
        "FP32_TWIN": {**fp32, "grad_accumulation": precision.grad_accumulation},
        "RUN_AUTOCAST": run_autocast,
        "STEPS": steps,
        "LEARNING_RATE": rate,
        "MAX_GRAD_NORM": engine.max_grad_norm,
        "DECAYED_NAMES": None if decayed is None else sorted(decayed),
        "GRADLESS": list(observation.observe(kind).gradless_parameters),
        "FROZEN": list(observation.observe(kind).frozen_parameters),
        # what the kind's loss averages over (a distributed rank weights its rows' loss by it)
        "LOSS_ITEMS": observation.observe(kind).loss_items,
        "EVAL_GRAD_MODE": kind.variant.eval_grad_mode,
        "EVAL_ROW": eval_loss_tolerance(cell.model, precision.compute_dtype).as_dict(),
        "CURVE_VS_TORCH_ENGINE": curve_torch,
        "CURVE_VS_FP32_TWIN": curve_twin,
        "LOSS_FALL": loss_fall,
        "RESUME_ROW": resume_row,
        "ENGINE_SETTINGS": engine.settings(precision),
        "DISTRIBUTED": engine.distributed,  # its ranks are started by the script, one rank too
        "WORLD_SIZE": ranks_of(metrics, world or world_size()) if engine.distributed else 1,
        # a distributed engine whose kind draws dropout masks: its first step is compared with dropout off
        "SPLIT_DRAWS": split_draws,
        "COMPILED": engine.compiled,
        # a compiled twin's evaluation against its eager twin (matrix/harness/pipeline.py check_against_eager)
        "EAGER_ROW": compiled_vs_eager_tolerance(precision.compute_dtype).as_dict() if engine.compiled else None,
        "COMPILE_BACKEND": BACKEND,
        "INIT_SEED": 0,
        "FIRST_FORWARD_SEED": FIRST_FORWARD_SEED,
        "RESUME_SEED": RESUME_SEED,
        "MAX_STEP_ATTEMPTS": MAX_STEP_ATTEMPTS,
        "TARGET": target_of(record),
    }
    lines = [f"{name} = {literal(value)}" for name, value in settings.items()]
    lines.append(f"RNG_DEVICES = {'[]' if cell.device == 'cpu' else '[0]'}")
    # one directory for every rank of a distributed cell: the ranks started by the script inherit it.
    # The process that made it removes it when it exits (a REPRO_WORKDIR given is kept): every run of
    # a script left its checkpoints behind in the temporary directory, and each rank an empty one
    lines.append("WORKDIR_OWNER = None if 'REPRO_WORKDIR' in os.environ else os.getpid()")
    lines.append("if WORKDIR_OWNER is not None:")
    lines.append("    os.environ['REPRO_WORKDIR'] = tempfile.mkdtemp(prefix='repro-')")
    lines.append("WORKDIR = os.environ['REPRO_WORKDIR']")
    lines.append("atexit.register(lambda: os.getpid() == WORKDIR_OWNER and shutil.rmtree(WORKDIR, ignore_errors=True))")
    lines.append("DECAYED = lambda model: None if DECAYED_NAMES is None else set(DECAYED_NAMES)  # noqa: E731")
    target = settings["TARGET"]
    header = _header(cell, kind, precision, versions, document, target, variant)
    model_code = kind.standalone_code().strip("\n")
    engine_code = part(engine_part(engine).name)
    # the ranks' process group, rows and gathered evaluation, for an engine part built on RankEngine
    shared_parts = [part("distributed.py")] if engine.distributed and "(RankEngine)" in engine_code else []
    # the step replay of a loop its library runs in one go, for an engine part built on ReplayedLoop
    shared_parts += [part("library_loop.py")] if "(ReplayedLoop)" in engine_code else []
    # where DeepSpeed builds its ops: a directory per release, not the one every release shares
    shared_parts += [part("deepspeed_ops.py")] if "deepspeed" in engine_part(engine).name else []
    return "\n\n".join(
        [
            header,
            "# ---------------------------------------------------------------- the cell's settings",
            "\n".join(lines),
            "# ---------------------------------------------------------------- the model kind",
            _split_build(model_code),
            batch_literal(kind),
            "# ---------------------------------------------------------------- the harness's measurements and rules",
            part("measure.py"),
            "# ---------------------------------------------------------------- the engine",
            *shared_parts,
            engine_code,
            "# ---------------------------------------------------------------- the phases",
            *_before_main(part("phases.py"), precision_parts(precision)),
        ]
    )


def _split_build(model_code: str) -> str:
    """The kind's code with the generic build() and reload() placed after its create/save/load
    and before the parts that build on them (LoRA's adapters, Liger's forward)."""
    marker = "\n# -- builds on build()\n"
    if marker in model_code:
        head, tail = model_code.split(marker, 1)
        return head + "\n\n" + part("build.py") + "\n" + tail
    return model_code + "\n\n" + part("build.py")


def _header(cell, kind, precision, versions, document, target, variant) -> str:
    pins = " ".join(f"{name}=={versions[name]}" for name in PINNED_IN_REPRO if versions.get(name))
    seen = f"\nThe matrix saw: {target['text']}" if target else "\nThe matrix saw no failure (or no run was given)."
    needs = ""
    if cell.device != "cpu":
        needs = f"\n\nNEEDS A GPU ({cell.device}): the cell ran there; the script runs on {cell.device} only."
    variant_line = (
        f"\n\nSettings changed from the matrix grid's (an exploration's finding): {variant}" if variant else ""
    )
    # MKL's reproducible mode, as the matrix's cells run (matrix/devices/cpu.py REPRODUCIBLE_BLAS): read at
    # MKL's first call, so set before torch computes anything
    interpreter = "".join(
        f'os.environ.setdefault("{name}", "{value}")  # the same bits wherever a tensor lies in memory\n'
        for name, value in REPRODUCIBLE_BLAS.items()
    )
    if cell.model == "liger-llama" and cell.device == "cpu":  # before triton is imported
        interpreter += 'os.environ.setdefault("TRITON_INTERPRET", "1")  # Liger\'s Triton kernels on CPU tensors\n'
    made = "\n".join(fingerprint(document))
    return f'''#!/usr/bin/env python3
"""Standalone reproduction of precision-matrix cell {cell.id}.{seen}

    pip install {pins}
    python {cell.id}.py [--json out.json]

Model {cell.model}, precision {cell.precision} ({precision.summary}), mode {cell.mode}, engine
{cell.engine}, device {cell.device}. Every comparison prints its numbers and allowance (lines
CHECK ...). Exit 1: the matrix's failure shows (the same check or exception, same phase);
0: every check held; 2: another failure. Imports nothing but the upstream libraries.{needs}{variant_line}

{made}
"""

import argparse
import atexit
import contextlib
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import traceback

{interpreter}import torch'''
