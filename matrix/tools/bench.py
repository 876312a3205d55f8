"""python -m matrix.tools.bench: how long the matrix takes, and how far that is from what it must take.

A cell computes for a fraction of a second; importing the stack (torch, transformers, peft,
accelerate, Lightning) takes seconds. So the way the matrix is run decides its wall time: one
process for all cells pays the import once, one process per cell pays it every time. This
module measures, on one machine, for one selection of cells (default: the torch-engine CPU
matrix, `--engine torch --device cpu`; pytest arguments after `--` are appended and, where they
repeat an option, win):

- matrix wall: the selection run as users run it (`--runner`, default `python -m matrix run`;
  `--runner pytest` means `python -m pytest cases`), `--repeat` times: each wall, median, min;
- floor: importing what the runs imported, once (a fresh `python -c "import ..."` of the stack's
  modules the timed runs had loaded by their end, as matrix/tools/bench_probe.py reports them; timed
  from outside, median) plus the cells' own compute (the sum of their `duration_s` in
  results.json, median over runs): what the matrix would take if running it cost nothing else;
- overhead ratio: matrix wall (median) / floor;
- process-per-cell: the same cells, each in a fresh `python -m pytest <node id>` as a naive
  runner would, one after another (`--per-cell-sample K`: K cells spread over the selection,
  the total extrapolated linearly); speed-up: process-per-cell total / matrix wall (median);
- per engine (`--per-engine`): the CPU matrix over every engine, once: each engine's cells per
  mode (how many ran, their total, the median cell) and its slowest phase
  (matrix/results/phase_costs.py);
- the targets below, each met or missed, and by how much.

The report (Markdown) goes to stdout; `--write` also writes it to BENCHMARKS.md, `--json FILE`
writes the figures as JSON. The machine's other load is recorded per phase (CPU time used by
other processes while the matrix runs, the imports and the per-cell runs, from /proc/stat): on a
small machine one busy core elsewhere can slow the cells' compute many times over. Exit status 0
whether targets are met or not; 2, with one line, when a run fails (a runner exit status other
than 0 or 1, no results.json, a per-cell run that does not run its cell).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RUNNER = "python -m matrix run"
PYTEST_RUNNER = "python -m pytest cases"  # --runner pytest
DEFAULT_SELECTION = ("--engine", "torch", "--device", "cpu")
DEFAULT_REPEAT = 3
# The modules whose import is the cost of a run's stack, in import order: the floor imports those
# of them a timed run had loaded (transformers' package alone is lazy; its models need
# modeling_utils, seconds more).
STACK_MODULES = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "peft",
    "accelerate",
    "lightning",
    "matrix.plugin",
    "matrix.harness.pipeline",
    "matrix.engines",
    "matrix.models",
)
PROBE_PLUGIN = "matrix.tools.bench_probe"  # loaded into the timed runs: it writes what they imported
PROBE_VARIABLE = "MATRIX_BENCH_IMPORTS"  # the directory it writes into, one file per process
RUN_OK = (0, 1)  # pytest: all passed, or some cells failed; anything else is a broken run
PHASES = {"matrix": "matrix runs", "import": "imports", "per_cell": "per-cell runs", "per_engine": "per-engine run"}
BUSY_SHARE_WARNING = 0.2  # other processes' average use of the CPU, in cores, worth a warning


@dataclass(frozen=True)
class Target:
    figure: str  # key in the figures
    label: str
    op: str  # "<" or ">="
    limit: float
    unit: str  # "s" (seconds), "x" (a factor) or "" (a plain ratio)
    whole_torch_cpu_matrix_only: bool = False  # an absolute time only means something for one selection


TARGETS = (
    Target("matrix_wall_s", "torch-engine CPU matrix wall (median)", "<", 30.0, "s", whole_torch_cpu_matrix_only=True),
    Target("overhead_ratio", "overhead ratio (matrix wall / floor)", "<", 1.5, ""),
    Target("speedup", "speed-up over process-per-cell", ">=", 5.0, "x"),
)


class BenchError(Exception):
    """A measurement that cannot be made; str() is the one line to print."""


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def timed(command: list[str], env_extra: dict | None = None) -> tuple[float, subprocess.CompletedProcess]:
    env = {**os.environ, **(env_extra or {})}
    env.setdefault("HF_HUB_OFFLINE", "1")  # as the matrix's cells run (matrix/execute/environment_variables.py)
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    except OSError as error:
        raise BenchError(f"cannot start {shlex.join(command)}: {error}") from None
    return time.perf_counter() - start, done


def last_line(done: subprocess.CompletedProcess) -> str:
    """The line that says what went wrong: a usage error, else the exception pytest shows
    (`E   ...`), else a summary line (`ERROR cases/...`), else the last line."""
    lines = [line.strip() for line in (done.stderr + "\n" + done.stdout).splitlines() if line.strip()]
    for prefixes in (("ERROR:", "error:"), ("E ",), ("ERROR", "FAILED", "Error")):
        found = [line for line in lines if line.startswith(prefixes)]
        if found:
            return " ".join(found[-1].split())
    return lines[-1] if lines else "(no output)"


def runner_command(runner: str) -> list[str]:
    """`pytest` means `python -m pytest cases`; a leading `python` is this interpreter."""
    words = shlex.split(PYTEST_RUNNER if runner == "pytest" else runner)
    if not words:
        raise BenchError("--runner: empty command")
    if words[0] in ("python", "python3"):
        words[0] = sys.executable
    return words


def imported_modules(runs: list[dict]) -> list[str]:
    """The stack's modules any timed run imported, in STACK_MODULES order; all of them when no
    run said (a --runner that does not load pytest's -p plugins)."""
    said = [run["imports"] for run in runs if run.get("imports") is not None]
    if not said:
        return list(STACK_MODULES)
    return [name for name in STACK_MODULES if any(name in imports for imports in said)]


def measure_import(repeat: int, modules: list[str]) -> list[float]:
    """Walls of a fresh process importing `modules`, timed from outside."""
    command = [sys.executable, "-c", "import " + ", ".join(modules)]
    walls = []
    for n in range(1, repeat + 1):
        wall, done = timed(command)
        if done.returncode != 0:
            raise BenchError(f"importing the stack failed (exit status {done.returncode}): {last_line(done)}")
        progress(f"import {n}/{repeat}: {wall:.2f} s")
        walls.append(wall)
    return walls


def run_matrix(runner: list[str], pytest_args: list[str], repeat: int, report_dir: Path) -> list[dict]:
    """Run the selection `repeat` times; per run its wall and what its results.json says."""
    runs = []
    for n in range(1, repeat + 1):
        run_id = f"bench-{n}"
        command = [*runner, *pytest_args, "--report-dir", str(report_dir), "--run-id", run_id, "-p", "no:cacheprovider"]
        probe = report_dir / f"{run_id}-imports"
        probe.mkdir()
        wall, done = timed([*command, "-p", PROBE_PLUGIN], {PROBE_VARIABLE: str(probe)})
        if done.returncode not in RUN_OK:
            raise BenchError(f"matrix run {n} exited with status {done.returncode}: {last_line(done)}")
        results_file = report_dir / run_id / "results.json"
        try:
            results = json.loads(results_file.read_text())
            cells = results["cells"]
            run = {
                "wall_s": wall,
                "exit_status": done.returncode,
                # the cells' own time. Each kind's one-time work (kind_setups) is left out, as
                # before it had a record of its own (it ran ahead of run_cell's clock): most of
                # it is the first import of modules the floor's import already counts
                "compute_s": sum(cell["duration_s"] for cell in cells),
                "cells": [cell["id"] for cell in cells],
                "counts": results["counts"],
                "whole_torch_cpu_matrix": is_whole_torch_cpu_matrix(cells, results["run"]["axes"]),
                "imports": probe_report(probe),
            }
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise BenchError(f"matrix run {n} wrote no readable {results_file}: {error}") from None
        progress(f"matrix run {n}/{repeat}: {wall:.1f} s, {len(cells)} cells, compute {run['compute_s']:.1f} s")
        runs.append(run)
    return runs


def run_per_engine(runner: list[str], extra: list[str], report_dir: Path) -> dict:
    """The CPU matrix over every engine (`--device cpu` and the extra pytest args), once: what each
    engine's cells cost, per mode, and where in the pipeline their time goes (phase_costs)."""
    from matrix.results.phase_costs import engine_costs, floor_costs, phase_costs, ran

    pytest_args = ["--device", "cpu", *extra]
    command = [*runner, *pytest_args, "--report-dir", str(report_dir), "--run-id", "per-engine"]
    wall, done = timed([*command, "-p", "no:cacheprovider"])
    if done.returncode not in RUN_OK:
        raise BenchError(f"the per-engine run exited with status {done.returncode}: {last_line(done)}")
    try:
        results = json.loads((report_dir / "per-engine" / "results.json").read_text())
        cells = results["cells"]
    except (OSError, ValueError, KeyError) as error:
        raise BenchError(f"the per-engine run wrote no readable results.json: {error}") from None
    slowest: dict[str, dict] = {}
    for cost in phase_costs(cells):  # slowest first: each engine's first is its slowest phase
        slowest.setdefault(cost.engine, asdict(cost))
    progress(f"per-engine run: {wall:.1f} s, {len(ran(cells))} cells ran")
    return {
        "pytest_args": pytest_args,
        "wall_s": wall,
        "counts": results["counts"],
        "compute_s": sum(c["duration_s"] for c in ran(cells)),
        "engines": [asdict(cost) for cost in engine_costs(cells)],
        "floors": [asdict(cost) for cost in floor_costs(cells)],
        "slowest_phase": slowest,
        "unexplained": unexplained(cells),
    }


def unexplained(cells: list[dict]) -> list[dict]:
    """The cells of a run that failed in a way the catalogue does not explain, or that a known
    failure no longer fails: by id, with their signature (the page names what its counts hide)."""
    return [
        {"id": c["id"], "outcome": c["outcome"], "signature": (c.get("signature") or {}).get("text")}
        for c in cells
        if c.get("outcome") in ("failed", "fixed")
    ]


def per_engine_markdown(per_engine: dict, runner: str) -> list[str]:
    counts = ", ".join(f"{n} {outcome}" for outcome, n in per_engine["counts"].items() if n)
    lines = [
        "## Cell cost per engine",
        "",
        f"`{runner} {shlex.join(per_engine['pytest_args'])}`: {counts}; {per_engine['wall_s']:.1f} s wall, "
        f"{per_engine['compute_s']:.1f} s in the cells that ran (their `duration_s`). Each engine's cells that "
        "ran, per mode; its floor, the time those cells spent inside the engine's own library calls (start, "
        "train, evaluate, save, export, restore, close: `metrics.library_seconds`); how many times the floor "
        "the cells took; and its slowest phase in all (`phase_seconds`).",
        "",
    ]
    if per_engine.get("unexplained"):  # what its counts' failed and fixed are
        lines.append(
            "Its cells that failed in a way the catalogue does not explain, or that a known failure no longer fails:"
        )
        lines.append("")
        for cell in per_engine["unexplained"]:
            signature = f": {cell['signature']}" if cell["signature"] else ""
            lines.append(f"- {cell['outcome']}: `{cell['id']}`{signature}")
        lines.append("")
    lines += [
        "| engine | mode | cells | median cell | total | floor: median | floor: total | cell / floor "
        "| engine's slowest phase |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    floors = {(f["engine"], f["part"]): f for f in per_engine.get("floors", [])}
    for cost in per_engine["engines"]:
        phase = per_engine["slowest_phase"].get(cost["engine"])
        where = f"{phase['part']}: {phase['total_s']:.1f} s, median {phase['median_s']:.3f} s" if phase else "-"
        floor = floors.get((cost["engine"], cost["part"]))
        if floor and floor["cells"] == cost["cells"] and floor["total_s"] > 0:
            times = cost["total_s"] / floor["total_s"]
            floor_text = f"{floor['median_s']:.3f} s | {floor['total_s']:.1f} s | {times:.1f}x"
        else:
            floor_text = "- | - | -"  # not recorded by every cell of the row
        lines.append(
            f"| {cost['engine']} | {cost['part']} | {cost['cells']} | {cost['median_s']:.3f} s "
            f"| {cost['total_s']:.1f} s | {floor_text} | {where} |"
        )
    return [*lines, ""]


def probe_report(directory: Path) -> list[str] | None:
    """What the run's processes (the controller, xdist workers, resumed processes) imported,
    together; None if none of them wrote (the probe was not loaded)."""
    files = sorted(directory.glob("*.json"))
    if not files:
        return None
    return sorted({name for path in files for name in json.loads(path.read_text())})


def is_whole_torch_cpu_matrix(cells: list[dict], axes: dict) -> bool:
    expected = len(axes["model"]) * len(axes["precision"]) * len(axes["mode"])
    return len(cells) == expected and all(c["engine"] == "torch" and c["device"] == "cpu" for c in cells)


def spread(items: list[str], sample: int | None) -> list[str]:
    """`sample` items spread evenly over `items` (each from the middle of its share); all if None."""
    if sample is None or sample >= len(items):
        return list(items)
    return [items[int((i + 0.5) * len(items) / sample)] for i in range(sample)]


def run_per_cell(cell_ids: list[str], pytest_args: list[str], sample: int | None) -> dict:
    """Each (sampled) cell in a fresh pytest process, one after another."""
    chosen = spread(cell_ids, sample)
    walls = []
    for n, cell_id in enumerate(chosen, 1):
        node = f"cases/test_cells.py::test_cell[{cell_id}]"
        command = [sys.executable, "-m", "pytest", node, *pytest_args, "--no-report", "-p", "no:cacheprovider", "-q"]
        wall, done = timed(command)
        if done.returncode not in RUN_OK:
            raise BenchError(f"per-cell run of {cell_id} exited with status {done.returncode}: {last_line(done)}")
        progress(f"per-cell {n}/{len(chosen)}: {cell_id} {wall:.2f} s")
        walls.append(wall)
    return per_cell_figures(len(cell_ids), chosen, walls)


def per_cell_figures(cells_total: int, cells: list[str], walls: list[float]) -> dict:
    mean = statistics.fmean(walls)
    return {
        "cells_total": cells_total,
        "cells_run": len(walls),
        "extrapolated": len(walls) < cells_total,
        "cells": cells,
        "walls_s": walls,
        "measured_s": sum(walls),
        "mean_s": mean,
        "total_s": mean * cells_total if len(walls) < cells_total else sum(walls),
    }


def amount(value: float, unit: str) -> str:
    return f"{value:.1f} s" if unit == "s" else f"{value:.2f}{unit}"


def evaluate(target: Target, value: float, whole_torch_cpu_matrix: bool) -> dict:
    """Met or missed, and by how much (absolute, and relative to the limit)."""
    result = {**asdict(target), "value": value, "met": None, "margin": None}
    if target.whole_torch_cpu_matrix_only and not whole_torch_cpu_matrix:
        result["verdict"] = "not evaluated: the target is for the whole torch-engine CPU matrix"
        return result
    margin = target.limit - value if target.op == "<" else value - target.limit  # > 0: room to spare
    met = margin > 0 if target.op == "<" else margin >= 0
    share = f"{abs(margin) / target.limit:.0%}"
    if target.op == "<":
        side = f"{share} under the limit" if met else f"{share} over the limit"
    else:
        side = f"{share} above the minimum" if met else f"{share} short of the minimum"
    verdict = f"{'met' if met else 'missed'} by {amount(abs(margin), target.unit)} ({side})"
    return {**result, "met": met, "margin": margin, "verdict": verdict}


def figures(import_walls: list[float], runs: list[dict], per_cell: dict, meta: dict) -> dict:
    """Everything the report shows, derived from the measurements."""
    walls = [run["wall_s"] for run in runs]
    wall = statistics.median(walls)
    import_s = statistics.median(import_walls)
    compute_s = statistics.median(run["compute_s"] for run in runs)
    floor = import_s + compute_s
    values = {
        "matrix_wall_s": wall,
        "overhead_ratio": wall / floor,
        "speedup": per_cell["total_s"] / wall,
    }
    whole = runs[0]["whole_torch_cpu_matrix"]
    return {
        **meta,
        "selection": {
            "cells": len(runs[0]["cells"]),
            "counts": runs[0]["counts"],
            "whole_torch_cpu_matrix": whole,
        },
        "matrix": {
            "walls_s": walls,
            "median_s": wall,
            "min_s": min(walls),
            "compute_s": [run["compute_s"] for run in runs],
            "exit_statuses": [run["exit_status"] for run in runs],
        },
        "floor": {
            "modules": imported_modules(runs),
            "modules_from_runs": any(run.get("imports") is not None for run in runs),
            "import_walls_s": import_walls,
            "import_s": import_s,
            "compute_s": compute_s,
            "floor_s": floor,
        },
        "overhead_ratio": values["overhead_ratio"],
        "per_cell": per_cell,
        "speedup": values["speedup"],
        "targets": [evaluate(target, values[target.figure], whole) for target in TARGETS],
    }


def cpu_seconds() -> tuple[float | None, float]:
    """(CPU time the whole machine spent busy, from /proc/stat, or None; CPU time of this
    process and its finished children)."""
    busy = None
    try:
        fields = [int(field) for field in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
        busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait
    except (OSError, ValueError):
        pass
    own = sum(
        usage.ru_utime + usage.ru_stime
        for usage in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )
    return busy, own


def watched(measure, *args):
    """measure(*args), and the cores other processes kept busy meanwhile, on average (or None)."""
    busy_before, own_before = cpu_seconds()
    start = time.perf_counter()
    result = measure(*args)
    elapsed = time.perf_counter() - start
    busy_after, own_after = cpu_seconds()
    if busy_before is None or busy_after is None or elapsed <= 0:
        return result, None
    return result, max(0.0, (busy_after - busy_before) - (own_after - own_before)) / elapsed


def machine() -> dict:
    from matrix.devices import fingerprint as environment

    return {
        "cpu": environment.cpu_name(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": environment.package_versions(),
        "git": environment.git_state(ROOT),
    }


def bench_arguments(args: argparse.Namespace, extra: list[str]) -> str:
    """The arguments that reproduce this run (those that differ from the defaults)."""
    words = []
    if args.runner != DEFAULT_RUNNER:
        words += ["--runner", args.runner]
    if args.repeat != DEFAULT_REPEAT:
        words += ["--repeat", str(args.repeat)]
    if args.per_cell_sample is not None:
        words += ["--per-cell-sample", str(args.per_cell_sample)]
    if args.per_engine:
        words += ["--per-engine"]
    return shlex.join(words + (["--", *extra] if extra else []))


def seconds(values: list[float]) -> str:
    return ", ".join(f"{value:.1f} s" for value in values)


def report_markdown(f: dict) -> str:
    m, fl, pc = f["machine"], f["floor"], f["per_cell"]
    counts = ", ".join(f"{n} {outcome}" for outcome, n in f["selection"]["counts"].items() if n)
    packages = ", ".join(f"{name} {version}" for name, version in m["packages"].items() if version)
    commit = m["git"].get("commit") or "unknown"
    commit = f"{commit[:12]}{' (uncommitted changes)' if m['git'].get('dirty') else ''}"
    if pc["extrapolated"]:
        per_cell_how = f"extrapolated from {pc['cells_run']} of {pc['cells_total']} cells ({seconds(pc['walls_s'])})"
    else:
        per_cell_how = f"all {pc['cells_total']} cells measured"
    load = f["load"]
    other = load["other_cpu_cores"]  # phase -> cores, or None
    busy = ", ".join(
        f"{PHASES[phase]} {'unknown' if cores is None else f'{cores:.2f}'}" for phase, cores in other.items()
    )
    disturbed = [PHASES[phase] for phase, cores in other.items() if cores is not None and cores > BUSY_SHARE_WARNING]
    lines = [
        "# Benchmarks",
        "",
        f"Measured by `python -m matrix.tools.bench` on {f['date']}.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        f"| CPU | {m['cpu']}, {m['cpu_count']} cores |",
        f"| Python | {m['python']} ({m['platform']}) |",
        f"| packages | {packages} |",
        f"| project commit | {commit} |",
        f"| load average (1 min) | {load['before']:.2f} before, {load['after']:.2f} after (the bench adds about 1) |",
        f"| cores other processes kept busy, on average | {busy} |",
        "",
    ]
    if disturbed:
        lines += [f"⚠️ Other processes were busy during the {', '.join(disturbed)}: those timings are inflated.", ""]
    lines += [
        "## Selection",
        "",
        f"`{f['runner']} {shlex.join(f['pytest_args'])}`: {f['selection']['cells']} cells ({counts}).",
        "",
        "## Figures",
        "",
        "| figure | value |",
        "|---|---|",
        f"| matrix wall, each run | {seconds(f['matrix']['walls_s'])} |",
        f"| matrix wall, median (min) | {f['matrix']['median_s']:.1f} s ({f['matrix']['min_s']:.1f} s) |",
        f"| floor = import + cell compute | {fl['floor_s']:.1f} s = {fl['import_s']:.1f} s + {fl['compute_s']:.1f} s |",
        f"| import what the runs imported, each time (median) | {seconds(fl['import_walls_s'])} "
        f"({fl['import_s']:.1f} s) |",
        f"| cell compute, each run (median) | {seconds(f['matrix']['compute_s'])} ({fl['compute_s']:.1f} s) |",
        f"| overhead ratio = wall / floor | {f['overhead_ratio']:.2f} |",
        f"| process-per-cell total | {pc['total_s']:.1f} s, {pc['mean_s']:.2f} s per cell; {per_cell_how} |",
        f"| speed-up = process-per-cell / wall | {f['speedup']:.1f}x |",
        "",
        "The floor is what the matrix would take if running it cost nothing beyond importing the stack once "
        "and each cell's own compute (`duration_s` in results.json). The import is of "
        + ", ".join(f"`{name}`" for name in fl["modules"])
        + (
            ": what the runs had imported."
            if fl["modules_from_runs"]
            else ": the whole stack, because the runs did not say what they imported."
        ),
        "",
        "## Targets",
        "",
        "| target | goal | measured | verdict |",
        "|---|---|---|---|",
    ]
    for t in f["targets"]:
        mark = {True: "✅", False: "❌", None: "➖"}[t["met"]]
        goal = f"{t['op']} {amount(t['limit'], t['unit'])}"
        lines.append(f"| {t['label']} | {goal} | {amount(t['value'], t['unit'])} | {mark} {t['verdict']} |")
    if f.get("per_engine"):
        lines += ["", *per_engine_markdown(f["per_engine"], f["runner"])]
    lines += [
        "",
        "## How to reproduce",
        "",
        "```",
        f"nox -s bench -- {f['arguments']}" if f["arguments"] else "nox -s bench",
        f"python -m matrix.tools.bench {f['arguments']}".rstrip() + "   # the same, in an environment with the stack",
        "```",
        "",
    ]
    return "\n".join(lines)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(
        prog="python -m matrix.tools.bench",
        usage="%(prog)s [options] [-- pytest args]",
        description="Time the matrix against its floor and against one process per cell. pytest args after -- "
        f"are appended to the default selection ({' '.join(DEFAULT_SELECTION)}); a repeated option wins.",
    )
    parser.add_argument(
        "--runner",
        default=DEFAULT_RUNNER,
        help=f"the command that runs the matrix (default: {DEFAULT_RUNNER}); 'pytest' means python -m pytest cases",
    )
    parser.add_argument("--repeat", type=positive_int, default=DEFAULT_REPEAT, help="matrix runs and imports (3)")
    parser.add_argument(
        "--per-cell-sample", type=positive_int, metavar="K", help="run only K cells one per process, extrapolate"
    )
    parser.add_argument(
        "--per-engine",
        action="store_true",
        help="also run the CPU matrix over every engine once and report each engine's cell cost",
    )
    parser.add_argument("--write", action="store_true", help="also write the report to BENCHMARKS.md")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the figures as JSON")
    return parser.parse_args(own), extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    pytest_args = [*DEFAULT_SELECTION, *extra]
    load_before = os.getloadavg()[0]
    other = {}
    try:
        runner = runner_command(args.runner)
        with tempfile.TemporaryDirectory(prefix="matrix-bench-") as reports:
            runs, other["matrix"] = watched(run_matrix, runner, pytest_args, args.repeat, Path(reports))
        import_walls, other["import"] = watched(measure_import, args.repeat, imported_modules(runs))
        cells = runs[0]["cells"]
        per_cell, other["per_cell"] = watched(run_per_cell, cells, pytest_args, args.per_cell_sample)
        per_engine = None
        if args.per_engine:
            with tempfile.TemporaryDirectory(prefix="matrix-bench-") as reports:
                per_engine, other["per_engine"] = watched(run_per_engine, runner, extra, Path(reports))
    except BenchError as error:
        print(f"python -m matrix.tools.bench: {error}", file=sys.stderr)
        return 2
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "load": {"before": load_before, "after": os.getloadavg()[0], "other_cpu_cores": other},
        "runner": PYTEST_RUNNER if args.runner == "pytest" else args.runner,
        "pytest_args": pytest_args,
        "arguments": bench_arguments(args, extra),
    }
    result = figures(import_walls, runs, per_cell, meta)
    if per_engine is not None:
        result["per_engine"] = per_engine
    markdown = report_markdown(result)
    print(markdown)
    if args.write:
        (ROOT / "BENCHMARKS.md").write_text(markdown)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
