"""Emulate, for bitsandbytes, a CPU without AVX512-BF16 (as an AMD EPYC with AVX2 only is): with
this folder on PYTHONPATH every Python process (the matrix's ranks too) answers bitsandbytes'
native has_avx512bf16_cpu() with False, before bitsandbytes is imported, so its 4-bit layers never
repack their weights for its CPU kernel and its CPU gemv kernel is not registered, as on such a
CPU. Together with ATEN_CPU_CAPABILITY=avx2 (torch dispatches at AVX2) it is the machine of issue 46:

    ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=tests/cpu_emulation python -m matrix run cases ...

The matrix's hardware facts (matrix/devices/cpu.py) read the same native function, and so see
the emulated answer. Test tooling only: nothing in the package imports it.
"""

import ctypes
import os

_EMULATED = {"has_avx512bf16_cpu": lambda *args: False}
_getitem = ctypes.CDLL.__getitem__


def _emulated_getitem(self, name_or_ordinal):
    if "bitsandbytes" in str(getattr(self, "_name", "")) and name_or_ordinal in _EMULATED:
        return _EMULATED[name_or_ordinal]
    return _getitem(self, name_or_ordinal)


ctypes.CDLL.__getitem__ = _emulated_getitem

# oneDNN's float16, by which DeepSpeed's CPU accelerator lists float16 among its supported dtypes
# (matrix/devices/cpu.py onednn_fp16): MATRIX_EMULATE_ONEDNN_FP16=1 answers
# torch.ops.mkldnn._is_mkldnn_fp16_supported() with True in every process (an AVX512-FP16 or AMX-FP16
# CPU), =0 with False (any other). Only then is torch imported here, before anything else asks.
if os.environ.get("MATRIX_EMULATE_ONEDNN_FP16") in ("0", "1"):
    import torch

    _ONEDNN_FP16 = os.environ["MATRIX_EMULATE_ONEDNN_FP16"] == "1"
    torch.ops.mkldnn._is_mkldnn_fp16_supported = lambda: _ONEDNN_FP16
