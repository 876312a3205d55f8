"""The device axis: a registry of devices (matrix/devices/base.py Device), one file each.

  base.py          - what a device is to the matrix (Device), DEVICES, --cuda-device's index
  cpu.py           - cpu: always there; skips a precision whose autocast this torch cannot run
  cuda.py          - cuda: NVIDIA GPUs through torch.cuda (and, without one, Triton's
                     interpreter variables for Liger's kernels)
  fingerprint.py   - the versions and devices every report records (python -m
                     matrix.devices.fingerprint prints them)

A new device (mps, xpu) is one file here that subclasses Device and calls register(); a
user's device registers from their plugin the same way. poisoning_error(), below, asks every
device whether a failure left its process unusable.
"""

from __future__ import annotations

import functools

from matrix.devices.base import DEVICES, PER_WORKER, Device, register, resolve_index
from matrix.grid.registry import load_modules


def poisoning_error(message: str | None) -> str | None:
    """The error named in a failure's message after which its process cannot go on (a CUDA
    device-side assert, say), from any device; None if there is none."""
    return next((found for device in DEVICES.values() if (found := device.poisoning_error(message))), None)


@functools.cache
def hardware_facts(index: int = 0) -> dict:
    """What decides a kernel on this machine, from every device (Device.hardware_facts): the
    facts catalogue conditions read (matrix/catalogue/conditions.py) and every report records. Read once
    per process (cache_clear() after changing what they read)."""
    facts: dict = {}
    for device in DEVICES.values():
        facts.update(device.hardware_facts(index))
    return facts


load_modules(__name__)

__all__ = ["DEVICES", "PER_WORKER", "Device", "hardware_facts", "poisoning_error", "register", "resolve_index"]
