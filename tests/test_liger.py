"""Seed 002: Liger-Kernel's fused linear cross entropy under bf16 mixed precision.

Without triton and liger-kernel (the default environment) the liger-llama cells skip, naming
them. With them (`nox -s liger`, the `liger` and `seed-002-liger-flce` stacks) the cells run;
without a GPU Liger's Triton kernels run in Triton's interpreter.
"""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from matrix.checks.tolerances import eval_loss_tolerance
from matrix.devices.cuda import triton_interpreted
from matrix.execute import environment_variables as cell_environment
from matrix.execute.cell_run import run_cell
from matrix.grid.cell import Cell
from matrix.models import MODELS
from matrix.models.liger_llama import REQUIRED, missing_packages
from matrix.precisions.policies import PRECISIONS
from matrix.releases import stacks

ROOT = Path(__file__).resolve().parent.parent
KIND = MODELS["liger-llama"]
CPU = torch.device("cpu")
INSTALLED = not missing_packages()
needs_liger = pytest.mark.skipif(
    not INSTALLED, reason=f"Requires: [{', '.join(REQUIRED)}] (nox -s liger installs them)"
)
with cell_environment.applied():
    INTERPRETED = triton_interpreted()  # as a cell sees it: set where no GPU is visible
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED,
    reason="Requires: [Triton's interpreter] (TRITON_INTERPRET=1; set where no GPU is visible)",
)


# The releases the seed's failure shows in (docs/SEEDS.md):
CPU_FAILS = SpecifierSet(">=0.5.0,<0.5.3")  # bf16 logits not cast before addmm: fails on any device
GPU_QUERY_FAILS = SpecifierSet("<0.4.0")  # dtype from torch.is_autocast_enabled(): CUDA's autocast only


def liger_version() -> Version:
    return Version(importlib.metadata.version("liger-kernel"))


@pytest.fixture(autouse=True, scope="module")
def as_in_a_cell():
    """These tests run Liger outside the matrix's cells, so they ask for the variables a cell runs
    under themselves (Triton's interpreter without a GPU), from before the first of them imports
    triton until the last is done (the plugin sets them only around the matrix's own tests)."""
    with cell_environment.applied():
        yield


def test_the_skip_reason_names_each_missing_package(monkeypatch):
    monkeypatch.setattr(type(KIND), "requires", (*KIND.requires, "a-kernel-library"))
    reason = KIND.skip_reason("cpu")
    assert reason.startswith(f"Requires: [{', '.join([*missing_packages(), 'a-kernel-library'])}] (not installed: ")
    how = reason.split("not installed: ")[1]
    # how to install, only: the command that runs the cells is the report's (matrix/results/run_them.py)
    assert "pip install a-kernel-library" in how and "nox -s" not in how


@pytest.mark.skipif(INSTALLED, reason="Requires: [no liger-kernel] (this environment has it)")
def test_without_liger_its_cells_skip_with_the_reason(tmp_path):
    command = [sys.executable, "-m", "pytest", "cases", "--model", "liger-llama", "--precision", "bf16-mixed"]
    command += ["--device", "cpu", "--engine", "torch", "--report-dir", str(tmp_path), "--run-id", "r", "-q"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:]
    cells = json.loads((tmp_path / "r" / "results.json").read_text())["cells"]
    assert {c["outcome"] for c in cells} == {"skipped"} and len(cells) == 2
    assert all(c["skip_reason"].startswith("Requires: [triton, liger-kernel] (not installed") for c in cells)


def test_the_liger_stacks_install_triton_and_liger_kernel():
    known = stacks.load()
    today, seed = known["liger"], known["seed-002-liger-flce"]
    for stack in (today, seed):
        pins = {pin.split("==")[0]: pin.split("==")[1] for pin in stack.pins}
        assert {"triton", "liger-kernel"} <= set(pins), stack.name
        assert "liger-llama" in stack.select
    assert dict(p.split("==") for p in seed.pins)["liger-kernel"] == "0.3.1"  # the release of autumn 2024
    assert not any("liger" in pin or "triton" in pin for pin in known["default"].pins)


@needs_liger
@needs_interpreter
@pytest.mark.parametrize("engine", ["torch", "hf-trainer"])
def test_a_liger_cell_trains_under_bf16_autocast_through_liger(engine, tmp_path):
    result = run_cell(Cell("liger-llama", "bf16-mixed", "train", "cpu", engine), tmp_path)
    if liger_version() in CPU_FAILS:
        assert result.signature.message == "mat1 and mat2 must have the same dtype, but got BFloat16 and Float"
        return
    assert result.outcome == "passed", result.message
    assert result.metrics.effective.autocast_dtype_in_forward == "bfloat16"


def liger_loss_and_gradients(model, autocast: bool):
    """The training loss of the cell's batch and every parameter's gradient, in fp32."""
    model.train()
    model.zero_grad(set_to_none=True)
    batch = KIND.batch(CPU)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with context:
        loss = KIND.loss(model, batch)
    loss.backward()
    return loss.float().item(), {n: p.grad.float() for n, p in model.named_parameters()}


@needs_liger
@needs_interpreter
def test_liger_loss_and_gradients_agree_with_plain_fp32_cross_entropy():
    """Liger's fused loss under bf16 autocast vs transformers' own loss in fp32, same weights."""
    if liger_version() in CPU_FAILS:
        pytest.skip(f"Requires: [a liger-kernel release whose bf16 path runs] ({liger_version()} fails)")
    liger = KIND.build(PRECISIONS["fp32"], CPU, None)
    plain = MODELS["tiny-llama"].build(PRECISIONS["fp32"], CPU, None)
    assert plain.forward.__func__ is not liger.forward.__func__  # the reference really is transformers' loss
    loss, grads = liger_loss_and_gradients(liger, autocast=True)
    reference, reference_grads = liger_loss_and_gradients(plain, autocast=False)
    row = eval_loss_tolerance("liger-llama", torch.bfloat16)
    assert row.allows(loss, reference), (loss, reference)
    for name, grad in grads.items():
        scale = reference_grads[name].abs().max().item()
        torch.testing.assert_close(grad, reference_grads[name], atol=row.atol * scale, rtol=row.rtol, msg=name)
    fp32_loss, _ = liger_loss_and_gradients(liger, autocast=False)
    assert eval_loss_tolerance("liger-llama", torch.float32).allows(fp32_loss, reference)


@needs_liger
@needs_interpreter
def test_with_cudas_autocast_query_answered_as_on_a_gpu_the_seed_release_fails(monkeypatch, tmp_path):
    """What Liger <= 0.3.1 sees on a GPU: torch.is_autocast_enabled() with no device asks about
    CUDA autocast, on for a GPU run, off under CPU autocast. Answered from the CPU's autocast
    here, the seed's error appears on the seed's release; later releases pass."""
    real = torch.is_autocast_enabled
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *device: real(*device) if device else real("cpu"))
    monkeypatch.setattr(torch, "get_autocast_gpu_dtype", lambda: torch.get_autocast_dtype("cpu"), raising=False)
    result = run_cell(Cell("liger-llama", "bf16-mixed", "train", "cpu", "torch"), tmp_path)
    fails = liger_version() in GPU_QUERY_FAILS or liger_version() in CPU_FAILS
    if fails:
        assert result.signature.text == (
            "train_steps: RuntimeError: mat1 and mat2 must have the same dtype, but got BFloat16 and Float "
            "@ liger_kernel.ops.fused_linear_cross_entropy:fused_linear_cross_entropy_forward"
        )
    else:
        assert result.outcome == "passed", result.message
    assert os.environ.get("TRITON_INTERPRET") == "1"


@needs_liger
@needs_interpreter
def test_the_standalone_script_runs_liger_with_nothing_of_the_project_importable(tmp_path):
    from matrix.releases.repro import generate

    script = tmp_path / "repro.py"
    script.write_text(generate("liger-llama-bf16-mixed-train-cpu-torch"))
    assert 'os.environ.setdefault("TRITON_INTERPRET", "1")' in script.read_text()
    done = subprocess.run(
        [sys.executable, "-I", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    if liger_version() in CPU_FAILS:
        assert done.returncode == 1 and "REPRODUCED in train_steps: RuntimeError: mat1 and mat2" in done.stdout
    else:
        assert done.returncode == 0 and "HOLDS: every check of the cell held" in done.stdout, done.stdout[-2000:]
