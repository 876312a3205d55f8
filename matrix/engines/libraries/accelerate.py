"""accelerate's process-wide state, which every engine on accelerate (accelerate, the Trainer,
accelerate-fsdp2) forgets after a cell and before a resumed run, as a new process would; and
that resumed run (resume_from_saved_state: a new Accelerator, then load_state); and the
Accelerator's kwargs handlers for a float8 precision (fp8_handlers)."""

from __future__ import annotations


def reset_accelerate() -> None:
    """The Accelerator's state is a process-wide singleton (a shared dict): forget it."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def resume_from_saved_state(engine, state, directory, training: bool):
    """A resumed run as a new process starts it: a new Accelerator over a fresh model and its
    optimizer (engine.start), then Accelerator.load_state of what save_state wrote."""
    reset_accelerate()
    run = engine.start(state, state.fresh_model(for_engine=True), training)
    run.accelerator.load_state(str(directory))
    return run


def fp8_handlers(state) -> list:
    """mixed_precision="fp8" with torchao's recipe: the AORecipeKwargs that carry the precision's
    Float8LinearConfig (matrix/precisions/float8.py); prepare() converts the model's Linear layers with it."""
    from accelerate.utils import AORecipeKwargs

    return [AORecipeKwargs(config=state.precision.float8.config())]
