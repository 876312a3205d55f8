"""A kind's one-time work, done before its first cell under a budget of its own: observing the
model (matrix/models/observation.py), searching its learning rate (matrix/harness/learning_rate.py) and checking
which tensors that rate cannot move in bf16 (matrix/harness/kind_traits.py). Each is cached for the rest of
the process, so every later cell of the kind reads it; the first cell's timeout covers only the
cell. Its record is a line of the report's "One-time work per kind". No pytest.

What goes wrong here is recorded, not raised: a failure (the kind cannot be observed, its fp32 twin
does not train) is left to the cells, which meet the same error in their own phase and record it
with the signature they always had; running out of the budget stops the work, and the kind's
cells in this process then fail at once with KindSetupTimedOut instead of starting the same
work again (a new process, python -m matrix run's after a crash, tries once more)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field

# the budget of a kind's one-time work (--kind-setup-timeout): a pretrained kind's learning-rate search
# on a loaded 2-core machine, with room
KIND_SETUP_TIMEOUT_S = 600.0


class KindSetupTimedOut(BaseException):
    """The kind's one-time work ran past its budget (--kind-setup-timeout). A BaseException, as
    pytest-timeout's is: the work it stops (an observation that records what fails, a search that
    tries the next candidate) must not take it for a failure of its own and go on."""


@dataclass
class KindSetup:
    """One process's one-time work for a kind, as the report shows it."""

    kind: str
    training: bool  # the learning rate and the bf16 check are a training cell's; eval observes only
    budget_s: float
    steps: dict[str, float] = field(default_factory=dict)  # what was established -> seconds
    seconds: float = 0.0
    outcome: str = "done"  # done | failed | timed out
    error: str | None = None  # the failure's first line, or what was running when the budget ran out
    pid: int = field(default_factory=os.getpid)

    def as_dict(self) -> dict:
        return asdict(self)


_DONE: dict[tuple, KindSetup] = {}


def _key(kind, training: bool) -> tuple:
    return (type(kind), kind.name, repr(kind.variant), training)


def blocking(kind) -> KindSetup | None:
    """The timed-out setup that stops this kind's cells in this process, if there is one: its
    work would start again from where it ran out of time."""
    for training in (False, True):
        done = _DONE.get(_key(kind, training))
        if done is not None and done.outcome == "timed out":
            return done
    return None


def establish(kind, training: bool, budget_s: float = KIND_SETUP_TIMEOUT_S) -> KindSetup | None:
    """Do the kind's one-time work now. Returns its record, or None where this process has done
    it already (or a training setup covered an eval cell's)."""
    if _key(kind, training) in _DONE or (not training and _key(kind, True) in _DONE) or blocking(kind):
        return None
    from matrix.harness.kind_traits import bf16_stalled_tensors, kind_learning_rate
    from matrix.models.observation import observe

    setup = KindSetup(kind=kind.name, training=training, budget_s=budget_s)
    _DONE[_key(kind, training)] = setup
    work = [("observation", lambda: observe(kind))]
    if training:
        work.append(("learning rate", lambda: kind_learning_rate(kind)))
        if getattr(kind, "traits", None) is None:  # traits it declares are not observed or derived
            work.append(("bf16 step check", lambda: bf16_stalled_tensors(kind, kind_learning_rate(kind).value)))
    began = time.perf_counter()
    current = None
    try:
        with _budget(budget_s):
            for current, do in work:
                step_began = time.perf_counter()
                do()
                setup.steps[current] = round(time.perf_counter() - step_began, 3)
    except KindSetupTimedOut:
        setup.outcome = "timed out"
        setup.error = f"{current} was running when the budget of {budget_s:g} s ran out"
    except Exception as exc:  # recorded here; the cells meet it again in their own phase
        setup.outcome = "failed"
        setup.error = f"{current}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    setup.seconds = round(time.perf_counter() - began, 3)
    return setup


@contextlib.contextmanager
def _budget(seconds: float):
    """Raise KindSetupTimedOut in this thread after `seconds`, where a timer signal can (the main
    thread of a POSIX process); elsewhere the work runs unbounded and the supervisor's watch
    (python -m matrix run) is the limit."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum, frame):
        raise KindSetupTimedOut()

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def forget() -> None:
    """This process's records go (a test's fresh start)."""
    _DONE.clear()
