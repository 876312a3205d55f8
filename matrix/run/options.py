"""The matrix's command-line options, in one table (OPTIONS): the pytest plugin adds them to
pytest (matrix/plugin/hooks.py), and `python -m matrix run` parses the ones it needs (runner_needs)
from the same table before it starts pytest, and lists them in its --help (matrix/run/supervisor.py).

An option with a check (the timeouts, --world-size, the --explore-* numbers) is checked here,
once, with a one-line message naming it; the others are checked where they are read: the axis
values by matrix/selection/cells.py, --shard and --shard-costs by matrix/shards/plan.py, --cuda-device by
matrix/devices/,
--run-id by matrix/results/journal.py. Also here: a command line with the options' values
joined to them (so pytest takes no value for a test path), and the -p plugin arguments a cell's
re-run command carries. Standard library only (and matrix/grid/cell.py's axis names).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from matrix.grid.cell import AXES
from matrix.harness.kind_setup import KIND_SETUP_TIMEOUT_S

CELL_TIMEOUT_S = 120.0  # the slowest honest cell measured on a quiet 2-core CPU takes 0.7 s


class OptionError(ValueError):
    """An option's value is wrong; str() is the one line to print."""


@dataclass(frozen=True)
class Option:
    flag: str  # --cell-timeout
    help: str
    default: object = None
    metavar: str | None = None
    flag_only: bool = False  # store_true
    repeatable: bool = False  # action=append
    hidden: bool = False
    check: object = None  # value -> value, raising OptionError
    runner_needs: bool = False  # python -m matrix run reads it too

    @property
    def dest(self) -> str:
        return "matrix_" + self.flag.removeprefix("--").removeprefix("matrix-").replace("-", "_")

    @property
    def unset(self) -> object:
        """Its value when the command line does not give it."""
        return False if self.flag_only else [] if self.repeatable else self.default


def positive_seconds(text) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise OptionError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value != value or value == float("inf"):
        raise OptionError(f"{text!r} is not a positive number of seconds")
    return value


def natural(text) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise OptionError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise OptionError(f"{text!r} is negative")
    return value


def world_size(text) -> int:
    value = natural(text)
    if value < 1:
        raise OptionError(f"{text!r} is not a number of ranks (at least 1)")
    return value


def curve_steps(text) -> int:
    value = natural(text)
    if value < 1:
        raise OptionError(f"{text!r} is not a number of training steps (at least 1)")
    return value


OPTIONS: tuple[Option, ...] = (
    *(
        Option(
            f"--{axis}",
            f"{axis} values to run, comma-separated (default: all; see README)",
            metavar="A,B",
            runner_needs=True,
        )
        for axis in AXES
    ),
    Option(
        "--cuda-device",
        "index of the GPU the cuda cells run on (default 0), or per-worker: pytest-xdist worker gwK uses GPU K mod "
        "the number visible (one worker per GPU with -n <GPUs>); recorded per cell",
        default="0",
        metavar="N|per-worker",
        runner_needs=True,
    ),
    Option(
        "--shard",
        "run shard K of N of the selected cells (dealt round-robin, or balanced by --shard-costs); merge the "
        "shards' reports with python -m matrix merge",
        metavar="K/N",
        runner_needs=True,
    ),
    Option(
        "--shard-costs",
        "with --shard: balance the shards by what each cell cost in this earlier run (a report directory or its "
        "results.json, such as the previous night's merged report); every shard must be given the same one",
        metavar="RUN",
    ),
    Option(
        "--order-seed",
        "run the selected cells (of this --shard) in an order shuffled by seed K, recorded in the report: a cell "
        "whose verdict depends on the cells before it in its process shows up as a flip between seeds (default: "
        "the selection's order)",
        metavar="K",
        check=natural,
        runner_needs=True,
    ),
    Option(
        "--run-id",
        "name of this run's report directory (default: UTC time + random suffix); it must not exist",
        metavar="ID",
        runner_needs=True,
    ),
    Option(
        "--cell-timeout",
        f"a cell running longer fails with a timeout signature (default {CELL_TIMEOUT_S:g}; python -m matrix run "
        "also kills a process stuck past it)",
        default=str(CELL_TIMEOUT_S),
        metavar="S",
        check=positive_seconds,
        runner_needs=True,
    ),
    Option(
        "--kind-setup-timeout",
        "a kind's one-time work (observing it, searching its learning rate), done before its first cell and "
        f"outside that cell's timeout, gets this long; past it, the kind's cells fail with KindSetupTimedOut "
        f"(default {KIND_SETUP_TIMEOUT_S:g})",
        default=str(KIND_SETUP_TIMEOUT_S),
        metavar="S",
        check=positive_seconds,
        runner_needs=True,
    ),
    Option(
        "--world-size",
        "ranks of the process group the distributed engines (ddp, fsdp2, accelerate-fsdp2, deepspeed-zero*, "
        "hf-trainer-zero*) run on (default 2; gloo "
        "on CPU, nccl on CUDA with one GPU per rank)",
        default="2",
        metavar="N",
        check=world_size,
        runner_needs=True,
    ),
    Option(
        "--curve-steps",
        "train every training cell for N steps before its checkpoint (default 3) and compare its loss curve step "
        "by step with the torch engine's and the fp32 twin's (matrix/results/curves.py)",
        metavar="N",
        check=curve_steps,
        runner_needs=True,
    ),
    Option(
        "--initial-weights",
        "build every model from the saved initial weights (and batch) in DIR instead of the kind's seeded "
        "initialisation: how golden curves start (matrix/models/initial_weights.py)",
        metavar="DIR",
        runner_needs=True,
    ),
    Option("--matrix-resume", "", flag_only=True, hidden=True),
    Option(
        "--report-dir",
        "where run reports go (default: reports/ in the directory pytest was started from)",
        metavar="DIR",
        runner_needs=True,
    ),
    Option("--no-report", "write no report directory", flag_only=True, runner_needs=True),
    Option(
        "--catalogue",
        "a known-failure catalogue file whose entries are added to the built-in ones (repeatable)",
        metavar="FILE",
        repeatable=True,
        runner_needs=True,
    ),
    Option(
        "--no-builtin-catalogue",
        "leave out the built-in known-failure catalogue: every failure not in a --catalogue file shows as new",
        flag_only=True,
    ),
    Option(
        "--run-contradictory",
        "run precision policies that contradict themselves instead of failing them in 'configure'",
        flag_only=True,
    ),
    Option("--explore", "also run the hypothesis explorations (test_explore) of the selected cells", flag_only=True),
    Option(
        "--explore-examples",
        "variants tried per explored target, at most (default 50)",
        default="50",
        metavar="N",
        check=natural,
    ),
    Option(
        "--explore-seconds",
        "wall-time budget of all explorations together, shared out among targets (default 300)",
        default="300",
        metavar="S",
        check=positive_seconds,
    ),
    Option("--explore-seed", "search seed (default 0)", default="0", metavar="K", check=natural),
    Option(
        "--explore-findings",
        "distinct failures to find per target before moving on (default 3)",
        default="3",
        metavar="M",
        check=natural,
    ),
    Option("--strict-known", "a cell the catalogue says fails but that passes (fixed) fails the run", flag_only=True),
    Option(
        "--keep-cell-files",
        "keep every cell's working directory (its checkpoints, exports and ranks' files, under pytest's "
        "basetemp); by default one is removed once the cell is recorded, unless the cell failed in a way the "
        "catalogue does not explain",
        flag_only=True,
    ),
)
BY_DEST = {option.dest: option for option in OPTIONS}
BY_FLAG = {option.flag: option for option in OPTIONS}


def checked(dest: str, value):
    """The option's value after its check; OptionError names the option."""
    option = BY_DEST[dest]
    if option.check is None or value is None:
        return value
    try:
        return option.check(value)
    except OptionError as error:
        raise OptionError(f"{option.flag}: {error}") from None


def given(value_of) -> list[str]:
    """The options a command line gave, by flag; value_of(dest) is the parsed value."""
    return [option.flag for option in OPTIONS if value_of(option.dest) != option.unset]


def add_arguments(add, which: tuple[Option, ...] = OPTIONS) -> None:
    """Declare every option (or those of `which`) through `add(flag, **kwargs)`: pytest's
    group.addoption or argparse's add_argument take the same keywords."""
    for option in which:
        kwargs: dict = {"dest": option.dest, "help": argparse.SUPPRESS if option.hidden else option.help}
        if option.flag_only:
            kwargs.update(action="store_true", default=False)
        else:
            kwargs.update(default=option.default, metavar=option.metavar)
            if option.repeatable:
                kwargs.update(action="append", default=[])
        add(option.flag, **kwargs)


def runner_options(argv: list[str]) -> argparse.Namespace:
    """The options python -m matrix run needs, parsed from argv (all of argv still goes to
    pytest). The values are checked as the plugin checks them."""
    parser = argparse.ArgumentParser(add_help=False)
    for option in OPTIONS:
        if option.runner_needs:
            kwargs = {"dest": option.dest}
            if option.flag_only:
                kwargs.update(action="store_true")
            elif option.repeatable:
                kwargs.update(action="append", default=[])
            parser.add_argument(option.flag, **kwargs)
    parser.add_argument("-p", dest="plugins", action="append", default=[])
    known, _ = parser.parse_known_args(argv)
    for dest in vars(known):
        if dest in BY_DEST:
            setattr(known, dest, checked(dest, getattr(known, dest)))
    return known


def joined_values(argv: list[str]) -> list[str]:
    """argv with every matrix option's value joined to it (--report-dir=DIR): pytest takes any
    argument not starting with '-' that names an existing path for a test path, and an existing
    --report-dir would otherwise move its rootdir (and its ini file, and testpaths) away."""
    takes_value = {option.flag for option in OPTIONS if not option.flag_only}
    joined, it = [], iter(argv)
    for arg in it:
        if arg in takes_value:
            value = next(it, None)
            joined.append(arg if value is None else f"{arg}={value}")
        else:
            joined.append(arg)
    return joined


def plugin_arguments(args: list[str]) -> list[str]:
    """The `-p MODULE` arguments among pytest's (not -p no:NAME): a cell from a plugin's model
    kind re-runs, replays and reproduces only with them."""
    found, it = [], iter(args)
    for arg in it:
        name = next(it, None) if arg == "-p" else arg[2:] if arg.startswith("-p") and len(arg) > 2 else None
        if name and not name.startswith("no:"):
            found += ["-p", name]
    return found
