"""NVIDIA GPUs through torch.cuda: which are visible, which precisions they run natively, the
errors that leave a process's CUDA context unusable, and what a report records of them (the
GPUs, the driver, CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER)."""

from __future__ import annotations

import functools
import os
import subprocess

import torch

from matrix.devices.base import Device, register
from matrix.precisions.policies import Precision

# bf16 is native from Ampere on. torch.cuda.is_bf16_supported() also says yes on older
# GPUs through emulation, so the compute capability is what decides.
NATIVE_BF16_MIN_CAPABILITY = (8, 0)
CUDA_ENV_VARS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
TRITON_INTERPRET = "TRITON_INTERPRET"


def interpreter_variables() -> dict[str, str]:
    """Without a GPU, Triton kernels (Liger's) can only run in Triton's interpreter, on CPU
    tensors: TRITON_INTERPRET=1 among the variables the matrix's cells run under
    (matrix/execute/environment_variables.py). Triton reads it when its functions are decorated, its own
    when triton is first imported (torch._dynamo imports it along with transformers' models),
    so it must be set before anything imports triton in the process."""
    return {} if torch.cuda.is_available() else {TRITON_INTERPRET: "1"}


def triton_interpreted() -> bool:
    return os.environ.get(TRITON_INTERPRET) == "1"


@functools.cache
def cuda_devices() -> tuple[dict, ...]:
    """Every visible GPU, as recorded in reports."""
    if not torch.cuda.is_available():
        return ()
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        capability = (props.major, props.minor)
        found.append(
            {
                "index": index,
                "name": props.name,
                "compute_capability": f"{props.major}.{props.minor}",
                "total_memory_gib": round(props.total_memory / 2**30, 1),
                "native_bf16": capability >= NATIVE_BF16_MIN_CAPABILITY,
                # the same GPU nvidia-smi shows: its bus id does not depend on CUDA_DEVICE_ORDER
                "pci_bus_id": _pci_bus_id(props),
                "uuid": str(props.uuid) if getattr(props, "uuid", None) is not None else None,
                "multiprocessors": props.multi_processor_count,
            }
        )
    return tuple(found)


def _pci_bus_id(props) -> str | None:
    if all(hasattr(props, name) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    return None


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


def gpu_skip_reason(gpus: tuple[dict, ...], precision: Precision, index: int) -> str | None:
    """Why cuda:index cannot run `precision` among the GPUs `gpus`, or None."""
    if not gpus:
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return (
            f"Requires: [CUDA device] (none visible; torch {torch.__version__} is {built}; "
            "a GPU machine runs them: docs/GPU.md)"
        )
    if index >= len(gpus):
        return f"Requires: [CUDA device cuda:{index}] (only {len(gpus)} visible)"
    gpu = gpus[index]
    if torch.bfloat16 in precision.half_dtypes and not gpu["native_bf16"]:
        return (
            "Requires: [CUDA device with native bf16 (compute capability >= 8.0)] "
            f"(cuda:{index} is {gpu['name']}, compute capability {gpu['compute_capability']})"
        )
    return None


class CUDA(Device):
    name = "cuda"
    axis_position = 1
    description = "NVIDIA GPUs through torch.cuda"
    indexed = True
    poisoning_errors = (
        "device-side assert triggered",
        "an illegal memory access was encountered",
        "unspecified launch failure",
    )
    deterministic_steps = False  # backward kernels with atomic adds (index_add, embedding's backward)

    def count(self) -> int:
        return len(cuda_devices())

    def skip_reason(self, precision: Precision, index: int = 0) -> str | None:
        return gpu_skip_reason(cuda_devices(), precision, index)

    def device_name(self, index: int) -> str | None:
        gpus = cuda_devices()
        return gpus[index]["name"] if index < len(gpus) else None

    def activate(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def rng_devices(self, device: torch.device) -> list:
        return [device]

    def capture(self, index: int | None) -> dict:
        gpus = cuda_devices()
        driver = nvidia_driver() if gpus else {}
        return {
            "torch_cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
            "driver_version": driver.get("driver_version"),
            "driver_cuda_version": driver.get("driver_cuda_version"),
            "cuda_devices": list(gpus),
            "selected_cuda_device": index if gpus else None,
            "env": {name: os.environ.get(name) for name in CUDA_ENV_VARS},
        }

    def hardware_facts(self, index: int | None) -> dict:
        gpus = cuda_devices()
        return {
            "cuda_compute_capabilities": [gpu["compute_capability"] for gpu in gpus],
            "cuda_device_names": [gpu["name"] for gpu in gpus],
            "selected_cuda_device": (index or 0) if gpus else None,
        }

    def warnings(self, index: int | None) -> list[str]:
        gpus = cuda_devices()
        return gpu_warnings(gpus, index if gpus else None)


register(CUDA())
