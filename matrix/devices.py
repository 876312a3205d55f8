"""The device axis, capability probes, and the skip reasons that name what is missing.

Skip reasons follow Lightning's RunIf style: "Requires: [...]" names the capability, then
says what this machine has instead.
"""

from __future__ import annotations

import functools
import os

import torch

from matrix.precisions import Precision

DEVICES: tuple[str, ...] = ("cpu", "cuda")

# bf16 is native from Ampere on. torch.cuda.is_bf16_supported() also says yes on older
# GPUs through emulation, so the compute capability is what decides.
NATIVE_BF16_MIN_CAPABILITY = (8, 0)


PER_WORKER = "per-worker"
TRITON_INTERPRET = "TRITON_INTERPRET"


def interpret_triton_without_cuda() -> None:
    """Without a GPU, Triton kernels (Liger's) can only run in Triton's interpreter, on CPU
    tensors. Triton reads TRITON_INTERPRET when its functions are decorated, i.e. when triton
    is first imported (torch._dynamo imports it along with transformers' models), so this
    must run before that: conftest.py calls it first thing. An explicit setting is kept."""
    if not torch.cuda.is_available():
        os.environ.setdefault(TRITON_INTERPRET, "1")


def triton_interpreted() -> bool:
    return os.environ.get(TRITON_INTERPRET) == "1"


def resolve_cuda_index(option: str, worker_id: str | None, visible: int) -> int:
    """--cuda-device N -> N; per-worker -> xdist worker gwK's GPU, K mod the GPUs visible,
    so `-n <number of GPUs>` puts one worker on each GPU."""
    if option == PER_WORKER:
        if worker_id is None or not worker_id.startswith("gw") or not worker_id[2:].isdigit():
            return 0  # not under xdist (or its controller): the first GPU
        return int(worker_id[2:]) % max(1, visible)
    if not option.isdigit():
        raise ValueError(f"--cuda-device: {option!r} is not a GPU index (0, 1, ...) or {PER_WORKER!r}")
    return int(option)


def torch_device(device: str, cuda_index: int = 0) -> torch.device:
    return torch.device(f"cuda:{cuda_index}") if device == "cuda" else torch.device("cpu")


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


@functools.cache
def cpu_autocast_works(dtype: torch.dtype) -> bool:
    """Run a real matmul under CPU autocast: the answer is what the op does, not a flag."""
    try:
        a = torch.ones(2, 2)
        with torch.autocast("cpu", dtype=dtype):
            return (a @ a).dtype == dtype
    except RuntimeError:
        return False


def skip_reason(device: str, precision: Precision, cuda_index: int = 0) -> str | None:
    """Why this device cannot run this precision on this machine, or None if it can."""
    if device == "cpu":
        if precision.autocast_dtype is not None and not cpu_autocast_works(precision.autocast_dtype):
            return (
                f"Requires: [CPU autocast to {precision.autocast_dtype}] "
                f"(torch {torch.__version__} does not run a matmul in it)"
            )
        return None
    gpus = cuda_devices()
    if not gpus:
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"Requires: [CUDA device] (none visible; torch {torch.__version__} is {built})"
    if cuda_index >= len(gpus):
        return f"Requires: [CUDA device cuda:{cuda_index}] (only {len(gpus)} visible)"
    gpu = gpus[cuda_index]
    if torch.bfloat16 in precision.half_dtypes and not gpu["native_bf16"]:
        return (
            "Requires: [CUDA device with native bf16 (compute capability >= 8.0)] "
            f"(cuda:{cuda_index} is {gpu['name']}, compute capability {gpu['compute_capability']})"
        )
    return None
