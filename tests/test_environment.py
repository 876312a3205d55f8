"""What a report records about GPUs: the warning for a mixed machine, and the driver."""

import os
import stat

from matrix.devices import cuda

H100 = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "00000000:41:00.0"}
T4 = {"index": 1, "name": "Tesla T4", "pci_bus_id": "00000000:01:00.0"}


def test_different_gpus_without_bus_order_warn_and_name_the_chosen_one(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    (warning,) = cuda.gpu_warnings((H100, T4), 1)
    assert "several different GPUs are visible (NVIDIA H100 80GB HBM3, Tesla T4)" in warning
    assert "the cells ran on cuda:1 = Tesla T4 (PCI 00000000:01:00.0)" in warning
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    assert cuda.gpu_warnings((H100, T4), 0)


def test_no_warning_with_bus_order_or_one_kind_of_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert cuda.gpu_warnings((H100, T4), 0) == []
    monkeypatch.delenv("CUDA_DEVICE_ORDER")
    assert cuda.gpu_warnings((H100, {**H100, "index": 1}), 0) == []
    assert cuda.gpu_warnings((), None) == []


def test_driver_versions_come_from_nvidia_smi(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        "echo '| NVIDIA-SMI 570.86.15              Driver Version: 570.86.15      CUDA Version: 12.8     |'\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert cuda.nvidia_driver() == {"driver_version": "570.86.15", "driver_cuda_version": "12.8"}
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert cuda.nvidia_driver() == {}
