"""Tiny configs for any transformers causal LM, by model_type, from rules kept as data.

The rules live in hf_shrink_rules.toml beside this file; this module only interprets them:

- the variant's fields and [constants] are the quantities; [quantities] derives more from them;
- [aliases] names, per quantity, the config attributes that take its value in every config and
  sub-config that declares them, where the default is set (None, 0 or False stays: an alias
  shrinks a feature, it never switches one on); [always] the same, set whatever the default;
- [per_layer] names the lists with one entry per layer: made as long as the layers, each distinct
  entry of the default first;
- [family.NAME] tables hold what some model types share: `types`, `set` (attribute = rule, applied
  at every config level whose model_type is listed, after the above; "a.b" is b of sub-config a)
  and `why`;
- [unsupported] maps a model_type to the reason it cannot be built tiny here.

A rule is a TOML literal or a string holding an expression: a name is an attribute of the config
being shrunk (its value set so far, else its default), else a quantity; the operators are
+ - * / // %, indexing, and the functions in _FUNCTIONS.

config_overrides() is what tiny_config() passes to the config class: ConfigClass(**overrides)
rebuilds the same config (sub-configs given as dicts). transformers is imported inside the
functions: importing this module does not import it (nor torch).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import operator
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from matrix.grid.variants import Variant

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

RULES_PATH = Path(__file__).with_name("hf_shrink_rules.toml")
DEFAULT_VARIANT = Variant()  # frozen: safe as a default argument


class Unsupported(Exception):
    """Why a model type cannot be built tiny here (str() is the one-line reason)."""


@functools.cache
def rules() -> dict[str, Any]:
    """The rules file, parsed (read once)."""
    with RULES_PATH.open("rb") as handle:
        return tomllib.load(handle)


def causal_lm_types() -> tuple[str, ...]:
    """Every model_type transformers maps to a causal LM class, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


def tiny_config(model_type: str, variant: Variant = DEFAULT_VARIANT) -> PreTrainedConfig:
    """A transformers config for `model_type` with the variant's tiny sizes; Unsupported if none can be built."""
    config_class = _config_class(model_type)
    overrides = config_overrides(model_type, variant)
    try:
        return config_class(**overrides)
    except Exception as error:
        raise Unsupported(f"{config_class.__name__} rejects the tiny sizes: {_one_line(error)}") from error


def config_overrides(model_type: str, variant: Variant) -> dict:
    """The attribute values tiny_config sets on `model_type`'s config class (sub-configs as nested dicts), JSON-able."""
    reason = rules().get("unsupported", {}).get(model_type)
    if reason is not None:
        raise Unsupported(reason)
    return _shrink(_config_class(model_type), _quantities(variant), {})


# --- the interpreter -------------------------------------------------------------------------------------------


def _config_class(model_type: str) -> type:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise Unsupported(f"{model_type!r} is not a causal LM model_type of transformers")
    return CONFIG_MAPPING[model_type]


def _quantities(variant: Variant) -> dict[str, Any]:
    """The variant's fields, the constants, and the quantities derived from them, by name."""
    values: dict[str, Any] = {field.name: getattr(variant, field.name) for field in dataclasses.fields(variant)}
    values.update(rules().get("constants", {}))
    for name, rule in rules().get("quantities", {}).items():
        values[name] = _evaluate(rule, values)
    return values


def _defaults(config_class: type, given: Mapping[str, Any]) -> dict[str, Any]:
    """The config class's attribute values as its constructor sets them from `given` (field defaults if it refuses)."""
    declared = {
        field.name: None if field.default is dataclasses.MISSING else field.default
        for field in dataclasses.fields(config_class)
    }
    try:
        instance = config_class(**given)
    except Exception:
        return declared
    return {name: _attribute(instance, name, default) for name, default in declared.items()}


def _attribute(instance: Any, name: str, default: Any) -> Any:
    """An attribute of a config; `default` where reading it fails (a per-layer attribute has no global value)."""
    try:
        return getattr(instance, name, default)
    except Exception:
        return default


def _shrink(config_class: type, quantities: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """The overrides for one config level (built with the keyword arguments `given`), recursing into sub-configs."""
    table = rules()
    defaults = {**_defaults(config_class, given), **given}
    overrides: dict[str, Any] = dict(given)
    for quantity, names in table.get("aliases", {}).items():
        for name in names:
            if name in defaults and _is_set(defaults[name]):
                overrides[name] = _like(quantities[quantity], defaults[name])
    for quantity, names in table.get("always", {}).items():
        for name in names:
            if name in defaults:
                overrides[name] = _like(quantities[quantity], defaults[name])
    layers = _layer_count(overrides, quantities)
    for name in table.get("per_layer", {}).get("names", []):
        if isinstance(defaults.get(name), list | tuple) and defaults[name]:
            overrides[name] = _per_layer(list(defaults[name]), layers)
    for key, (sub_class, init_kwargs) in _sub_configs(config_class).items():
        # a composite config builds a sub-config given as a dict without its own init_kwargs: keep them
        overrides[key] = _shrink(sub_class, quantities, init_kwargs)
    for family in _families(config_class.model_type):
        for path, rule in family.get("set", {}).items():
            *parents, name = path.split(".")
            target = overrides
            for parent in parents:  # "attn_config.rope_theta": an attribute of a sub-config
                target = target.setdefault(parent, {})
            target[name] = _evaluate(rule, {**quantities, **defaults, **overrides, **target, "layers": layers})
    return overrides


def _sub_configs(config_class: type) -> dict[str, tuple[type, dict[str, Any]]]:
    """The sub-configs of a composite config: key -> (config class, the keyword arguments it is built with)."""
    from transformers import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    found: dict[str, tuple[type, dict[str, Any]]] = {}
    specs = getattr(config_class, "sub_configs_defaults", None) or {}
    for key, spec in specs.items():
        if isinstance(spec.config_class, type) and issubclass(spec.config_class, PreTrainedConfig):
            found[key] = (spec.config_class, dict(spec.init_kwargs))
        elif spec.model_type in CONFIG_MAPPING:  # an AutoConfig slot: its default model_type
            found[key] = (CONFIG_MAPPING[spec.model_type], dict(spec.init_kwargs))
    if not specs:  # older composite configs name their sub-config classes only
        for key, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
            if isinstance(sub_class, type) and issubclass(sub_class, PreTrainedConfig):
                found[key] = (sub_class, {})
    return found


def _families(model_type: str) -> list[dict[str, Any]]:
    return [family for family in rules().get("family", {}).values() if model_type in family.get("types", ())]


def _is_set(default: Any) -> bool:
    """Whether a default is a feature that is on (not None, 0, False or empty)."""
    return default is not None and default is not False and default != 0 and default != []


def _like(value: Any, default: Any) -> Any:
    """`value` as an int where the default is one and it is integral (0.0 for a dropout some config types int)."""
    if isinstance(default, int) and not isinstance(default, bool) and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _layer_count(overrides: Mapping[str, Any], quantities: Mapping[str, Any]) -> int:
    for name in rules().get("aliases", {}).get("num_layers", ()):
        if name in overrides:
            return int(overrides[name])
    return int(quantities["num_layers"])


def _per_layer(default: list, layers: int) -> list:
    """`default` made `layers` long: each distinct entry once, in order of first appearance, then `default` cycled."""
    distinct: list = []
    for entry in default:
        if entry not in distinct:
            distinct.append(entry)
    return distinct[:layers] + [default[index % len(default)] for index in range(len(distinct), layers)]


# --- expressions ----------------------------------------------------------------------------------------------

_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "min": min,
    "max": max,
    "int": int,
    "len": len,
    "list": list,
    "range": range,
    "per_layer": _per_layer,
    "repeat": lambda pattern, count: [pattern[index % len(pattern)] for index in range(count)],
}


def _evaluate(rule: Any, scope: Mapping[str, Any]) -> Any:
    """A rule's value: a TOML literal as it is, a string as an expression over `scope`."""
    if not isinstance(rule, str):
        return rule
    return _node(ast.parse(rule, mode="eval").body, scope)


def _node(node: ast.AST, scope: Mapping[str, Any]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in scope:
            return scope[node.id]
        raise KeyError(f"unknown name {node.id!r} in a shrink rule")
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_node(node.left, scope), _node(node.right, scope))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_node(node.operand, scope)
    if isinstance(node, ast.List | ast.Tuple):
        return [_node(element, scope) for element in node.elts]
    if isinstance(node, ast.Dict):
        return {_node(key, scope): _node(value, scope) for key, value in zip(node.keys, node.values, strict=True)}
    if isinstance(node, ast.Subscript):
        return _node(node.value, scope)[_node(node.slice, scope)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        return _FUNCTIONS[node.func.id](*(_node(argument, scope) for argument in node.args))
    raise ValueError(f"unsupported expression in a shrink rule: {ast.unparse(node)}")


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"
