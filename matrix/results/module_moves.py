"""Where each module of the flat package (before the concept folders, issue 49) lives now.

Two readers. Signature ids (signatures.py) are made of module names: a failure raised in the
matrix's own code takes its origin (module:function) and its type (module.Class) from the module
it was raised in, so they are written with the module's old name and a nightly diff across the
move reports no harness-raised failure as new. And matrix/__init__.py resolves the old import
paths to the new modules, with a DeprecationWarning, for one release (docs/extending.md).
Standard library only.
"""

from __future__ import annotations

# old module -> the module it became
MOVED: dict[str, str] = {
    "matrix.conditions": "matrix.catalogue.conditions",
    "matrix.catalogue": "matrix.catalogue.entries",
    "matrix.checks": "matrix.checks.assertions",
    "matrix.tolerances": "matrix.checks.tolerances",
    "matrix.environment": "matrix.devices.fingerprint",
    "matrix.extension_builds": "matrix.engines.libraries.extension_builds",
    "matrix.cell_environment": "matrix.execute.environment_variables",
    "matrix.rank_pool": "matrix.execute.rank_pool",
    "matrix.rank_worker": "matrix.execute.rank_worker",
    "matrix.execute": "matrix.execute.cell_run",
    "matrix.explore": "matrix.explore.exploration",
    "matrix.strategies": "matrix.explore.strategies",
    "matrix.cell": "matrix.grid.cell",
    "matrix.modes": "matrix.grid.modes",
    "matrix.packages": "matrix.grid.packages",
    "matrix.registry": "matrix.grid.registry",
    "matrix.schedule": "matrix.grid.schedule",
    "matrix.variants": "matrix.grid.variants",
    "matrix.cell_state": "matrix.harness.cell_state",
    "matrix.compiling": "matrix.harness.compiling",
    "matrix.global_state": "matrix.harness.global_state",
    "matrix.group": "matrix.harness.group",
    "matrix.kind_setup": "matrix.harness.kind_setup",
    "matrix.kind_traits": "matrix.harness.kind_traits",
    "matrix.learning_rate": "matrix.harness.learning_rate",
    "matrix.measurements": "matrix.harness.measurements",
    "matrix.pipeline": "matrix.harness.pipeline",
    "matrix.resume": "matrix.harness.resume",
    "matrix.declared_dtypes": "matrix.models.declared_dtypes",
    "matrix.initial_weights": "matrix.models.initial_weights",
    "matrix.observation": "matrix.models.observation",
    "matrix.pytest_cases": "matrix.plugin.cases",
    "matrix.plugin": "matrix.plugin.hooks",
    "matrix.internal_errors": "matrix.run.internal_errors",
    "matrix.options": "matrix.run.options",
    "matrix.runner": "matrix.run.supervisor",
    "matrix.float8": "matrix.precisions.float8",
    "matrix.precisions": "matrix.precisions.policies",
    "matrix.quantization": "matrix.precisions.quantization",
    "matrix.bisect": "matrix.releases.bisection",
    "matrix.release_bisect": "matrix.releases.new_failures",
    "matrix.stacks": "matrix.releases.stacks",
    "matrix.sweep": "matrix.releases.sweep",
    "matrix.triage": "matrix.releases.triage",
    "matrix.curves": "matrix.results.curves",
    "matrix.recording": "matrix.results.recording",
    "matrix.signatures": "matrix.results.signatures",
    "matrix.selection": "matrix.selection.cells",
    "matrix.results.merge": "matrix.shards.merge",
    "matrix.shards": "matrix.shards.plan",
    "matrix.bench": "matrix.tools.bench",
    "matrix.bench_probe": "matrix.tools.bench_probe",
    "matrix.curve_spread": "matrix.tools.curve_spread",
    "matrix.import_graph": "matrix.tools.import_graph",
}
# folders moved whole: an old prefix -> its new prefix
MOVED_FOLDERS: dict[str, str] = {
    "matrix.libraries": "matrix.engines.libraries",
    "matrix.repro": "matrix.releases.repro",
}
# an old module split along its concepts: the modules its code went to (the first is the module it
# became); each took its code from this one old module only
SPLIT_INTO: dict[str, tuple[str, ...]] = {
    "matrix.pipeline": (
        "matrix.harness.pipeline",
        "matrix.harness.consensus",
        "matrix.harness.against_references",
        "matrix.harness.compiled_checks",
        "matrix.harness.round_trips",
    ),
    "matrix.measurements": (
        "matrix.harness.measurements",
        "matrix.harness.garbage",
        "matrix.harness.torch_step",
        "matrix.harness.reference_curves",
        "matrix.harness.fp32_training",
    ),
    "matrix.engines.base": ("matrix.engines.base", "matrix.engines.library_loop"),
    "matrix.engines.distributed": ("matrix.engines.distributed", "matrix.execute.ranks"),
    "matrix.plugin": (
        "matrix.plugin.hooks",
        "matrix.plugin.session",
        "matrix.plugin.parametrize",
        "matrix.plugin.fixtures",
        "matrix.plugin.recorder",
        "matrix.explore.clock",
    ),
}
# new module -> the old name its signatures are written with
SIGNATURE_NAMES: dict[str, str] = {
    **{new: old for old, new in MOVED.items()},
    **{new: old for old, news in SPLIT_INTO.items() for new in news if new != old},
}


# the flat package's own files and folders: a traceback recorded before the folders names them
FLAT_ENTRIES = frozenset(
    {old.split(".")[1] + ".py" for old in MOVED if old.count(".") == 1}
    | {old.split(".")[1] for old in MOVED_FOLDERS}
    | {"known_failures.toml", "stacks.toml", "releases.toml", "curve_spread.json"}
)


def signature_name(module: str) -> str:
    """The name a module's failures are signed with: its name before the folders, where it had one."""
    if module in SIGNATURE_NAMES:
        return SIGNATURE_NAMES[module]
    for new, old in MOVED_FOLDERS.items():
        if module.startswith(old + "."):
            return new + module[len(old) :]
    return module


def new_name(old: str) -> str | None:
    """The module an old import path names now, or None where it names no moved module."""
    if old in MOVED and MOVED[old] != old:
        return MOVED[old]
    for prefix, new in MOVED_FOLDERS.items():
        if old == prefix or old.startswith(prefix + "."):
            return new + old[len(prefix) :]
    return None


def forwarded(old: str, name: str, folder: list[str] | None = None):
    """An attribute the flat module `old` had, read from the module that has it now, with a
    DeprecationWarning: a folder named as an old module (`folder`: its __path__), or a module
    split, calls this from its __getattr__. A module of the folder is not an attribute to forward:
    the import system imports it once this says there is no such attribute."""
    import importlib
    import warnings
    from pathlib import Path

    for place in folder or ():
        if (Path(place) / f"{name}.py").is_file() or (Path(place) / name / "__init__.py").is_file():
            raise AttributeError(f"module {old!r} has no attribute {name!r}")

    for target in SPLIT_INTO.get(old, (MOVED.get(old, old),)):
        module = importlib.import_module(target)
        if name in vars(module):
            warnings.warn(
                f"{old}.{name} is {target}.{name} now; the old path goes in the next release",
                DeprecationWarning,
                stacklevel=3,
            )
            return vars(module)[name]
    raise AttributeError(f"module {old!r} has no attribute {name!r}")
