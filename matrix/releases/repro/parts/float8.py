"""A float8 precision written out (torchao float8 training, matrix/precisions/float8.py): every model the
precision builds or reloads has its Linear layers converted with torchao's
convert_to_float8_training and the recipe's Float8LinearConfig, as users convert before handing
a model to their loop; the Linear layers left out are the first and the last, and any whose
features are not multiples of 16 (torch._scaled_mm's requirement), as accelerate's default filter
leaves them. The run's model must hold float8 layers after the engine started it. Not imported:
its text follows the phases and precedes main; it wraps build() and reload()."""

from torchao.float8 import Float8LinearConfig, convert_to_float8_training


def linear_names(model):
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def float8_left_out(model):
    """The Linear layers the conversion leaves in high precision, each with its reason."""
    names = linear_names(model)
    ends = {names[0]: "the first Linear layer", names[-1]: "the last Linear layer"} if names else {}
    reasons = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if name in ends:
            reasons[name] = ends[name]
        elif module.in_features % FLOAT8_DIVISOR or module.out_features % FLOAT8_DIVISOR:
            reasons[name] = f"{module.in_features} x {module.out_features} features, not multiples of {FLOAT8_DIVISOR}"
    return reasons


def float8_converted(model, float8):
    """convert_to_float8_training over the model with the recipe's config and the filter (in place)."""
    excluded = float8_left_out(model)
    return convert_to_float8_training(
        model,
        config=Float8LinearConfig.from_recipe_name(float8["recipe"]),
        module_filter_fn=lambda module, fqn: fqn not in excluded,
    )


build_unconverted, reload_unconverted = build, reload


def build(precision):
    model = build_unconverted(precision)
    return model if precision.get("float8") is None else float8_converted(model, precision["float8"])


def reload(directory, precision):
    model = reload_unconverted(directory, precision)
    return model if precision.get("float8") is None else float8_converted(model, precision["float8"])


engine_start_plain = ENGINE.start


def start_in_float8(model, training):
    """The run's model, as the engine holds it after start, has float8 layers (a run holding none
    is not training in float8)."""
    run = engine_start_plain(model, training)
    held = [name for name, module in ENGINE.weights(run).named_modules() if type(module).__name__ == "Float8Linear"]
    compared("CheckFailure", "float8 layers after prepare", len(held), "at least 1", "none missing", bool(held))
    if not held:
        raise CheckFailed("CheckFailure", "float8: the run's model holds no float8 layer after prepare")
    return run


ENGINE.start = start_in_float8
