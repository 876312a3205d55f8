"""What a device is to the matrix: how it is probed, why a cell cannot run on it here, where a
cell's tensors go, which errors leave a process unusable, and what a report records of it.

Skip reasons follow Lightning's RunIf style: "Requires: [...]" names the capability, then
says what this machine has instead.
"""

from __future__ import annotations

import abc
import functools

import torch

from matrix.grid.registry import Registry
from matrix.precisions.policies import Precision

PER_WORKER = "per-worker"


class Device(abc.ABC):
    """One value of the device axis. A new device is one file in matrix/devices/ that defines
    a subclass and registers an instance (matrix/devices/cpu.py is the smallest)."""

    name: str  # the axis value, and torch's device type
    axis_position: int  # place in the axis' order
    description: str
    # Several of them per machine, chosen with --cuda-device N (or per-worker): cells record which
    indexed: bool = False
    # Errors after which the process's context on this device is unusable: every later call in
    # the same process fails the same way, so the rest of the run needs a fresh process.
    poisoning_errors: tuple[str, ...] = ()
    # Whether the same step from the same state gives the same bits twice in a process: a resumed
    # step must then equal the uninterrupted one bit for bit (matrix/harness/resume.py), else within a
    # tolerance row. CUDA's backward kernels use atomic adds: not deterministic.
    deterministic_steps: bool = True

    def torch_device(self, index: int = 0) -> torch.device:
        return torch.device(f"{self.name}:{index}") if self.indexed else torch.device(self.name)

    def count(self) -> int:
        """How many are visible here (0: none, the cells skip)."""
        return 1

    @abc.abstractmethod
    def skip_reason(self, precision: Precision, index: int = 0) -> str | None:
        """Why this device cannot run this precision on this machine, or None if it can."""

    def placement(self, index: int) -> dict:
        """Which one a cell ran on, as its record says: {"cuda_index": ..., "device_name": ...}."""
        return {"cuda_index": index if self.indexed else None, "device_name": self.device_name(index)}

    def device_name(self, index: int) -> str | None:
        return None

    def activate(self, device: torch.device) -> None:  # noqa: B027 (most devices have no current one)
        """Make `device` the current one before a library creates its own state on it."""

    def rng_devices(self, device: torch.device) -> list:
        """The devices whose generators torch.random.fork_rng must keep besides the CPU's."""
        return []

    def capture(self, index: int | None) -> dict:
        """What every report's environment records of this device type on this machine."""
        return {}

    def hardware_facts(self, index: int | None) -> dict:
        """What decides a kernel on this machine, as this device type knows it (flat keys the
        conditions of matrix/catalogue/conditions.py read): the report's environment.hardware."""
        return {}

    def warnings(self, index: int | None) -> list[str]:
        """Traps on this machine a reader of the report should know about."""
        return []

    def poisoning_error(self, message: str | None) -> str | None:
        return next((error for error in self.poisoning_errors if message and error in message), None)


def resolve_index(option: str, worker_id: str | None, visible: int) -> int:
    """--cuda-device N -> N; per-worker -> xdist worker gwK's device, K mod the devices visible,
    so `-n <number of GPUs>` puts one worker on each."""
    if option == PER_WORKER:
        if worker_id is None or not worker_id.startswith("gw") or not worker_id[2:].isdigit():
            return 0  # not under xdist (or its controller): the first device
        return int(worker_id[2:]) % max(1, visible)
    if not option.isdigit():
        raise ValueError(f"--cuda-device: {option!r} is not a GPU index (0, 1, ...) or {PER_WORKER!r}")
    return int(option)


@functools.cache
def autocast_works(device_type: str, dtype: torch.dtype) -> bool:
    """Run a real matmul under the device's autocast: the answer is what the op does, not a flag."""
    try:
        a = torch.ones(2, 2, device=device_type)
        with torch.autocast(device_type, dtype=dtype):
            return (a @ a).dtype == dtype
    except RuntimeError:
        return False


def no_autocast_reason(device_type: str, precision: Precision) -> str | None:
    if precision.autocast_dtype is not None and not autocast_works(device_type, precision.autocast_dtype):
        return (
            f"Requires: [{device_type.upper()} autocast to {precision.autocast_dtype}] "
            f"(torch {torch.__version__} does not run a matmul in it)"
        )
    return None


DEVICES: Registry[Device] = Registry("device", Device)
register = DEVICES.register
