"""The CPU: always there; a precision whose autocast dtype this torch cannot run on it skips."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

from matrix.devices.base import Device, no_autocast_reason, register
from matrix.precisions import Precision


@functools.cache
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class CPU(Device):
    name = "cpu"
    axis_position = 0
    description = "the host CPU, torch's CPU autocast"

    def skip_reason(self, precision: Precision, index: int = 0) -> str | None:
        return no_autocast_reason("cpu", precision)

    def device_name(self, index: int) -> str | None:
        return cpu_name()


register(CPU())
