"""torch.compile in a cell: an engine's compiled twin (`torch-compile`, `accelerate-compile`, ...)
runs the same pipeline as the engine, with its library told to compile the model in its own
terms (a hand-written loop: torch.compile(model); accelerate: its dynamo plugin; the Trainer:
TrainingArguments(torch_compile=True); Lightning: the LightningModule's model compiled), and the
harness watches what Dynamo does:

- graphs compiled, per phase and per training step: steps after the first compile nothing (the
  batch, the dtypes and the modes are the same), else the cell fails `Recompiled`, naming the
  guards that failed;
- graph breaks and frames Dynamo gave up on (they ran eagerly): recorded, never hidden;
- the evaluation against the eager twin (the same weights, evaluated without compile): the same
  logits dtype, and a loss within the compiled-vs-eager row (matrix/checks/tolerances.py).

Dynamo's in-memory caches are reset at the start of each compiled cell (a code object compiled
for eight cells' dtypes would reach its recompile limit and fall back to eager); Inductor's FX
graph cache and AOTAutograd's cache on disk (TORCHINDUCTOR_CACHE_DIR) make a graph compiled by
an earlier cell, or an earlier run, cost a cache lookup.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from matrix.checks import assertions as checks

BACKEND = "inductor"


class Recompiled(checks.CheckFailure):
    """A training step after the first compiled new graphs: a guard that fails on every step."""


class NotCompiled(checks.CheckFailure):
    """A compiled twin whose library compiled no graph: compile was asked for and nothing ran compiled."""


def compile_module(model: torch.nn.Module) -> torch.nn.Module:
    """torch.compile(model), as a hand-written loop compiles its model."""
    return torch.compile(model, backend=BACKEND)


def plain(module: torch.nn.Module) -> torch.nn.Module:
    """The module torch.compile wrapped (its weights, its eager forward); any other module as it is."""
    return module._orig_mod if isinstance(module, torch._dynamo.eval_frame.OptimizedModule) else module


def compile_in_place(module: torch.nn.Module) -> None:
    """module.compile(): its forward compiled, the module and its state-dict keys as they are (as
    DeepSpeed's engine.compile() compiles its module, and FSDP2 users compile each layer)."""
    module.compile(backend=BACKEND)


@contextmanager
def eager():
    """Every compiled module and function runs its eager code inside: a module compiled in place
    (compile_in_place) has no uncompiled twin to call, so its eager twin is this stance."""
    with torch.compiler.set_stance("force_eager"):
        yield


def _counters() -> dict[str, dict[str, int]]:
    from torch._dynamo.utils import counters

    return {group: dict(values) for group, values in counters.items()}


def _count(snapshot: dict, group: str, key: str) -> int:
    return int(snapshot.get(group, {}).get(key, 0))


def first_line(reason: str) -> str:
    """A failed guard's reason without the user stack Dynamo appends to it."""
    return reason.strip().splitlines()[0][:300]


def break_reason(reason: str) -> str:
    """A graph break's reason as a record's key: its first line, and Dynamo's explanation where it
    gives one (the first line alone, "Attempted to call function marked as skipped", names
    nothing), without the hints and debug context after them."""
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[1].startswith("Explanation:"):
        return f"{lines[0]}: {lines[1].removeprefix('Explanation:').strip()}"[:300]
    return lines[0][:300] if lines else reason


@dataclass
class Watch:
    """What Dynamo compiled during one compiled cell, by phase and by training step."""

    start: dict = field(default_factory=dict)
    last: dict = field(default_factory=dict)
    by_phase: dict[str, int] = field(default_factory=dict)
    per_step: list[int] = field(default_factory=list)
    step_mark: dict | None = None

    @classmethod
    def begin(cls) -> Watch:
        """Dynamo's caches and recompilation records reset; the counters as they stand."""
        torch._dynamo.reset()
        from torch._dynamo.utils import guard_failures

        guard_failures.clear()
        now = _counters()
        return cls(start=now, last=now)

    def graphs_since(self, snapshot: dict) -> int:
        return _count(_counters(), "stats", "unique_graphs") - _count(snapshot, "stats", "unique_graphs")

    def phase_ended(self, phase: str) -> None:
        self.by_phase[phase] = self.by_phase.get(phase, 0) + self.graphs_since(self.last)
        self.last = _counters()

    def training_started(self) -> None:
        self.per_step, self.step_mark = [], _counters()

    def step_ended(self) -> None:
        if self.step_mark is None:
            return
        self.per_step.append(self.graphs_since(self.step_mark))
        self.step_mark = _counters()

    def training_ended(self) -> None:
        self.step_mark = None

    def record(self) -> dict:
        from torch._dynamo.utils import guard_failures

        now = _counters()
        delta = lambda group, key: _count(now, group, key) - _count(self.start, group, key)  # noqa: E731
        breaks: dict[str, int] = {}
        for reason, count in now.get("graph_break", {}).items():
            new = count - self.start.get("graph_break", {}).get(reason, 0)
            if new > 0:
                key = break_reason(reason)
                breaks[key] = breaks.get(key, 0) + new
        reasons = sorted({first_line(reason) for failures in guard_failures.values() for reason in failures})
        return {
            "graphs_by_phase": dict(self.by_phase),
            "graphs_per_training_step": list(self.per_step),
            "frames_run_eagerly": delta("frames", "total") - delta("frames", "ok"),
            "graph_breaks": breaks,
            "recompile_reasons": reasons[:20],
            "cache": {
                "fx_graph_hits": delta("inductor", "fxgraph_cache_hit"),
                "fx_graph_misses": delta("inductor", "fxgraph_cache_miss"),
                "aot_autograd_hits": delta("aot_autograd", "autograd_cache_hit"),
                "aot_autograd_misses": delta("aot_autograd", "autograd_cache_miss"),
            },
        }

    def check_compiled(self, what: str) -> None:
        """Compile was asked for: the model's forwards so far compiled at least one graph."""
        if self.graphs_since(self.start) == 0:
            raise NotCompiled(
                f"compile was asked for and {what} compiled no graph",
                details=f"graphs by phase {self.by_phase}; frames Dynamo saw: "
                f"{_count(_counters(), 'frames', 'total') - _count(self.start, 'frames', 'total')}",
            )

    def check_steps(self) -> None:
        """Steps after the first compile nothing: the same batch, dtypes and modes."""
        from matrix.grid.schedule import train_steps

        # the first run's steps 2..k: a library's loop runs on past step k (its evaluation and the
        # step k+1 the resume is compared with), where a new grad mode compiles again by design
        later = self.per_step[1 : train_steps()]
        if any(later):
            from torch._dynamo.utils import guard_failures

            reasons = sorted({first_line(reason) for failures in guard_failures.values() for reason in failures})
            raise Recompiled(
                "training steps after the first compiled new graphs",
                details=f"graphs per step {self.per_step}; failed guards: {'; '.join(reasons[:3]) or 'none recorded'}",
            )
