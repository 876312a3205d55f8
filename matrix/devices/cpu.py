"""The CPU: always there; a precision whose autocast dtype this torch cannot run on it skips."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import platform
import sys
from pathlib import Path

from matrix.devices.base import Device, no_autocast_reason, register
from matrix.precisions.policies import Precision


@functools.cache
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The CPU's bit-for-bit rules (a reloaded checkpoint's outputs, a resumed step: Device.deterministic_steps)
# hold only where the same weights run the same arithmetic. torch's CPU builds do their matrix products
# in Intel MKL, whose kernels may round differently for the same numbers at another memory alignment
# unless its conditional numerical reproducibility is on (MKL_CBWR). transformers' safetensors loader
# hands over tensors 8 bytes past a 64-byte boundary where torch allocates them aligned: on an AVX-512
# CPU (torch 2.13.0+cpu) a reloaded hf:granitemoe's logits for a one-row batch came out one ulp from the
# saved model's, from the same weights, and its DDP cells failed their reload or resumed step (issue
# 47). With MKL_CBWR set to AUTO (MKL's best code path for the CPU, made reproducible), aligned and
# misaligned copies give the same bits; so the cells run under it (matrix/execute/environment_variables.py),
# and so do the repro scripts. MKL reads it once, at its first call in a process: it is set before the
# stack computes anything. A value already set is kept.
MKL_MODE = "MKL_CBWR"
REPRODUCIBLE_BLAS = {MKL_MODE: "AUTO"}


# torch.cpu's probes of the CPU's own features (cpuinfo), whatever torch dispatches on
CPU_FEATURE_PROBES = {
    "cpu_avx2": "_is_avx2_supported",
    "cpu_avx512": "_is_avx512_supported",
    "cpu_avx512_bf16": "_is_avx512_bf16_supported",
    "cpu_vnni": "_is_vnni_supported",
    "cpu_amx_tile": "_is_amx_tile_supported",
    "cpu_amx_fp16": "_is_amx_fp16_supported",
}
BITSANDBYTES_CPU_LIBRARY = {"linux": "libbitsandbytes_cpu.so", "darwin": "libbitsandbytes_cpu.dylib"}


def bitsandbytes_avx512_bf16() -> tuple[bool | None, str]:
    """bitsandbytes' own answer to "has this CPU AVX512-BF16?" (its 4-bit layers repack their
    weights for its CPU kernel when it says yes), and where the answer came from. Imported, its
    has_avx512bf16() (so a test that patched it is seen); else the same native function read from
    its CPU library, without importing bitsandbytes (which takes seconds)."""
    module = sys.modules.get("bitsandbytes.functional")
    if module is not None:
        return bool(module.has_avx512bf16()), "bitsandbytes.functional.has_avx512bf16()"
    spec = importlib.util.find_spec("bitsandbytes")
    if spec is None or not spec.submodule_search_locations:
        return None, "bitsandbytes is not installed"
    name = BITSANDBYTES_CPU_LIBRARY.get(sys.platform, "libbitsandbytes_cpu.dll")
    library = Path(next(iter(spec.submodule_search_locations))) / name
    try:
        return bool(ctypes.CDLL(str(library)).has_avx512bf16_cpu()), f"{name}: has_avx512bf16_cpu()"
    except (OSError, AttributeError) as error:
        return None, f"{name}: not readable ({error})"


def onednn_fp16() -> bool | None:
    """oneDNN's answer to "does this CPU compute float16?" (torch.ops.mkldnn._is_mkldnn_fp16_supported():
    AVX512-FP16 or AMX-FP16), the answer by which DeepSpeed's CPU accelerator lists float16 among its
    supported dtypes (and so reduces float16 gradients, and accepts an fp16 config); None where this
    torch has no such probe."""
    import torch

    try:
        probe = torch.ops.mkldnn._is_mkldnn_fp16_supported
    except (AttributeError, RuntimeError):
        return None
    return bool(probe())


def cpu_hardware_facts() -> dict:
    """The CPU capability torch dispatches on (ATEN_CPU_CAPABILITY lowers it), the CPU's own
    features, oneDNN's float16, what bitsandbytes detects, and MKL's reproducible mode as the cells
    and the repro scripts compute with it (MKL_CBWR as set, else REPRODUCIBLE_BLAS's; empty: off)."""
    import torch

    mode = os.environ.get(MKL_MODE, REPRODUCIBLE_BLAS[MKL_MODE])
    facts = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "mkl_cbwr": mode}
    for key, probe in CPU_FEATURE_PROBES.items():
        function = getattr(torch.cpu, probe, None)
        facts[key] = bool(function()) if function is not None else None
    facts["cpu_onednn_fp16"] = onednn_fp16()
    facts["bitsandbytes_cpu_avx512_bf16"], facts["bitsandbytes_detection"] = bitsandbytes_avx512_bf16()
    return facts


class CPU(Device):
    name = "cpu"
    axis_position = 0
    description = "the host CPU, torch's CPU autocast"

    def skip_reason(self, precision: Precision, index: int = 0) -> str | None:
        return no_autocast_reason("cpu", precision)

    def device_name(self, index: int) -> str | None:
        return cpu_name()

    def hardware_facts(self, index: int | None) -> dict:
        return cpu_hardware_facts()


register(CPU())
