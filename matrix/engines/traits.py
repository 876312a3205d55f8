"""Engine traits: what an engine's library does to a cell that a catalogue entry can select by
(`engine_trait = ["casts-parameters"]`, `not_engine_trait = [...]` in matrix/known_failures.toml),
so a user's engine that declares a trait gets the entries of the mechanism, and one that declares
none is selected by none of them.

An engine declares its traits as class data (`traits = frozenset({...})`, base.py Engine.traits);
its compiled twin has them too, plus the engine's `compiled_traits`. The one list of them, with
what each means, is ENGINE_TRAITS; a trait not listed here is an error where it is declared
(tests/test_engine_traits.py) or selected (matrix/catalogue.py).
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
}
