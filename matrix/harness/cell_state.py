"""What the harness knows of one cell while it runs (in its process, or in each rank): the cell,
its model kind, precision, device and engine, the batch, the process group, and what the
pipeline's phases hand to each other (matrix/harness/pipeline.py). Every field is typed; an engine keeps
its own state in its run (matrix/engines/base.py), not here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from matrix.devices import DEVICES, Device
from matrix.grid.cell import Cell
from matrix.harness.group import SINGLE, Group
from matrix.harness.library_clock import LibraryClock
from matrix.models import ModelKind, declared_dtypes
from matrix.models.base import EvalOutput
from matrix.precisions.policies import Precision
from matrix.results.metrics import CellMetrics


@dataclass
class FirstForwardHooks:
    """The two global forward pre-hooks the harness puts up when it builds a cell's model: one
    records the autocast in force in the model's first forward, one seeds the global generator
    right before its first training forward (measurements.watch_first_forward,
    seed_first_training_forward). `paused`: a forward the harness makes itself is not the one
    they wait for."""

    handles: list = field(default_factory=list)
    paused: bool = False
    seeds: object | None = None  # the seeding hook's handle: removed after the first train_steps() steps

    def stop_seeding(self) -> None:
        if self.seeds is not None:
            self.seeds.remove()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


@dataclass
class ResumePoint:
    """What the interrupted run held when its checkpoint was written (matrix/harness/resume.py)."""

    optimizer_state: dict[str, torch.Tensor]
    scaler_state: dict | None


@dataclass
class Saved:
    """The checkpoint_save phase's result: where the engine's own checkpoint and the plain export
    are, and what the export must read back as."""

    checkpoint: Path  # the engine's own checkpoint (its resume path reads it)
    export: Path  # the weights as a model the kind's own loader reads
    exported: torch.nn.Module  # a plain model of the kind holding what the export must give back
    exported_logits: torch.Tensor  # its evaluation, as the run evaluated (round_trips.evaluate_as_run)
    run_logits: torch.Tensor  # the run's own evaluation as saved: what the engine's resume path must give back


@dataclass
class CellState:
    """What the phases of one cell hand to each other."""

    cell: Cell
    kind: ModelKind
    precision: Precision
    device: torch.device
    workdir: Path
    metrics: CellMetrics  # what the phases measured: the cell record's metrics
    engine: object | None = None  # the matrix.engines.Engine that drives the cell
    settings: object | None = None  # the engine's typed settings for the precision (EngineSettings)
    group: Group = SINGLE
    batch: dict | None = None
    # time.monotonic() by which the cell must be done (its --cell-timeout), or None: what an
    # engine that waits on other processes (the ranks) waits for at most
    deadline: float | None = None
    hooks: FirstForwardHooks = field(default_factory=FirstForwardHooks)
    # seeded_training_loss of a fresh model: the loss-decrease check's "before" and the
    # cross-engine check's torch-engine yardstick in training, measured once per cell
    loss_before_training: float | None = None
    # the learning rate, established on demand (the pipeline sets how: kind_traits)
    rate: Callable[[], float] | None = None
    in_ranks: bool = False  # a distributed engine's driver: the ranks hold the cell (engines/distributed.py)
    # a compiled twin's view of what Dynamo compiles (matrix/harness/compiling.py), from build on
    compile_watch: object | None = None
    steps_ended: int = 0  # training steps (attempts) the engine ended so far in this process
    steps_applied: int = 0  # of those, the ones that applied their optimizer step
    # ---- what the pipeline's phases hand on
    run: object | None = None  # the engine's run: its model, optimizer, scaler, in its own types
    restored: object | None = None  # the run the engine resumed from its own checkpoint
    evaluation: EvalOutput | None = None  # the last evaluation of `run`, taken with no step since
    point: ResumePoint | None = None
    saved: Saved | None = None

    @classmethod
    def begin(
        cls,
        cell: Cell,
        kind: ModelKind,
        precision: Precision,
        device: torch.device,
        workdir: Path,
        *,
        engine=None,
        group: Group = SINGLE,
        deadline: float | None = None,
        batch: dict | None = None,
    ) -> CellState:
        """The one way a cell's state is made: a cell in this process (matrix/execute/cell_run.py), a
        rank's (matrix/execute/ranks.py), the harness's own fp32 measurement (measurements.py). Its
        metrics start with what the precision declares and what the engine derives from it."""
        state = cls(
            cell=cell,
            kind=kind,
            precision=precision,
            device=device,
            workdir=workdir,
            metrics=CellMetrics(declared=precision.settings()),
            engine=engine,
            settings=None if engine is None else engine.derive_or_refuse(precision),
            group=group,
            batch=batch,
            deadline=deadline,
        )
        if engine is not None:
            state.metrics.engine_settings = engine.settings(precision)
            state.engine = LibraryClock(engine, state.metrics)
        return state

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def device_kind(self) -> Device:
        """The device axis' entry the cell runs on (matrix/devices/)."""
        return DEVICES[self.cell.device]

    @property
    def training(self) -> bool:
        return self.cell.mode == "train"

    @property
    def shared_dir(self) -> Path:
        """Where the checkpoints every process of the cell reads are written."""
        return self.group.shared_dir or self.workdir

    @property
    def learning_rate(self) -> float:
        """AdamW's learning rate in every engine: the kind's own, else the one calibrated for it
        (matrix/harness/learning_rate.py); recorded in the cell's metrics."""
        if self.rate is None:
            raise RuntimeError("no learning rate was set up for this cell (the pipeline sets it at build)")
        return self.rate()

    def autocast(self):
        """The precision's autocast on the cell's device (a null context without one)."""
        return self.precision.autocast(self.device_type)

    def new_grad_scaler(self) -> torch.amp.GradScaler | None:
        return self.precision.make_grad_scaler(self.device_type)

    def new_optimizer(self, model, decayed: set[str] | None = None) -> torch.optim.Optimizer:
        """AdamW over the model's trainable parameters, at the cell's learning rate; `decayed`: the
        names of those weight decay applies to (AdamW's default 0.01), the others none."""
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if decayed is None:
            return torch.optim.AdamW([p for _, p in trainable], lr=self.learning_rate)
        groups = [
            {"params": [p for n, p in trainable if n in decayed]},
            {"params": [p for n, p in trainable if n not in decayed], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=self.learning_rate)

    def fresh_model(self, precision: Precision | None = None, for_engine: bool = False) -> torch.nn.Module:
        """A fresh model of the kind in `precision` (the cell's by default), as every engine starts
        from it (built deterministically), the global generators left as they were. A float8
        precision's model is converted (matrix/precisions/float8.py), except one handed to an engine whose
        library converts it itself (`for_engine`)."""
        precision = precision or self.precision
        with torch.random.fork_rng(devices=self.device_kind.rng_devices(self.device)):
            return self.converted(self.built(precision), precision, for_engine)

    def built(self, precision: Precision) -> torch.nn.Module:
        """The kind's build in `precision` on the cell's device, holding the run's saved initial
        weights where it has some (matrix/models/initial_weights.py)."""
        from matrix.models import initial_weights

        return initial_weights.apply(self.kind, self.kind.build(precision, self.device, self.workdir), precision)

    def converted(self, model: torch.nn.Module, precision: Precision, for_engine: bool = False) -> torch.nn.Module:
        """The model as a float8 precision trains it: its Linear layers converted with the
        precision's recipe, as users convert before handing a model to their library; as it is
        for any other precision, and for an engine whose library converts it (accelerate's fp8)."""
        if precision.float8 is None or (for_engine and getattr(self.engine, "converts_float8", False)):
            return model
        from matrix.precisions.float8 import convert

        return convert(model, precision.float8)

    def step_ended(self, applied: bool = True) -> None:
        """An engine's training step ended (a loop's, or a library's callback), applied or skipped
        by a grad scaler: counted, and what it compiled."""
        self.steps_ended += 1
        self.steps_applied += applied
        if self.compile_watch is not None:
            self.compile_watch.step_ended()

    def scratch_model(self, precision: Precision | None = None) -> torch.nn.Module:
        """A fresh model of the kind in `precision` for the harness's own comparisons (an fp32
        reference, a copy free of a library's wrappers), never handed to an engine nor saved: a
        copy of one built once per process for the kind, variant, precision and device (building
        costs more than copying). A quantized base is built each time."""
        precision = precision or self.precision
        if precision.quantization is not None:
            return self.fresh_model(precision)
        from matrix.models.initial_weights import current as initial_weights

        key = (type(self.kind), self.kind.name, self.kind.variant, precision.name, str(self.device), initial_weights())
        pristine = _PRISTINE.pop(key, None)
        if pristine is None:
            pristine = self.fresh_model(precision)
        _PRISTINE[key] = pristine  # the most recently used last
        while len(_PRISTINE) > PRISTINE_KEPT:
            _PRISTINE.pop(next(iter(_PRISTINE)))
        return copy.deepcopy(pristine)

    def load(self, directory: Path) -> torch.nn.Module:
        """The kind's own load of a checkpoint directory in the cell's precision (from_pretrained
        and the like), read from the files each time: a copy of an earlier load would hold its
        weights in other memory than a load does (memory-mapped, as safetensors leaves them),
        which some kernels compute differently with (cpu-grouped-mm-depends-on-weight-alignment)."""
        return self.converted(self.kind.load(directory, self.precision, self.device, self.workdir), self.precision)

    def eval_grad_context(self):
        """The grad mode evaluation runs in: no_grad, or inference_mode if the variant says so."""
        return torch.inference_mode() if self.kind.variant.eval_grad_mode == "inference_mode" else torch.no_grad()

    def expected_dtypes(self, model) -> dict:
        """The dtype each of the kind's precision weights must have: the precision's, or fp32
        where the architecture declares a module fp32 and from_pretrained obtained the model."""
        weights = self.kind.precision_weights(model)
        if self.precision.quantization is not None:
            from matrix.precisions.quantization import storage_expectations

            return storage_expectations(model, weights, self.precision.quantization, self.precision.weights_dtype)
        loaded = self.kind.loaded_in_dtype(self.precision, reloaded=False)
        return declared_dtypes.expected_dtypes(weights, model, self.precision.weights_dtype, loaded)


# CellState.scratch_model's models, as built: (kind class, name, variant, precision, device) ->
# model, the least recently used first. A cell asks for two (fp32 and its own precision), and the
# cells of one model and precision run one after another (the engine axis varies fastest); more
# would hold a pretrained model per precision and explored variant to the end of a run.
PRISTINE_KEPT = 4
_PRISTINE: dict[tuple, torch.nn.Module] = {}
