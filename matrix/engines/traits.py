"""Engine traits: what an engine's library does to a cell that a catalogue entry can select by
(`engine_trait = ["casts-parameters"]`, `not_engine_trait = [...]` in matrix/catalogue/known_failures.toml),
so a user's engine that declares a trait gets the entries of the mechanism, and one that declares
none is selected by none of them.

An engine declares its traits as class data (`traits = frozenset({...})`, base.py Engine.traits);
its compiled twin has them too, plus the engine's `compiled_traits`. The one list of them, with
what each means, is ENGINE_TRAITS; a trait not listed here is an error where it is declared
(tests/test_conditions.py) or selected (matrix/catalogue/entries.py).

The traits also say which family of engines a loss curve is judged with (curve_family): engines
whose library legitimately rounds a training step another way get rows measured on their own kind
(matrix/results/curves.py FAMILIES, matrix/checks/tolerances.py).
"""

from __future__ import annotations

ENGINE_TRAITS: dict[str, str] = {
    "casts-parameters": (
        "under a *-mixed precision the library casts the parameters to the half dtype itself (FSDP2's "
        "MixedPrecisionPolicy param_dtype, DeepSpeed's bf16/fp16 module): a layer's weights, and so its "
        "inputs from the layers before it, are half whether or not autocast is on"
    ),
    "compiles-under-autocast": (
        "a compiled twin whose loop enters the precision's autocast outside the compiled model: the graph "
        "is traced under that autocast and casts every matmul's operands itself"
    ),
    "steps-master-weights": (
        "the library's optimizer wrapper keeps fp32 master weights of the module it cast to the half dtype and "
        "steps those with the module's half gradients (DeepSpeed's bf16/fp16 optimizers and ZeRO stages)"
    ),
}

# the trait that puts an engine in a curve family (matrix/results/curves.py FAMILIES), the first one it declares
CURVE_FAMILY_BY_TRAIT: dict[str, str] = {
    "steps-master-weights": "master-weights",
    "casts-parameters": "casts-parameters",
}


def curve_family(traits: frozenset[str]) -> str:
    """The family whose measured spread an engine's loss curves are judged by (matrix/checks/tolerances.py):
    that of its first trait in CURVE_FAMILY_BY_TRAIT, else the default (the torch loop's own)."""
    from matrix.results.curves import DEFAULT_FAMILY

    return next((family for trait, family in CURVE_FAMILY_BY_TRAIT.items() if trait in traits), DEFAULT_FAMILY)
