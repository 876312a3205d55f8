"""python -m matrix run [pytest args]: the matrix in one pytest process, surviving its death.

Cells run in one process (importing the stack takes seconds, a cell milliseconds: one process
per cell would be many times slower). When that process dies (a segfault, an abort, the OOM
killer, a CUDA error that takes the process down) or hangs in code that pytest-timeout cannot
interrupt, this supervisor reads the run's journal (matrix/results/journal.py), records the cell that
was running as failed with a crash or timeout signature naming the signal, and starts pytest
again on the same run with --matrix-resume, which skips the cells already recorded. Every
other cell still runs, and the run's report is one report.

Bad input (an unknown axis value, a malformed catalogue, an existing --run-id, a bad --shard)
is refused before anything runs: one line naming the option or file, exit status 2.
Ctrl-C or SIGTERM is passed on to pytest, which writes the cells done so far, marked incomplete.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from matrix.results import journal, run_directory
from matrix.run import internal_errors
from matrix.run.options import (
    BY_FLAG,
    CELL_TIMEOUT_S,
    KIND_SETUP_TIMEOUT_S,
    OPTIONS,
    OptionError,
    add_arguments,
    joined_values,
    runner_options,
)

COMMAND_VARIABLE = "MATRIX_RUN_COMMAND"  # the command the user typed, recorded in the report


# past --cell-timeout, for pytest-timeout to stop the cell itself first (30 s at the default)
def grace_s(cell_timeout: float) -> float:
    return min(30.0, max(2.0, cell_timeout / 4))


ABORT_WAIT_S = 10.0  # after SIGABRT (faulthandler writes the stacks), before SIGKILL
POLL_S = 0.2
MAX_RESTARTS = 1000  # one per crashed cell; a bound in case a process dies before any cell
PYTEST_INTERRUPTED = 2
PYTEST_INTERNAL_ERROR = 3
PYTEST_USAGE_ERROR = 4
NO_TESTS_COLLECTED = 5  # a resumed process whose cells were all done already


class InputError(ValueError):
    """Bad input found before the run; str() is the one line to print."""


def check_input(options: argparse.Namespace) -> None:
    """What the supervisor itself relies on. The rest (axis values, --shard, --cuda-device, the
    catalogue, a plugin that does not load) pytest finds before any cell runs, which this maps
    to one line and exit status 2."""
    if options.matrix_run_id is not None:
        try:
            journal.check_run_id(options.matrix_run_id)
        except ValueError as error:
            raise InputError(f"--run-id: {error}") from None
    if options.matrix_no_report:
        raise InputError("--no-report: python -m matrix run needs the report's journal; use pytest directly")
    for module in options.plugins:
        check_plugin_source(module)


def check_plugin_source(module: str) -> None:
    """A -p module that is not valid Python: one line here, before pytest reports it as an
    internal error with a traceback excerpt. Only its source is compiled; nothing is imported
    but the packages above it."""
    if module.startswith("no:"):
        return
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as error:
        raise InputError(f"-p {module}: cannot be found ({error})") from None
    if spec is None:
        raise InputError(f"-p {module}: no module of that name on sys.path")
    if spec.origin and spec.origin.endswith(".py"):
        try:
            compile(Path(spec.origin).read_bytes(), spec.origin, "exec")
        except SyntaxError as error:
            raise InputError(f"-p {module}: {spec.origin}, line {error.lineno}: SyntaxError: {error.msg}") from None


def signal_name(returncode: int) -> str:
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"


class Supervisor:
    def __init__(
        self,
        pytest_args: list[str],
        reports_root: Path,
        run_id: str,
        cell_timeout: float,
        kind_setup_timeout: float = KIND_SETUP_TIMEOUT_S,
    ) -> None:
        self.pytest_args, self.reports_root, self.run_id = pytest_args, reports_root, run_id
        self.directory = reports_root / run_id
        self.cell_timeout = cell_timeout
        self.kind_setup_timeout = kind_setup_timeout
        self.overrun_s = cell_timeout  # the limit the cell that was stopped ran past
        self.child: subprocess.Popen | None = None
        self.stopping = 0  # the signal that ends the run, once one came
        self.crashed: list[str] = []

    def command(self, resume: bool) -> list[str]:
        command = [sys.executable, "-m", "pytest", *self.pytest_args]
        if not any(arg == "--run-id" or arg.startswith("--run-id=") for arg in self.pytest_args):
            command.append(f"--run-id={self.run_id}")
        if not any(arg == "--report-dir" or arg.startswith("--report-dir=") for arg in self.pytest_args):
            command.append(f"--report-dir={self.reports_root}")
        return command + (["--matrix-resume"] if resume else [])

    def child_environment(self) -> dict[str, str]:
        """The environment, with matrix/run/internal_errors.py loaded into pytest: an internal error
        of pytest leaves its traceback in the run's directory for record_deaths()."""
        env = dict(os.environ)
        plugins = [p for p in env.get("PYTEST_PLUGINS", "").split(",") if p.strip()]
        env["PYTEST_PLUGINS"] = ",".join([*plugins, "matrix.run.internal_errors"])
        env[internal_errors.DIRECTORY_VARIABLE] = str(self.directory)
        return env

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
            self.child = subprocess.Popen(self.command(resume), env=self.child_environment())
            timed_out = self.watch()
            returncode = self.child.wait()
            if returncode == journal.REPORT_NOT_WRITTEN_STATUS and not self.stopping:
                # the file system refused the report (its line is above): a fresh process would meet it again
                print("python -m matrix run: stopped, the report could not be written; not resuming", file=sys.stderr)
                return returncode
            state = journal.read(self.directory)
            if not self.stopping and any(t >= started_at for t in state.restarts):
                print("python -m matrix run: the process asked for a fresh one (see above); resuming", file=sys.stderr)
                resume = True
                continue
            # pytest's internal error ends the process, which still writes results.json without the
            # cell in flight and the cells after it: that cell is recorded as crashed, and the run resumes
            internal_error = returncode == PYTEST_INTERNAL_ERROR and self.internal_error_logs()
            finished = (self.directory / "results.json").exists() and self.finished_after(started_at)
            if self.stopping or (finished and not (internal_error and state.in_flight())):
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
            self.record_deaths(in_flight, state.reruns, returncode, timed_out)
            resume = True
        print(f"python -m matrix run: gave up after {MAX_RESTARTS} restarts", file=sys.stderr)
        return 3

    def finished_after(self, started_at: float) -> bool:
        return (self.directory / "results.json").stat().st_mtime >= started_at - 1

    def watch(self) -> str | None:
        """Wait for the child; stop it when a cell overruns. Returns the overrunning cell's id. A cell
        whose setup is not done yet may be doing its kind's one-time work: that has its own budget
        (--kind-setup-timeout); the cell's own clock starts when its setup is done."""
        cell_limit = self.cell_timeout + grace_s(self.cell_timeout)
        setup_limit = self.kind_setup_timeout + grace_s(self.kind_setup_timeout)
        tail = journal.Tail(self.directory)
        while self.child.poll() is None:
            time.sleep(POLL_S)
            if self.stopping:
                continue
            state = tail.update()
            overdue = [
                cell
                for cell, (started, _) in state.in_flight().items()
                if time.time() - started > (cell_limit if cell in state.set_up else setup_limit)
            ]
            if overdue:
                self.overrun_s = self.cell_timeout if overdue[0] in state.set_up else self.kind_setup_timeout
                # SIGABRT first: faulthandler writes every thread's stack, which says where it hung
                self.child.send_signal(signal.SIGABRT)
                try:
                    self.child.wait(ABORT_WAIT_S)
                except subprocess.TimeoutExpired:
                    self.child.kill()
                return overdue[0]
        return None

    def record_deaths(
        self, in_flight: dict[str, float], state_reruns: dict, returncode: int, timed_out: str | None
    ) -> None:
        from matrix.grid.cell import Cell
        from matrix.results.records import crash_record, timeout_record

        internal = self.internal_error_output()
        stacks = "\n".join(text for text in (internal, self.faulthandler_output()) if text)
        log = journal.Journal(self.directory)
        try:
            for cell_id, (started, axes) in in_flight.items():
                cell = Cell(**axes)
                rerun = state_reruns.get(cell_id)
                if cell_id == timed_out:
                    record = timeout_record(cell, self.overrun_s, stacks, rerun=rerun)
                    what = f"timed out after {self.overrun_s:g} s"
                else:
                    cause = f"killed by {signal_name(returncode)}"
                    if internal:  # pytest's own error ended it: what it was, as its last line says
                        cause += f" after an internal error of pytest: {internal.strip().splitlines()[-1]}"
                    record = crash_record(cell, cause, stacks, time.time() - started, rerun=rerun)
                    what = f"crashed ({signal_name(returncode)})"
                log.cell(record.as_dict())
                self.crashed.append(cell_id)
                print(
                    f"python -m matrix run: {cell_id} {what}: {record.signature['id']}; resuming the run",
                    file=sys.stderr,
                )
        finally:
            log.close()

    def internal_error_logs(self) -> list[Path]:
        """The internal errors' tracebacks not yet read into a record, oldest first."""
        return sorted(self.directory.glob(f"{internal_errors.LOG_PREFIX}*[0-9].log"), key=lambda p: p.stat().st_mtime)

    def internal_error_output(self) -> str:
        """The traceback of the internal error that ended the process, where one did."""
        logs = self.internal_error_logs()
        if not logs:
            return ""
        text = logs[-1].read_text(errors="replace")
        for log in logs:  # kept as evidence; a later death reads only its own
            log.rename(log.with_suffix(".crash.log"))
        return text

    def faulthandler_output(self) -> str:
        logs = sorted(self.directory.glob("faulthandler-*.log"), key=lambda p: p.stat().st_mtime)
        if not logs:
            return ""
        text = logs[-1].read_text(errors="replace")
        logs[-1].rename(logs[-1].with_suffix(".crash.log"))  # kept as evidence; the next process starts its own
        return text


# The matrix's options this supervisor acts on itself (all of them go on to pytest too)
SUPERVISOR_OPTIONS = ("--cell-timeout", "--kind-setup-timeout", "--run-id", "--report-dir")
REFUSED_OPTIONS = ("--no-report",)  # check_input says why
HELP_DESCRIPTION = """\
The matrix in one pytest process that survives crashes and hangs: a cell that kills the
process, or runs past --cell-timeout where pytest-timeout cannot stop it, is recorded as
failed with the stacks, and pytest starts again on the same run, skipping the cells already
recorded. Ctrl-C or SIGTERM writes the cells done so far as the report, marked incomplete.
Bad input is refused in one line before anything runs."""
HELP_EPILOG = """\
Any other argument goes to pytest: test paths (default: pytest's testpaths), -k EXPR,
-n auto (pytest-xdist), --lf, ...; `python -m pytest --help` lists pytest's own options, and the
matrix's under 'mixed-precision matrix'. --no-report is refused: the run needs its journal.

exit status: pytest's (1 when a cell failed, crashed or hung); 2 for bad input; 3 when the run
could not go on (the reason is printed); 128 + N when ended by signal N."""


def help_parser() -> argparse.ArgumentParser:
    """What `python -m matrix run --help` prints: this command's options, then the matrix's
    pytest options from the same table the plugin registers (matrix/run/options.py); no torch."""
    parser = argparse.ArgumentParser(
        prog="python -m matrix run",
        usage="%(prog)s [-h] [options] [pytest args]",
        description=HELP_DESCRIPTION,
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    own = parser.add_argument_group("options python -m matrix run acts on (pytest gets them too)")
    add_arguments(own.add_argument, tuple(BY_FLAG[flag] for flag in SUPERVISOR_OPTIONS))
    own.add_argument(
        "-p",
        metavar="MODULE",
        action="append",
        help="a plugin module for pytest to load (a model kind of your own, say), compiled here first so a syntax "
        "error is one line; every cell's re-run command carries it; repeatable",
    )
    matrix = parser.add_argument_group("the matrix's pytest options")
    skipped = {*SUPERVISOR_OPTIONS, *REFUSED_OPTIONS}
    add_arguments(matrix.add_argument, tuple(o for o in OPTIONS if o.flag not in skipped and not o.hidden))
    return parser


def wants_help(argv: list[str]) -> bool:
    """-h or --help before any `--`: this command's help (pytest would print its own, then the
    supervisor would find no report)."""
    head = argv[: argv.index("--")] if "--" in argv else argv
    return "-h" in head or "--help" in head


def main(argv: list[str]) -> int:
    if wants_help(argv):
        help_parser().print_help()
        return 0
    try:
        options = runner_options(argv)
        check_input(options)
    except (InputError, OptionError) as error:
        print(f"python -m matrix run: {error}", file=sys.stderr)
        return 2
    reports_root = run_directory.reports_root(options.matrix_report_dir)
    run_id = options.matrix_run_id or journal.new_run_id()
    if (reports_root / run_id).exists():
        print(f"python -m matrix run: --run-id: {reports_root / run_id} exists; never written into", file=sys.stderr)
        return 2
    pytest_args = joined_values(argv)  # which tests: the paths given, else pytest's testpaths (here: cases/)
    timeout = options.matrix_cell_timeout or CELL_TIMEOUT_S
    setup_timeout = options.matrix_kind_setup_timeout or KIND_SETUP_TIMEOUT_S
    # the report records the command the user typed, not the pytest process started for it
    os.environ[COMMAND_VARIABLE] = shlex.join(["python", "-m", "matrix", "run", *argv])
    return Supervisor(pytest_args, reports_root, run_id, timeout, setup_timeout).run()
