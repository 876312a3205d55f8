"""What an engine is: what one training library does to a cell, in the library's own terms.

The harness owns a cell's pipeline and makes every check (matrix/harness/pipeline.py): it builds the
model, has it trained k steps, evaluated mid-training, saved, reloaded (the kind's plain load of
an export, and the engine's own resume path), takes step k+1 on the resumed run and on the
uninterrupted one, and checks each step. An engine supplies what its library does:

    derive_settings(precision) -> settings   what the precision is called in its library, or
                                             Unsupported(reason)
    start(state, model, training) -> run     prepare model, optimizer and grad scaler
                                             (wrap, shard, deepspeed.initialize, prepare, a Trainer)
    train(state, run, steps) -> Steps        take optimizer steps, or run the library's own loop
    evaluate(state, run) -> EvalOutput       evaluate the whole batch as the library does
    save(state, run, directory)              write the library's own checkpoint
    restore(state, directory, training) -> run   resume from it, as a new process would

and how the harness sees a run (the defaults read the run's `model`, `optimizer` and `scaler`
fields; an engine whose run has other ones says how):

    module(state, run)           the module the library calls forward on (its wrapper)
    weights(state, run)          a module holding the trained weights, whole (gathered if sharded)
    master_weights(state, run)   fp32 master weights the optimizer steps, where the parameters are not
    optimizer_state(state, run)  the optimizer's state tensors (this process's shards)
    scaler_state(state, run)     the loss scaler's state, None without one
    export(state, run, directory, checkpoint)  the weights as a model the kind's own loader reads
    exported(state, run)         a plain model of what that export must read back as
    check_declared(state, run, when) the weight dtypes the library declares it holds
    dtype_changes(state, run)    the dtypes its library declares it sets once training begins

and what it releases: close(state, run) a run's resources beyond memory (DeepSpeed's engines),
cleanup(state) the library's process-wide state after a cell.

A run is the engine's own small typed object (a dataclass), whatever its library needs kept
between the calls. A view the harness cannot get, because the engine neither defines it nor has
a run with the field its default reads, is an error when the engine registers (EngineIncomplete),
never a check that silently passes.

Two bases cover the two shapes of training loop:
- Loop: a hand-written loop, or a thin wrapper's (accelerate, DDP, FSDP2, DeepSpeed's engine):
  it supplies step(state, run), one optimizer step attempt; the harness takes the steps.
- LibraryLoop: a loop the library owns (Trainer.train(), Lightning's fit()): the library runs
  the harness's schedule in one call (matrix/grid/schedule.py), and the engine's callbacks record what
  it held after step k; the harness asks for it as if the run had paused there.

A distributed engine (matrix/engines/distributed.py) is the same, run in every rank.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import enum
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path, PurePath

import torch

from matrix.checks import assertions as checks
from matrix.grid.registry import RegistrationError, Registry
from matrix.harness.compiling import plain
from matrix.harness.measurements import dropout_off_rows_loss, evaluate_rows
from matrix.harness.torch_step import take_steps, train_step
from matrix.models.base import EvalOutput
from matrix.precisions.policies import PRECISIONS, Precision, dtype_name


@dataclass(frozen=True)
class Unsupported:
    """An engine cannot express a precision: its cells skip with this reason ("Requires: [...]")."""

    reason: str


@dataclass
class Steps:
    """What train() ran: every attempt's loss over the whole batch, in order (a hand-written loop
    retries a step its grad scaler skipped), and how many optimizer steps were applied."""

    losses: list[float]
    applied: int
    # the attempts (0-based, of `losses`) a grad scaler skipped; () where none was, or unknown
    skipped: tuple[int, ...] = ()

    @property
    def applied_losses(self) -> list[float]:
        """The loss of each attempt that applied its step: the curve, whatever a scaler skipped
        (a skipped attempt leaves the weights as they were, and its step is tried again)."""
        return [loss for attempt, loss in enumerate(self.losses) if attempt not in self.skipped]


@dataclass(frozen=True)
class EngineSettings:
    """What a precision is called in an engine's library, typed. as_dict() is the record's
    `engine_settings`: every field that is not None, and one declared with metadata=ALWAYS even so,
    each as recordable() writes it (a torch.dtype by its name, a device or a path as a string).
    A field holding what a report cannot record raises SettingsUnrecordable, naming it."""

    def as_dict(self) -> dict:
        return {
            f.name: recordable(getattr(self, f.name), f"{type(self).__name__}.{f.name}")
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None or f.metadata == ALWAYS
        }


ALWAYS = {"recorded": "always"}  # field(default=..., metadata=ALWAYS): a settings field written even when None
RECORDED_TENSOR_NUMBERS = 64  # a tensor in settings is recorded as its numbers up to this many


class SettingsUnrecordable(RegistrationError):
    """An engine's settings hold a value a report cannot record (a method, an object)."""


def recordable(value, where: str):
    """`value` as results.json records it: JSON's own types as they are; a torch.dtype by its
    name ("bfloat16"), a torch.device, a path or an enum member as a string; a tensor of up to
    RECORDED_TENSOR_NUMBERS numbers as its numbers; lists, tuples, dicts and dataclasses of these
    alike. Anything else raises SettingsUnrecordable naming `where`."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, (torch.device, PurePath)):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, torch.Tensor) and value.numel() <= RECORDED_TENSOR_NUMBERS:
        return value.detach().cpu().tolist()
    if isinstance(value, (list, tuple)):
        return [recordable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): recordable(v, f"{where}[{k!r}]") for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: recordable(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value)}
    what = f"a value of type {type(value).__name__}"
    if inspect.ismethod(value) or inspect.isfunction(value):
        owner = type(value.__self__).__name__ + "." if inspect.ismethod(value) else ""
        what = f"the method {owner}{value.__name__}, not what it returns"
        if isinstance(getattr(value, "__self__", None), Precision) and value.__name__ == "autocast":
            what += " (the autocast dtype is precision.autocast_dtype)"
    elif isinstance(value, torch.Tensor):
        what = f"a tensor of {value.numel()} numbers (more than {RECORDED_TENSOR_NUMBERS})"
    raise SettingsUnrecordable(
        f"{where} holds {what}, which a report cannot record: settings hold str, int, float, bool, "
        "None, torch.dtype, torch.device, paths, enums, small tensors, or lists, dicts and dataclasses of them"
    )


class EngineContractBroken(checks.CheckFailure):
    """An engine's method returned what the harness cannot take (step(), evaluate())."""


def written_by(method) -> str:
    """Where an engine's method is defined (its file and line): what a contract failure's details
    name, so that the report points at the user's code."""
    function = getattr(method, "__func__", method)
    code = getattr(function, "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return f"{getattr(function, '__qualname__', repr(function))}{where}"


def loss_value(loss, where: str, method=None) -> float:
    """A step's loss as a float: a Python number, or a tensor holding one number (a 0-dim
    `loss.detach()` is taken as its value, as `loss.item()` would give it)."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and not loss.is_complex():
        return float(loss.detach().float().item())
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return float(loss)
    what = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
    raise EngineContractBroken(
        f"{where} returned {what} as its loss, not a number (a float or a one-number tensor)",
        details=None if method is None else f"{written_by(method)} returned {loss!r:.300}",
    )


def step_result(taken, method) -> tuple[float, bool]:
    """A hand-written loop's step() result, checked: (loss, applied), the loss a number (a
    one-number tensor taken as its float), applied a bool (or a one-element bool tensor)."""
    details = f"{written_by(method)} returned {taken!r:.300}"
    if not isinstance(taken, tuple) or len(taken) != 2:
        what = f"a tuple of {len(taken)}" if isinstance(taken, tuple) else f"a {type(taken).__name__}"
        raise EngineContractBroken(f"step() returned {what}, not (loss, applied)", details=details)
    loss, applied = taken
    if isinstance(applied, torch.Tensor) and applied.numel() == 1 and applied.dtype == torch.bool:
        applied = bool(applied.item())
    if not isinstance(applied, bool):
        raise EngineContractBroken(
            f"step() returned a {type(applied).__name__} as applied, not a bool (whether the optimizer step was taken)",
            details=details,
        )
    return loss_value(loss, "step()", method), applied


def evaluation_result(result, method, where: str = "evaluate()") -> EvalOutput:
    """An engine's evaluation, checked: an EvalOutput whose loss and logits are tensors."""
    details = f"{written_by(method)} returned {result!r:.300}"
    if not isinstance(result, EvalOutput):
        raise EngineContractBroken(
            f"{where} returned a {type(result).__name__}, not the kind's EvalOutput", details=details
        )
    for name in ("loss", "logits"):
        value = getattr(result, name)
        if not isinstance(value, torch.Tensor):
            raise EngineContractBroken(
                f"{where} returned an EvalOutput whose {name} is a {type(value).__name__}, not a tensor",
                details=details,
            )
    return result


class EngineIncomplete(RegistrationError):
    """An engine the harness cannot see into: a view it needs has no definition."""


def reads(*fields: str):
    """Mark a default view as reading these fields of the engine's run: an engine that keeps the
    default needs a Run with them (Engine.incomplete)."""

    def mark(function):
        function.reads_run = fields
        return function

    return mark


class Engine(abc.ABC):
    """One value of the engine axis: what its library does to a cell, and how the harness sees it."""

    name: str
    axis_position: int  # place in the axis' order (a user's engine: after the built-in ones)
    description: str
    # The engine's run: a dataclass holding what its library keeps between calls. The default
    # views read its `model`, `optimizer` and `scaler`.
    Run: type | None = None
    # Variant fields (matrix/grid/variants.py) the engine does not implement: exploration keeps
    # them at the grid's value for this engine. Micro-batch accumulation is wired only where
    # an engine says so.
    fixed_variant_fields: tuple[str, ...] = ("grad_accumulation",)
    distributed = False  # True: the engine runs on several ranks and reduces gradients across them
    # True: the library owns the loop and runs a fixed number of steps, skipped by its grad
    # scaler or not (the harness then checks that it ran as many as it was asked)
    owns_loop = False
    # How step k+1 of the resumed run and of the uninterrupted one get the same random numbers:
    # None: the harness seeds both alike (a loop whose steps it takes); else the library's own
    # way, in words (a library that restores its random state from its checkpoint)
    resume_random_numbers: str | None = None
    # True: the model's forward, as the library holds it, brings its own autocast (accelerate's
    # prepared forward) or none is wanted (DeepSpeed casts the module): the harness adds none
    forward_autocasts = False
    # the packages its library needs beyond torch, as pip names them (matrix/grid/packages.py): without
    # one its cells skip, and a cell run anyway (a replay) fails at once, naming it
    requires: tuple[str, ...] = ()
    # How the library is told to compile the model, in words; None: the engine has no compiled
    # twin. An engine that says how registers with register_with_compiled_twin(): its twin,
    # `<name>-compile`, is the same engine with `compiled` set (matrix/harness/compiling.py), and runs
    # only where a selection names it.
    compile_how: str | None = None
    compiled = False
    eager_twin: str | None = None  # a compiled twin's engine: the catalogue selects it as that engine
    # What the library does that catalogue entries select by (engines/traits.py ENGINE_TRAITS); the
    # compiled twin has them and `compiled_traits` too. A user's engine declaring none gets none.
    traits: frozenset[str] = frozenset()
    compiled_traits: frozenset[str] = frozenset()
    # True: the library converts the model to float8 itself (accelerate's fp8 with torchao); else
    # the harness converts it before start(), as users of the library do (matrix/precisions/float8.py)
    converts_float8 = False
    # The gradient norm the library clips to as the cells run it (its default), None: it does not
    # clip. The reference curves the cell's losses are compared with clip alike (matrix/results/curves.py).
    max_grad_norm: float | None = None

    def decayed_parameters(self, model) -> set[str] | None:
        """The names of the trainable parameters the library's AdamW applies weight decay to, as
        it builds its optimizer; None: all of them (torch.optim.AdamW over the model's parameters).
        The reference curves build theirs alike (matrix/results/curves.py)."""
        return None

    # ---------------------------------------------------------------- settings

    @abc.abstractmethod
    def derive_settings(self, precision: Precision) -> EngineSettings | Unsupported:
        """What `precision` (its autocast dtype, grad scaler, weights dtype, gradient dtype and
        accumulation) is called in this engine's library, or Unsupported(reason). The weights
        dtype itself is set by the harness's build in every engine (Precision.weights_from)."""

    def derive_or_refuse(self, precision: Precision) -> EngineSettings | Unsupported:
        if precision.reduce_dtype is not None and not self.distributed:
            return Unsupported(
                f"Requires: [gradients reduced across ranks, in {dtype_name(precision.reduce_dtype)}] "
                f"(the {self.name} engine runs one process)"
            )
        return self.derive_settings(precision)

    def settings(self, precision: Precision) -> dict:
        """The record's engine_settings: the typed settings as a dict, or why there are none."""
        derived = self.derive_or_refuse(precision)
        return {"unsupported": derived.reason} if isinstance(derived, Unsupported) else derived.as_dict()

    def unsupported_reason(self, precision: Precision) -> str | None:
        derived = self.derive_or_refuse(precision)
        return derived.reason if isinstance(derived, Unsupported) else None

    def device_skip_reason(self, device) -> str | None:
        """Why this engine cannot run on a device of the device axis here, or None: by default a
        package it requires is not installed. An engine with reasons of its own asks super() first."""
        from matrix.grid import packages

        return packages.skip_reason(self.requires)

    def require(self) -> None:
        """Raise MissingPackage where a package this engine's library needs is absent."""
        from matrix.grid import packages

        packages.require(self.requires, f"the {self.name} engine")

    def precision_device_skip_reason(self, precision: Precision, device) -> str | None:
        """Why this engine's library refuses a precision on a device of the axis here, in the
        library's own words, or None (DeepSpeed asks its accelerator)."""
        return None

    def kind_skip_reason(self, kind) -> str | None:
        """Why this engine cannot drive a model kind ("Requires: [...] (...)"), or None."""
        return None

    # ---------------------------------------------------------------- what the library does

    @abc.abstractmethod
    def start(self, state, model: torch.nn.Module, training: bool):
        """The library takes the model the harness built (in the precision's weights dtype, on
        the cell's device): wrap, shard, initialize; an optimizer and grad scaler where
        `training`. Returns the run."""

    @abc.abstractmethod
    def train(self, state, run, steps: int) -> Steps:
        """Take `steps` optimizer steps on the cell's batch (a loop the library owns: run them)."""

    @abc.abstractmethod
    def evaluate(self, state, run) -> EvalOutput:
        """Evaluate the whole batch as the library evaluates (its wrapper, its autocast)."""

    def checked_evaluation(self, result, where: str = "evaluate()") -> EvalOutput:
        """A result of this engine's evaluate(), checked as the harness reads it (evaluation_result)."""
        return evaluation_result(result, self.evaluate, where)

    @property
    def curve_family(self) -> str:
        """The family whose measured spread this engine's loss curves are judged by (traits.py)."""
        from matrix.engines.traits import curve_family

        return curve_family(self.traits)

    @abc.abstractmethod
    def save(self, state, run, directory: Path) -> None:
        """Write the library's own checkpoint of the run into `directory` (every process calls it)."""

    @abc.abstractmethod
    def restore(self, state, directory: Path, training: bool):
        """A new run from the checkpoint save() wrote, as a new process resuming would make it:
        a fresh model, the library's own loading (model, optimizer, scaler). Returns the run."""

    # ---------------------------------------------------------------- how the harness sees a run

    @reads("model")
    def module(self, state, run) -> torch.nn.Module:
        """The module the library calls forward on (its wrapper)."""
        return run.model

    @reads("model")
    def weights(self, state, run) -> torch.nn.Module:
        """A module holding the run's weights, whole, in the dtypes the run holds them (the module
        torch.compile wrapped, in a compiled twin)."""
        return plain(run.model)

    def master_weights(self, state, run) -> dict[str, torch.Tensor]:
        """The fp32 master weights the optimizer steps where they are not the parameters, by
        name; none by default."""
        return {}

    def named_master_weights(self, state, run) -> dict[str, torch.Tensor]:
        """Each trainable parameter's master weight, whole, by its name, where the optimizer steps
        a master copy the parameters are cast from (what ParametersUnchanged reads there); none
        by default: the optimizer steps the parameters themselves."""
        return {}

    def named_master_weights_at_start(self, state, run) -> dict[str, torch.Tensor]:
        """named_master_weights as the run's first step began, for a library that makes its master
        copy inside its own loop (the Trainer's DeepSpeed engine), where the harness could not read
        them before training; none by default."""
        return {}

    @reads("optimizer")
    def optimizer_state(self, state, run) -> dict[str, torch.Tensor]:
        """The optimizer's state tensors, named (this process's own shards)."""
        return {} if run.optimizer is None else checks.optimizer_state(run.optimizer)

    @reads("scaler")
    def scaler_state(self, state, run) -> dict | None:
        """The loss scaler's state, None without one."""
        return None if run.scaler is None else run.scaler.state_dict()

    def export(self, state, run, directory: Path, checkpoint: Path) -> Path:
        """Save the weights as users of the library save a model for the kind's own loader into
        `directory`; returns the directory the kind's load() reads (an engine whose own
        checkpoint, in `checkpoint`, is such a model returns that). Called in every process of
        the cell; the one that writes for the group (state.group.writes) writes."""
        weights = self.weights(state, run)  # in every rank: gathering sharded weights is a collective
        if state.group.writes:
            directory.mkdir(parents=True, exist_ok=True)
            state.kind.save(weights, directory)
        return directory

    def exported(self, state, run) -> torch.nn.Module:
        """A plain model of the kind holding what export() must read back as (no library wrapper
        around its forward)."""
        return self.weights(state, run)

    def check_declared(self, state, run, when: str) -> None:
        """The weight dtypes the library declares it holds: the precision's, by default."""
        weights = self.weights(state, run)
        checks.check_dtypes(state.kind.precision_weights(weights), state.expected_dtypes(weights), when)

    def dtype_changes(self, state, run) -> dict[str, torch.dtype]:
        """Tensors whose dtype the library declares it changes once training begins, after
        start() (a library that prepares the model inside its own loop: DeepSpeed under the
        Trainer casts the module to its half dtype): 'parameter NAME' / 'buffer NAME' -> the
        dtype. None by default: every dtype after training must be the one after start()."""
        return {}

    def dropout_off_loss(self, state, run) -> float:
        """The whole batch's training loss through the run's model with dropout off (eval mode),
        before any step: what a distributed engine's first step is compared by where the
        kind's training forward draws random numbers (each rank draws masks for its own rows)."""
        return dropout_off_rows_loss(state, self.module(state, run), autocast=not self.forward_autocasts)

    def close(self, state, run) -> None:
        """Release what a run holds beyond the process's memory (DeepSpeed's engines)."""
        return None

    def cleanup(self, state) -> None:
        """Reset the library's process-wide state after a cell (the torch engine keeps none)."""
        return None

    # ---------------------------------------------------------------- registration

    def incomplete(self) -> list[str]:
        """What the harness cannot see in this engine: each default view it keeps that reads a
        field its Run does not have."""
        run = self.Run
        fields = {f.name for f in dataclasses.fields(run)} if dataclasses.is_dataclass(run) else set()
        found = []
        for name in sorted(dir(type(self))):
            needs = getattr(getattr(type(self), name, None), "reads_run", None)
            missing = [f for f in needs or () if f not in fields]
            if missing:
                what = f"its Run ({getattr(run, '__name__', run)}) has no `{missing[0]}` field"
                found.append(f"{name}(): {what} and the engine does not define {name}()")
        return found


def compiled_twin(engine: Engine) -> Engine:
    """The engine with its library told to compile the model: `<name>-compile`."""
    if engine.compile_how is None:
        raise RegistrationError(f"engine {engine.name!r} says nothing of how its library compiles (compile_how)")
    twin = copy.copy(engine)
    twin.name, twin.compiled, twin.eager_twin = f"{engine.name}-compile", True, engine.name
    twin.traits = engine.traits | engine.compiled_traits
    twin.description = f"{engine.description}; compiled: {engine.compile_how}"
    return twin


def check_complete(engine: Engine) -> None:
    problems = engine.incomplete()
    if problems:
        raise EngineIncomplete(f"engine {engine.name!r}: the harness cannot see into its runs: " + "; ".join(problems))
    check_settings_recordable(engine)


def check_settings_recordable(engine: Engine) -> None:
    """Every registered precision's settings in this engine can be recorded, or the engine is
    refused now, in one line naming the field, before any cell runs. A derive_settings() that
    raises is left to the cells of that precision, which record the error as their failure."""
    for precision in PRECISIONS.values():
        try:
            derived = engine.derive_or_refuse(precision)
        except Exception:  # raised again, and recorded, by each cell of this precision
            continue
        if isinstance(derived, EngineSettings):
            try:
                derived.as_dict()
            except SettingsUnrecordable as exc:
                raise SettingsUnrecordable(f"engine {engine.name!r}, precision {precision.name}: {exc}") from None


ENGINES: Registry[Engine] = Registry("engine", Engine, check=check_complete)
register = ENGINES.register


def register_with_compiled_twin(engine: Engine) -> Engine:
    """Register the engine and its compiled twin (which runs only where a selection names it)."""
    module = sys._getframe(1).f_globals.get("__name__", "")  # importing it registers both elsewhere (a rank)
    ENGINES.register(engine, registered_in=module)
    ENGINES.register(compiled_twin(engine), registered_in=module)
    return engine


def one_switch_unsupported(engine: str, what: str, precision: Precision) -> Unsupported | None:
    """Why an engine whose library takes one mixed-precision switch (accelerate, the Trainer,
    Lightning) cannot be told `precision`, or None. Such a library keeps gradients in the
    weights' dtype, steps once per micro-batch, and ties the grad scaler to fp16 autocast."""
    if precision.grad_dtype is not None:
        return Unsupported(f"Requires: [{what} for gradients in another dtype than the weights]")
    if precision.grad_accumulation > 1:
        return Unsupported(f"Requires: [micro-batch accumulation wired into the {engine} engine]")
    if precision.grad_scaler != (precision.autocast_dtype == torch.float16):
        has = "with" if precision.grad_scaler else "without"
        autocast = dtype_name(precision.autocast_dtype) if precision.autocast_dtype else "no"
        return Unsupported(f"Requires: [{what} for {autocast} autocast {has} a grad scaler]")
    return None


# ---------------------------------------------------------------- hand-written loops


@dataclass
class LoopRun:
    """A hand-written loop's run: the module it calls, its optimizer and grad scaler."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scaler: torch.amp.GradScaler | None = None


class Loop(Engine):
    """A hand-written loop, or a thin wrapper's: the harness takes its optimizer steps one at a
    time, retrying one the grad scaler skipped, until as many as asked are applied; evaluation
    is the harness's own through the run's module (each rank on its rows, gathered)."""

    Run = LoopRun

    @reads("model", "optimizer", "scaler")
    def step(self, state, run) -> tuple[float, bool]:
        """One optimizer step attempt on the cell's batch: (the whole batch's mean loss, applied).
        By default the precisions' own definition: autocast around the forward, the grad scaler
        around backward and step (measurements.train_step)."""
        return train_step(state, self.module(state, run), run.optimizer, run.scaler)

    def train(self, state, run, steps: int) -> Steps:
        self.module(state, run).train()  # an evaluation left it in eval mode

        def step():
            taken = step_result(self.step(state, run), self.step)
            state.step_ended(applied=taken[1])
            return taken

        losses, skipped = take_steps(step, steps)
        return Steps(losses, len(losses) - len(skipped), tuple(skipped))

    def evaluate(self, state, run) -> EvalOutput:
        return evaluate_rows(state, self.module(state, run), autocast=not self.forward_autocasts)


# ---------------------------------------------------------------- loops a library owns


def __getattr__(name: str):  # LibraryLoop and its parts are library_loop.py's now: the old path, for one release
    from matrix.results.module_moves import forwarded

    return forwarded("matrix.engines.base", name)
