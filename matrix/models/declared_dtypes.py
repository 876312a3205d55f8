"""The dtypes a model's weights must have: the precision's, except where the architecture
declares otherwise.

A transformers class may list modules it keeps in fp32 when from_pretrained loads it in half
precision: `_keep_in_fp32_modules` (kept in fp32 when loading in fp16) and
`_keep_in_fp32_modules_strict` (in fp16 and in bf16); MoE routers (`gate.weight`,
`e_score_correction_bias`) and RWKV's time decay are such modules. from_pretrained(dtype=...)
honours the declaration; model.to(dtype) does not, and promises nothing of it. So a parameter
a declaration covers is expected in fp32 after from_pretrained, and in the cast dtype after a
cast; one that comes back in another dtype, or the reverse, breaks the contract (a finding).

The declaration is read from the model itself, through transformers' own `_get_dtype_plan`
where the installed version has it (4.56+), else from the two attributes with the rule above.
A pattern covers a parameter as transformers matches it: a regular-expression search of the
pattern, '*' standing for any characters, in the parameter's name.

A class also declares by construction: a parameter its __init__ makes in fp32 whatever the
default dtype (torch.FloatTensor(...), dtype=torch.float32: XLNet's attention weights, the
A_log of Mamba-style layers) is created fp32 when transformers builds the model in half
precision, and from_pretrained keeps a parameter's created dtype where it differs from the
one asked for. Those are found by building the class the way transformers does for that dtype
(`_from_config(config, dtype=...)`), once per class, config and dtype.
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

HALF = (torch.float16, torch.bfloat16)


def declaring_model(model: nn.Module) -> nn.Module | None:
    """The transformers model inside `model` (itself, or the one a peft wrapper holds)."""
    for module in model.modules():
        if hasattr(module, "_keep_in_fp32_modules") and hasattr(module, "config"):
            return module
    return None


def fp32_patterns(model: nn.Module, dtype: torch.dtype) -> tuple[str, ...]:
    """The patterns of the modules `model`'s class keeps in fp32 when loaded in `dtype`."""
    declaring = declaring_model(model)
    if declaring is None or dtype not in HALF:
        return ()
    plan = getattr(declaring, "_get_dtype_plan", None)
    if plan is not None:
        return tuple(sorted(p for p, kept in plan(dtype).items() if kept == torch.float32))
    loose = set(getattr(declaring, "_keep_in_fp32_modules", None) or ()) if dtype == torch.float16 else set()
    strict = set(getattr(declaring, "_keep_in_fp32_modules_strict", None) or ())
    return tuple(sorted(loose | strict))


CREATED_FP32 = "created in fp32 by the class"  # the reason a by-construction parameter carries


def covered(name: str, patterns: tuple[str, ...]) -> str | None:
    """The first pattern that covers parameter `name`, or None."""
    return next((p for p in patterns if re.search(p.replace("*", ".*"), name)), None)


def created_fp32(model: nn.Module, dtype: torch.dtype) -> tuple[str, ...]:
    """The parameters and persistent buffers (names in the transformers model inside `model`) its
    class creates in fp32 when transformers builds it in `dtype`: from_pretrained keeps their
    created dtype. A non-persistent buffer is not loaded at all but made again (RoPE's inv_freq),
    which a cast does not survive: that stays a dtype change the reload check reports."""
    declaring = declaring_model(model)
    build = getattr(type(declaring), "_from_config", None)
    if declaring is None or build is None or dtype not in HALF:
        return ()
    key = (type(declaring), declaring.config.to_json_string(), dtype)
    if key not in _CREATED_FP32:
        from matrix.models.hf import dtype_argument  # torch_dtype before transformers 4.56

        with torch.random.fork_rng(devices=[]):
            built = build(copy.deepcopy(declaring.config), **{dtype_argument(): dtype})
        saved = built.state_dict().keys()  # buffers the loader reads (not the recomputed, non-persistent ones)
        tensors = [*built.named_parameters(), *((n, b) for n, b in built.named_buffers() if n in saved)]
        _CREATED_FP32[key] = tuple(n for n, t in tensors if t.dtype == torch.float32)
    return _CREATED_FP32[key]


_CREATED_FP32: dict[tuple, tuple[str, ...]] = {}


def fp32_reason(name: str, patterns: tuple[str, ...], created: tuple[str, ...]) -> str | None:
    """Why parameter `name` must be fp32 (the declared pattern, or CREATED_FP32), or None."""
    pattern = covered(name, patterns)
    if pattern:
        return pattern
    if any(name == c or name.endswith("." + c) for c in created):
        return CREATED_FP32
    return None


def expected_dtypes(
    weights: dict[str, torch.Tensor], model: nn.Module, dtype: torch.dtype, loaded: bool
) -> dict[str, tuple[torch.dtype, str | None]]:
    """name -> (the dtype it must have, the declaration that says so or None), for `weights`
    (parameters of `model`) when the model was obtained in `dtype`: by from_pretrained
    (`loaded`), which keeps the declared modules in fp32, or by a cast, which does not."""
    patterns = fp32_patterns(model, dtype) if loaded else ()
    created = created_fp32(model, dtype) if loaded else ()
    expected = {}
    for name in weights:
        reason = fp32_reason(name, patterns, created)
        expected[name] = (torch.float32, reason) if reason else (dtype, None)
    return expected


def declared_summary(model: nn.Module, dtype: torch.dtype) -> dict:
    """What a report records: the patterns declared for `dtype` and how many parameters they cover."""
    patterns, created = fp32_patterns(model, dtype), created_fp32(model, dtype)
    names = [n for n, _ in model.named_parameters() if fp32_reason(n, patterns, created)]
    return {"patterns": list(patterns), "created_fp32": len(created), "parameters": len(names)}
