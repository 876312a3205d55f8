"""The mode axis. A train cell trains, evaluates mid-training, checkpoints and resumes;
an eval cell evaluates a fresh model (model.eval(), no_grad) and checkpoints it."""

MODES: tuple[str, ...] = ("train", "eval")
