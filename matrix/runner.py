"""python -m matrix run [pytest args]: the matrix in one pytest process, surviving its death.

Cells run in one process (importing the stack takes seconds, a cell milliseconds: one process
per cell would be many times slower). When that process dies (a segfault, an abort, the OOM
killer, a CUDA error that takes the process down) or hangs in code that pytest-timeout cannot
interrupt, this supervisor reads the run's journal (matrix/journal.py), records the cell that
was running as failed with a crash or timeout signature naming the signal, and starts pytest
again on the same run with --matrix-resume, which skips the cells already recorded. Every
other cell still runs, and the run's report is one report.

Bad input (an unknown axis value, a malformed catalogue, an existing --run-id, a bad --shard)
is refused before anything runs: one line naming the option or file, exit status 2.
Ctrl-C or SIGTERM is passed on to pytest, which writes the cells done so far, marked incomplete.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from matrix import journal

ROOT = Path(__file__).resolve().parent.parent


# past --cell-timeout, for pytest-timeout to stop the cell itself first (30 s at the default)
def grace_s(cell_timeout: float) -> float:
    return min(30.0, max(2.0, cell_timeout / 4))


ABORT_WAIT_S = 10.0  # after SIGABRT (faulthandler writes the stacks), before SIGKILL
POLL_S = 0.2
MAX_RESTARTS = 1000  # one per crashed cell; a bound in case a process dies before any cell
COMMAND_VARIABLE = "MATRIX_RUN_COMMAND"
PYTEST_INTERRUPTED = 2
PYTEST_USAGE_ERROR = 4
NO_TESTS_COLLECTED = 5  # a resumed process whose cells were all done already
# The slowest honest cell measured on a quiet 2-core CPU takes 0.7 s (hf-trainer, gemma-cache); the
# first cuda cell of a process also pays CUDA's initialisation. 120 s leaves a wide margin.
CELL_TIMEOUT_S = 120.0


class InputError(ValueError):
    """Bad input found before the run; str() is the one line to print."""


def matrix_options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The options the supervisor needs to know; all of argv still goes to pytest."""
    parser = argparse.ArgumentParser(add_help=False)
    for axis in ("model", "precision", "mode", "device", "engine"):
        parser.add_argument(f"--{axis}")
    parser.add_argument("--report-dir")
    parser.add_argument("--run-id")
    parser.add_argument("--catalogue")
    parser.add_argument("--shard")
    parser.add_argument("--cuda-device")
    parser.add_argument("--cell-timeout", type=float)
    parser.add_argument("--no-report", action="store_true")
    known, _ = parser.parse_known_args(argv)
    return known, argv


def check_input(options: argparse.Namespace) -> None:
    """What the supervisor itself relies on. The rest (axis values, --shard, --cuda-device, the
    catalogue) pytest checks as a usage error before any cell runs, which this maps to 2."""
    if options.run_id is not None:
        try:
            journal.check_run_id(options.run_id)
        except ValueError as error:
            raise InputError(f"--run-id: {error}") from None
    if options.cell_timeout is not None and not options.cell_timeout > 0:
        raise InputError(f"--cell-timeout: {options.cell_timeout:g} is not a positive number of seconds")
    if options.no_report:
        raise InputError("--no-report: python -m matrix run needs the report's journal; use pytest directly")


def signal_name(returncode: int) -> str:
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"


class Supervisor:
    def __init__(self, pytest_args: list[str], reports_root: Path, run_id: str, cell_timeout: float) -> None:
        self.pytest_args, self.reports_root, self.run_id = pytest_args, reports_root, run_id
        self.directory = reports_root / run_id
        self.cell_timeout = cell_timeout
        self.child: subprocess.Popen | None = None
        self.stopping = 0  # the signal that ends the run, once one came
        self.crashed: list[str] = []

    def command(self, resume: bool) -> list[str]:
        command = [sys.executable, "-m", "pytest", *self.pytest_args]
        if not any(arg == "--run-id" or arg.startswith("--run-id=") for arg in self.pytest_args):
            command += ["--run-id", self.run_id]
        if not any(arg == "--report-dir" or arg.startswith("--report-dir=") for arg in self.pytest_args):
            command += ["--report-dir", str(self.reports_root)]
        return command + (["--matrix-resume"] if resume else [])

    def forward(self, signum, frame) -> None:
        self.stopping = signum
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM if signum == signal.SIGTERM else signal.SIGINT)

    def run(self) -> int:
        previous = {s: signal.signal(s, self.forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self.loop()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def loop(self) -> int:
        resume = False
        for _ in range(MAX_RESTARTS):
            started_at = time.time()
            self.child = subprocess.Popen(self.command(resume), cwd=ROOT)
            timed_out = self.watch()
            returncode = self.child.wait()
            state = journal.read(self.directory)
            if not self.stopping and any(t >= started_at for t in state.restarts):
                print("python -m matrix run: the process asked for a fresh one (see above); resuming", file=sys.stderr)
                resume = True
                continue
            if self.stopping or ((self.directory / "results.json").exists() and self.finished_after(started_at)):
                if self.stopping:
                    return 128 + self.stopping  # the shell's convention for a run ended by a signal
                failed = self.crashed or state.restarts
                if returncode == PYTEST_INTERRUPTED:  # stopped itself for a fresh process, with nothing left
                    return 1
                return 1 if failed and returncode in (0, NO_TESTS_COLLECTED) else returncode
            in_flight = state.in_flight()
            if returncode == PYTEST_USAGE_ERROR and state.run is None:
                return 2  # bad input: pytest said which, in one line, before any cell ran
            if state.run is None or not in_flight:
                print(
                    f"python -m matrix run: pytest ended ({signal_name(returncode)}) with no cell running and "
                    f"no report written; see its output above",
                    file=sys.stderr,
                )
                return returncode if returncode > 0 else 3
            if set(in_flight) & set(self.crashed):
                print(
                    f"python -m matrix run: {', '.join(sorted(set(in_flight) & set(self.crashed)))} crashed again "
                    "after being recorded; stopping (the journal is in the run directory)",
                    file=sys.stderr,
                )
                return 3
            self.record_deaths(in_flight, returncode, timed_out)
            resume = True
        print(f"python -m matrix run: gave up after {MAX_RESTARTS} restarts", file=sys.stderr)
        return 3

    def finished_after(self, started_at: float) -> bool:
        return (self.directory / "results.json").stat().st_mtime >= started_at - 1

    def watch(self) -> str | None:
        """Wait for the child; stop it when a cell overruns. Returns the overrunning cell's id."""
        limit = self.cell_timeout + grace_s(self.cell_timeout)
        tail = journal.Tail(self.directory)
        while self.child.poll() is None:
            time.sleep(POLL_S)
            if self.stopping:
                continue
            running = tail.update().in_flight()
            overdue = [cell for cell, (started, _) in running.items() if time.time() - started > limit]
            if overdue:
                # SIGABRT first: faulthandler writes every thread's stack, which says where it hung
                self.child.send_signal(signal.SIGABRT)
                try:
                    self.child.wait(ABORT_WAIT_S)
                except subprocess.TimeoutExpired:
                    self.child.kill()
                return overdue[0]
        return None

    def record_deaths(self, in_flight: dict[str, float], returncode: int, timed_out: str | None) -> None:
        from matrix.cells import Cell
        from matrix.report import crash_record, timeout_record

        stacks = self.faulthandler_output()
        log = journal.Journal(self.directory)
        try:
            for cell_id, (started, axes) in in_flight.items():
                cell = Cell(**axes)
                if cell_id == timed_out:
                    record = timeout_record(cell, self.cell_timeout, stacks)
                    what = f"timed out after {self.cell_timeout:g} s"
                else:
                    record = crash_record(cell, f"killed by {signal_name(returncode)}", stacks, time.time() - started)
                    what = f"crashed ({signal_name(returncode)})"
                log.cell(record)
                self.crashed.append(cell_id)
                print(
                    f"python -m matrix run: {cell_id} {what}: {record['signature']['id']}; resuming the run",
                    file=sys.stderr,
                )
        finally:
            log.close()

    def faulthandler_output(self) -> str:
        logs = sorted(self.directory.glob("faulthandler-*.log"), key=lambda p: p.stat().st_mtime)
        if not logs:
            return ""
        text = logs[-1].read_text(errors="replace")
        logs[-1].rename(logs[-1].with_suffix(".crash.log"))  # kept as evidence; the next process starts its own
        return text


def main(argv: list[str]) -> int:
    options, pytest_args = matrix_options(argv)
    try:
        check_input(options)
    except InputError as error:
        print(f"python -m matrix run: {error}", file=sys.stderr)
        return 2
    reports_root = Path(options.report_dir) if options.report_dir else ROOT / "reports"
    run_id = options.run_id or journal.new_run_id()
    if (reports_root / run_id).exists():
        print(f"python -m matrix run: --run-id: {reports_root / run_id} exists; never written into", file=sys.stderr)
        return 2
    if not any(arg.startswith("cases") or arg.startswith("tests") for arg in pytest_args):
        pytest_args = ["cases", *pytest_args]
    timeout = options.cell_timeout or CELL_TIMEOUT_S
    # the report records the command the user typed, not the pytest process started for it
    os.environ[COMMAND_VARIABLE] = shlex.join(["python", "-m", "matrix", "run", *argv])
    return Supervisor(pytest_args, reports_root, run_id, timeout).run()
