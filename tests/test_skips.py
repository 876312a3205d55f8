"""Skip logic: a cell that cannot run here says which capability is missing."""

import pytest
import torch

from matrix.devices import DEVICES, cuda
from matrix.precisions.policies import PRECISIONS

OLD_GPU = (
    {"index": 0, "name": "Tesla T4", "compute_capability": "7.5", "total_memory_gib": 14.6, "native_bf16": False},
)
NEW_GPU = (
    {"index": 0, "name": "NVIDIA H100", "compute_capability": "9.0", "total_memory_gib": 79.1, "native_bf16": True},
)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_cpu_runs_every_precision_with_todays_torch(precision):
    assert DEVICES["cpu"].skip_reason(PRECISIONS[precision]) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="Requires: [no CUDA device] (this machine has one)")
@pytest.mark.parametrize("precision", PRECISIONS)
def test_cuda_cells_skip_without_a_gpu_naming_it(precision):
    reason = DEVICES["cuda"].skip_reason(PRECISIONS[precision])
    assert reason.startswith("Requires: [CUDA device]")
    assert torch.__version__ in reason


@pytest.mark.parametrize("precision", PRECISIONS)
def test_bf16_cells_skip_on_a_gpu_without_native_bf16(monkeypatch, precision):
    monkeypatch.setattr(cuda, "cuda_devices", lambda: OLD_GPU)
    reason = DEVICES["cuda"].skip_reason(PRECISIONS[precision])
    if torch.bfloat16 in PRECISIONS[precision].half_dtypes:
        assert reason.startswith("Requires: [CUDA device with native bf16 (compute capability >= 8.0)]")
        assert "Tesla T4" in reason and "7.5" in reason
    else:
        assert reason is None  # fp32 and fp16 run on a T4


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_modern_gpu_runs_everything(monkeypatch, precision):
    monkeypatch.setattr(cuda, "cuda_devices", lambda: NEW_GPU)
    assert DEVICES["cuda"].skip_reason(PRECISIONS[precision]) is None


def test_a_missing_gpu_index_is_named(monkeypatch):
    monkeypatch.setattr(cuda, "cuda_devices", lambda: NEW_GPU)
    assert DEVICES["cuda"].skip_reason(PRECISIONS["fp32"], 3) == "Requires: [CUDA device cuda:3] (only 1 visible)"


def test_skip_reasons_reach_the_report(run_pytest, tmp_path):
    import json

    done = run_pytest("--model", "tiny-transformer", "--precision", "fp32", "--mode", "eval", "--engine", "torch")
    assert done.returncode == 0, done.stdout[-3000:]
    results = json.loads((tmp_path / "reports" / "latest" / "results.json").read_text())
    by_device = {c["device"]: c for c in results["cells"]}
    assert by_device["cpu"]["outcome"] == "passed"
    if not torch.cuda.is_available():
        assert by_device["cuda"]["outcome"] == "skipped"
        assert by_device["cuda"]["skip_reason"].startswith("Requires: [CUDA device]")
