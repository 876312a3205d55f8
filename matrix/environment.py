"""What every report records about the machine and the stack it ran on."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from pathlib import Path

import torch

from matrix import devices
from matrix.versions import installed_versions

PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "safetensors",
    "lightning",
    "triton",  # with liger-kernel: seed 002's stacks only
    "liger-kernel",
    "numpy",
    "pytest",
    "pytest-xdist",
    "hypothesis",
)
CUDA_ENV_VARS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


def package_versions() -> dict[str, str | None]:
    return installed_versions(PACKAGES)


@functools.cache
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_state(root: Path) -> dict:
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def gpu_warnings(gpus: tuple[dict, ...], selected: int | None) -> list[str]:
    """Seed 000's trap: with different GPUs visible, CUDA's default order (fastest first) is
    not nvidia-smi's (PCI bus), so "GPU 1" may not be the one the user meant."""
    names = {gpu["name"] for gpu in gpus}
    if len(names) > 1 and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        chosen = ""
        if selected is not None and selected < len(gpus):
            gpu = gpus[selected]
            chosen = f"; the cells ran on cuda:{selected} = {gpu['name']} (PCI {gpu.get('pci_bus_id') or 'unknown'})"
        return [
            f"several different GPUs are visible ({', '.join(sorted(names))}) and CUDA_DEVICE_ORDER is not "
            f"PCI_BUS_ID: cuda:N may not be the GPU nvidia-smi calls N{chosen}; set CUDA_DEVICE_ORDER=PCI_BUS_ID "
            "or choose with --cuda-device"
        ]
    return []


def nvidia_driver() -> dict:
    """The driver's version and the newest CUDA it supports, from nvidia-smi (torch reports
    only the CUDA it was built with). Empty where there is no nvidia-smi."""
    try:
        done = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = {}
    for key, label in (("driver_version", "Driver Version:"), ("driver_cuda_version", "CUDA Version:")):
        if label in done.stdout:
            found[key] = done.stdout.split(label, 1)[1].split()[0]
    return found


def capture(cuda_index: int) -> dict:
    gpus = devices.cuda_devices()
    driver = nvidia_driver() if gpus else {}
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "driver_version": driver.get("driver_version"),
        "driver_cuda_version": driver.get("driver_cuda_version"),
        "packages": package_versions(),
        "cuda_devices": list(gpus),
        "selected_cuda_device": cuda_index if gpus else None,
        "env": {name: os.environ.get(name) for name in CUDA_ENV_VARS},
        "warnings": gpu_warnings(gpus, cuda_index if gpus else None),
    }


def stack_line() -> str:
    versions = package_versions()
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    gpus = ", ".join(f"cuda:{g['index']} {g['name']}" for g in devices.cuda_devices()) or "no GPU visible"
    others = ", ".join(
        f"{name} {versions[name]}" for name in ("transformers", "peft", "accelerate", "lightning") if versions[name]
    )
    return f"torch {torch.__version__} ({cuda}; {gpus}), {others}"


if __name__ == "__main__":
    print(stack_line())
