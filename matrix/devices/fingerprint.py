"""What every report records about the machine and the stack it ran on. `python -m
matrix.devices.fingerprint` prints the stack in one line (torch, its CUDA, the GPUs, the libraries)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from matrix.devices import DEVICES, hardware_facts
from matrix.devices.cpu import cpu_name
from matrix.grid.packages import installed_versions


def package_versions() -> dict[str, str | None]:
    return installed_versions()


def git_state(root: Path) -> dict:
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def capture(device_index: int) -> dict:
    """The machine, what decides its kernels (`hardware`: the CPU capability torch dispatches on,
    the CPU's features, what bitsandbytes detects, the GPUs' compute capability; the facts the
    catalogue's hardware conditions read), the packages, and what each registered device records
    of itself (matrix/devices/: cuda adds its GPUs, driver and CUDA_* variables)."""
    found = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "hardware": hardware_facts(device_index),
        "packages": package_versions(),
    }
    warnings = []
    for device in DEVICES.values():
        found.update(device.capture(device_index))
        warnings += device.warnings(device_index)
    found["warnings"] = warnings
    return found


def stack_line() -> str:
    versions = package_versions()
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    visible = [f"{d.name}:{i} {d.device_name(i)}" for d in DEVICES.values() if d.indexed for i in range(d.count())]
    others = ", ".join(
        f"{name} {versions[name]}" for name in ("transformers", "peft", "accelerate", "lightning") if versions[name]
    )
    return f"torch {torch.__version__} ({cuda}; {', '.join(visible) or 'no GPU visible'}), {others}"


if __name__ == "__main__":
    print(stack_line())
