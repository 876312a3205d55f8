"""python -m matrix COMMAND (also installed as `precision-matrix`):

  run [pytest args]      the matrix in a crash- and hang-surviving supervisor (matrix/run/supervisor.py)
  fold DIR               results.json from the journal of a run whose controller was killed
                         (matrix/results/run_directory.py)
  bisect ...             the release that changed one cell's outcome (matrix/releases/bisection.py)
  sweep ...              one selection over several releases of a package (matrix/releases/sweep.py)
  releases -o PAGE       the published table: the sweeps of matrix/releases/releases.toml, then the page
  repro CELL             a standalone script that reproduces one cell (matrix/releases/repro/)
  entry-releases         each catalogued bug's script on the releases its entry names
                         (matrix/releases/entry_releases.py: docs/entry-releases.md)
  triage RUN             each new signature of a run as a standalone script, run in a fresh process:
                         reproduces, does not reproduce, another failure (matrix/releases/triage.py)
  rejudge RUN            a run's cells classified again against the catalogue as it is now, without
                         running a cell (matrix/releases/rejudge.py)
  replay CELL            one cell, optionally with an exploration's variant
  diff OLD NEW           what changed between two runs (matrix/results/compare.py)
  merge A B -o DIR       shard reports into one run (matrix/shards/merge.py)
  compatibility RUN      the architecture table of a run's hf: cells (matrix/results/compatibility.py)
  curves initial|write   golden loss curves: their saved initial weights, a run's curves as golden
                         (matrix/results/curves.py); `diff GOLDEN RUN` compares a run with them

Exit status 2 means bad input, with one line saying which file and field. Exit status 4 (sweep,
releases, bisect) means the selected cells did not run with some release (they skipped, or no run
came back): the command decides nothing about it, and says where and why (matrix/releases/bisection.py
NOTHING_RAN_STATUS); for triage, that the run has no new signature to triage (its page says so)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PLUGIN_HELP = "a module that registers model kinds (or other axis values), as pytest's -p loads it; repeatable"


def load_plugins(command: str, modules: list[str]) -> bool:
    """Import the -p modules, as pytest would have: False (after one line) if one does not load."""
    import importlib

    from matrix.grid.registry import RegistrationError

    for module in modules:
        try:
            importlib.import_module(module)
        except (ImportError, SyntaxError, RegistrationError) as error:
            print(f"python -m matrix {command}: -p {module}: {type(error).__name__}: {error}", file=sys.stderr)
            return False
    return True


def add_run_arguments(parser) -> None:
    """A command that reads a run made earlier (triage, rejudge): the run, and the -p modules its
    cells need (the run's own, named in their re-run commands, are loaded too)."""
    parser.add_argument("run", type=Path, help="a report directory or its results.json")
    parser.add_argument(
        "-p",
        dest="plugins",
        action="append",
        default=[],
        metavar="MODULE",
        help=PLUGIN_HELP + " (the run's own -p modules, named in its cells' re-run commands, are loaded too)",
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        from matrix.run.supervisor import main as run_matrix

        return run_matrix(argv[1:])  # everything after `run` is pytest's; run --help is the runner's own
    parser = argparse.ArgumentParser(prog="python -m matrix")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "run",
        help="the matrix in one pytest process that survives crashes and hangs: python -m matrix run "
        "[pytest args] (cells that kill the process or hang are recorded, the rest still run)",
    )
    fold = commands.add_parser("fold", help="results.json from the journal of a run whose controller was killed")
    fold.add_argument("directory", type=Path, help="the run's directory, reports/<run-id>")
    bisect = commands.add_parser("bisect", help="find the release that changed one cell's outcome")
    bisect.add_argument("--package", required=True)
    bisect.add_argument("--good", required=True, help="a version at one end (either order)")
    bisect.add_argument("--bad", required=True, help="a version at the other end")
    bisect.add_argument(
        "--cell", required=True, help="a cell id, e.g. gemma-cache-bf16-loaded-mixed-eval-cpu-accelerate"
    )
    bisect.add_argument("--stack", default="default", help="stack from matrix/releases/stacks.toml to bisect on")
    bisect.add_argument("--report-dir", default=None, help="default: reports/ here")
    sweep = commands.add_parser(
        "sweep",
        help="run a cell selection over several releases of one package: a compatibility table "
        "(arguments it does not know are the selection, as for python -m matrix run)",
    )
    sweep.add_argument("--package", required=True)
    releases = sweep.add_mutually_exclusive_group(required=True)
    releases.add_argument("--last", type=int, help="the N newest releases pip's index lists")
    releases.add_argument("--versions", help="these releases, comma-separated")
    sweep.add_argument("--newest", help="with --last: the newest release to include (default: the newest listed)")
    sweep.add_argument(
        "--per",
        choices=("release", "minor"),
        default="release",
        help="with --last: count releases, or minor lines (the newest patch of each)",
    )
    sweep.add_argument("--stack", default="default", help="stack from matrix/releases/stacks.toml to sweep on")
    sweep.add_argument(
        "--in-this-environment",
        action="store_true",
        help="install the releases into the interpreter running the sweep, as it is (no scratch environment, the "
        "stack's pins not installed), putting the package back after: for a machine that already has the stack",
    )
    sweep.add_argument("--report-dir", default=None, help="default: reports/ here")
    published = commands.add_parser(
        "releases", help="the published compatibility table: the sweeps of matrix/releases/releases.toml, then the page"
    )
    published.add_argument("-o", "--output", type=Path, required=True, help="the page, e.g. docs/RELEASES.md")
    published.add_argument(
        "--from", dest="sweeps", type=Path, nargs="+", help="write the page from these sweep directories, running none"
    )
    published.add_argument("--report-dir", default=None, help="where the sweeps go (default: reports/ here)")
    repro = commands.add_parser("repro", help="write a standalone script that reproduces one cell")
    repro.add_argument("-p", dest="plugins", action="append", default=[], metavar="MODULE", help=PLUGIN_HELP)
    repro.add_argument("cell", help="a cell id, e.g. tiny-transformer-bf16-mixed-eval-cpu-torch")
    repro.add_argument("--run", type=Path, help="a report directory or results.json: its pins and failing phase")
    repro.add_argument("-o", "--output", type=Path, help="where to write the script (default: stdout)")
    repro.add_argument("--variant", help="settings as JSON, as an exploration's finding records them")
    repro.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks a distributed engine's script starts (default: the ranks the run's cell had, else the matrix's 2)",
    )
    shown = commands.add_parser(
        "entry-releases", help="each catalogued bug's script on the releases its entry names, then the page"
    )
    shown.add_argument("--entry", action="append", help="a bug entry's id (default: every one); repeatable")
    shown.add_argument("--release", action="append", help="only this release, PACKAGE==VERSION; repeatable")
    shown.add_argument("--budget", type=float, default=3000.0, help="seconds; rows left then keep earlier results")
    shown.add_argument("--stack", default="default", help="the stack whose scratch environment the releases go into")
    shown.add_argument("--writer", default=sys.executable, help="the Python that writes the scripts (default: this)")
    shown.add_argument("-p", dest="plugins", action="append", default=[], metavar="MODULE", help=PLUGIN_HELP)
    shown.add_argument("-o", "--output", type=Path, default=None, help="the page (default: docs/entry-releases.md)")
    triaged = commands.add_parser(
        "triage",
        help="run each new signature's smallest cell as a standalone script in a fresh process and classify it: "
        "reproduces (an upstream candidate), does not reproduce (a harness suspect), another failure",
    )
    add_run_arguments(triaged)
    triaged.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long one run of a script may take before it is stopped and classified timed-out (default 600)",
    )
    triaged.add_argument(
        "--only", action="append", metavar="SIGNATURE", help="triage this new signature only (repeatable)"
    )
    triaged.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop starting scripts after this long in all; the signatures left are classified not-run",
    )
    judged = commands.add_parser(
        "rejudge",
        help="classify a run's cells again against the catalogue as it is now (its versions and machine as the "
        "run recorded them), without running a cell; exit 1 when a cell reads new",
    )
    add_run_arguments(judged)
    judged.add_argument(
        "--catalogue",
        dest="catalogues",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="a catalogue file added to the built-in one, as the run's --catalogue (repeatable)",
    )
    judged.add_argument(
        "--no-builtin-catalogue", action="store_true", help="leave out the built-in catalogue, as the run's option"
    )
    judged.add_argument("--json", type=Path, help="also write every cell's outcome before and after here")
    replay = commands.add_parser("replay", help="run one cell, optionally with an exploration's variant")
    replay.add_argument("-p", dest="plugins", action="append", default=[], metavar="MODULE", help=PLUGIN_HELP)
    replay.add_argument("cell", help="a cell id, e.g. tiny-transformer-bf16-mixed-eval-cpu-torch")
    replay.add_argument("--variant", help="settings as JSON (default: the grid's)")
    replay.add_argument("--cuda-device", type=int, default=0)
    compare = commands.add_parser(
        "diff", help="what changed between two runs; exit 1 on new failures (the nightly gate)"
    )
    compare.add_argument("old", type=Path, help="the earlier run: a report directory or its results.json")
    compare.add_argument("new", type=Path, help="the later run: a report directory or its results.json")
    compare.add_argument("--format", choices=("markdown", "json"), default="markdown", help="what goes to stdout")
    compare.add_argument("--md-out", type=Path, help="also write the Markdown here (a CI job summary)")
    compare.add_argument("--json-out", type=Path, help="also write the JSON here")
    compare.add_argument(
        "--fail-on",
        default="new,missing",
        help="comma-separated categories that make the exit status 1 (default: new,missing; 'none' never gates): "
        "new, fixed, signature-changed, added, removed, missing, known-started, known-stopped, skipped, drift, "
        "curve-moved",
    )
    compare.add_argument(
        "--drift-threshold",
        type=float,
        default=None,
        metavar="F",
        help="drift: fp32 deviation grown by more than F times what the tolerance allows (default 0.25)",
    )
    compare.add_argument(
        "--bisect-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="when there are new failures and package versions differ between the runs, bisect each new "
        "signature's first cell over every changed package, for at most this long (matrix/releases/new_failures.py)",
    )
    compare.add_argument("--bisect-stack", help="the stack to bisect on (default: the new run's, else default)")
    compare.add_argument(
        "--bisect-dir", type=Path, help="where the bisections and repro scripts go (default: reports/ here)"
    )
    merge = commands.add_parser("merge", help="combine shard reports (--shard K/N) into one run")
    merge.add_argument("inputs", nargs="+", type=Path, help="report directories or results.json files")
    merge.add_argument("-o", "--output", type=Path, required=True, help="the merged run's directory (must not exist)")
    merge.add_argument(
        "--allow-mixed-stacks", action="store_true", help="merge runs of different package versions or commits"
    )
    table = commands.add_parser(
        "compatibility", help="the architecture table (hf: kinds) of a run, as Markdown: a docs page or stdout"
    )
    table.add_argument("run", type=Path, help="a report directory or its results.json")
    table.add_argument("-o", "--output", type=Path, help="where to write it (default: stdout)")
    golden = commands.add_parser("curves", help="golden loss curves: their initial weights, a run's curves as golden")
    golden_commands = golden.add_subparsers(dest="curves_command", required=True)
    initial = golden_commands.add_parser(
        "initial",
        help="save the initial weights and batch of the golden selection's kinds (matrix/models/initial_weights.py)",
    )
    initial.add_argument("--dir", type=Path, default=None, help="default: matrix/golden/initial")
    initial.add_argument("--force", action="store_true", help="write a kind's file that exists already")
    check = golden_commands.add_parser(
        "run",
        help="run the golden selection from the saved initial weights and compare its curves with the stack's golden "
        "ones (or --write them); arguments it does not know go to the run",
    )
    check.add_argument("--write", action="store_true", help="write the run's curves as the golden ones instead")
    check.add_argument("--stack", default=None, help="whose golden curves (default: MATRIX_STACK, else default)")
    check.add_argument("--report-dir", type=Path, default=None, help="default: reports/curves")
    write = golden_commands.add_parser("write", help="a run's training curves as the golden curves of a stack")
    write.add_argument("run", type=Path, help="a report directory or its results.json")
    write.add_argument("--stack", default=None, help="the stack they are golden for (default: the run's, else default)")
    write.add_argument("-o", "--output", type=Path, help="default: matrix/golden/curves-<stack>.json")
    args, extra = parser.parse_known_args(argv)
    extra = without_separator(extra)
    takes_no_more = args.command in (
        "diff",
        "merge",
        "compatibility",
        "curves",
        "triage",
        "entry-releases",
        "rejudge",
    ) and (
        args.command != "curves" or args.curves_command != "run"  # curves run hands the rest to the run
    )
    if takes_no_more and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")

    if args.command == "fold":
        return fold_run(args.directory)
    if args.command == "diff":
        return diff_runs(args)
    if args.command == "merge":
        return merge_runs(args)
    if args.command == "compatibility":
        return compatibility_table(args.run, args.output)
    if args.command == "curves":
        return golden_curves(args, extra)
    if args.command == "triage":
        return triage_run(args)
    if args.command == "rejudge":
        return rejudge_run(args)
    if args.command in ("replay", "repro", "entry-releases") and not load_plugins(args.command, args.plugins):
        return 2
    if args.command == "replay":
        return replay_cell(args.cell, args.variant, args.cuda_device)

    if args.command == "repro":
        from matrix.releases.repro import ReproError, generate

        try:
            script = generate(args.cell, args.run, args.variant, world=args.world_size)
        except ReproError as error:
            print(f"python -m matrix repro: {error}", file=sys.stderr)
            return 2
        if args.output:
            args.output.write_text(script)
        else:
            sys.stdout.write(script)
        return 0

    if args.command == "sweep":
        return sweep_releases(args, extra)
    if args.command == "entry-releases":
        return entry_releases(args)
    if args.command == "releases":
        return publish_releases(args)

    from matrix.releases.bisection import NOTHING_RAN_STATUS, BisectError, NothingRan
    from matrix.releases.bisection import bisect as run_bisect

    try:
        from matrix.results.run_directory import reports_root

        run_bisect(args.package, args.good, args.bad, args.cell, args.stack, reports_root(args.report_dir), extra)
    except BisectError as error:
        print(f"python -m matrix bisect: {error}", file=sys.stderr)
        return NOTHING_RAN_STATUS if isinstance(error, NothingRan) else 2
    return 0


def without_separator(extra: list[str]) -> list[str]:
    """The arguments a command hands to pytest, without the `--` a user may put before them
    (`python -m matrix sweep --package X -- --model lora`): argparse keeps it among the unknown
    arguments, and pytest would take it to end its options and the selection for file names."""
    if "--" not in extra:
        return extra
    at = extra.index("--")
    return extra[:at] + extra[at + 1 :]


def entry_releases(args) -> int:
    from matrix.releases.entry_releases import PAGE, EntryReleasesError, run

    try:
        run(args.entry, args.release, args.budget, args.stack, args.writer, args.plugins, args.output or PAGE)
    except EntryReleasesError as error:
        print(f"python -m matrix entry-releases: {error}", file=sys.stderr)
        return 2
    return 0


def sweep_releases(args, selection: list[str]) -> int:
    from matrix.releases.bisection import NOTHING_RAN_STATUS, BisectError
    from matrix.releases.sweep import chosen_versions, sweep
    from matrix.results.run_directory import reports_root
    from matrix.results.sweep_table import nothing_ran

    try:
        versions = chosen_versions(args.versions) if args.versions else None
        document, directory = sweep(
            args.package,
            versions=versions,
            last=args.last,
            newest=args.newest,
            per=args.per,
            stack_name=args.stack,
            selection=selection,
            reports_root=reports_root(args.report_dir),
            in_this_environment=args.in_this_environment,
        )
    except BisectError as error:  # SweepError included: bad input, or a scratch environment that cannot be built
        print(f"python -m matrix sweep: {error}", file=sys.stderr)
        return 2
    print(f"written: {directory / 'sweep.md'}, {directory / 'sweep.html'}, {directory / 'sweep.json'}")
    empty = nothing_ran(document)
    if empty:
        versions = ", ".join(entry["version"] for entry in empty)
        print(f"python -m matrix sweep: nothing ran in {versions}: no verdict there (see the page)", file=sys.stderr)
        return NOTHING_RAN_STATUS
    return 0


def publish_releases(args) -> int:
    import json

    from matrix.releases.bisection import BisectError
    from matrix.releases.sweep import chosen_versions, published_sweeps, sweep
    from matrix.results.run_directory import reports_root
    from matrix.results.sweep_table import releases_page

    documents = []
    try:
        if args.sweeps:
            documents = [json.loads((Path(d) / "sweep.json").read_text()) for d in args.sweeps]
        else:
            selection, sweeps = published_sweeps()
            for entry in sweeps:
                document, _ = sweep(
                    entry["package"],
                    versions=chosen_versions(",".join(entry["versions"])) if "versions" in entry else None,
                    last=entry.get("last"),
                    newest=None,
                    per=entry.get("per", "release"),
                    stack_name="default",
                    selection=selection,
                    reports_root=reports_root(args.report_dir),
                )
                documents.append(document)
    except (BisectError, OSError) as error:
        print(f"python -m matrix releases: {error}", file=sys.stderr)
        return 2
    args.output.write_text(releases_page(documents, "nox -s releases"))
    print(f"written: {args.output}")
    from matrix.releases.bisection import NOTHING_RAN_STATUS
    from matrix.results.sweep_table import nothing_ran

    empty = [f"{d['package']} {e['version']}" for d in documents for e in nothing_ran(d)]
    if empty:
        print(f"python -m matrix releases: nothing ran in {', '.join(empty)}: no verdict there", file=sys.stderr)
        return NOTHING_RAN_STATUS
    return 0


def fold_run(directory: Path) -> int:
    from matrix.results import journal
    from matrix.results.run_directory import fold_journal

    if (directory / "results.json").exists():
        print(f"python -m matrix fold: {directory}/results.json exists: nothing to fold", file=sys.stderr)
        return 2
    try:
        document = fold_journal(directory)
    except (OSError, ValueError, KeyError) as error:
        print(f"python -m matrix fold: {error}", file=sys.stderr)
        return 2
    print(f"{directory}: {len(document['cells'])} cells from {journal.JOURNAL}, marked incomplete")
    return 0


def diff_runs(args) -> int:
    from matrix.results import compare
    from matrix.results.files import ResultsError, load

    try:
        fail_on = compare.parse_fail_on(args.fail_on)
        if args.drift_threshold is not None and not args.drift_threshold > 0:
            raise ValueError(f"--drift-threshold: {args.drift_threshold} is not a positive fraction")
        (old, old_file), (new, new_file) = load(args.old), load(args.new)
    except (ResultsError, ValueError) as error:
        print(f"python -m matrix diff: {error}", file=sys.stderr)
        return 2
    fraction = compare.DRIFT_FRACTION if args.drift_threshold is None else args.drift_threshold
    result = compare.diff(old, new, old_source=str(old_file), new_source=str(new_file), drift_fraction=fraction)
    if args.bisect_budget is not None and result.changes["new"] and result.packages:
        from matrix.releases.new_failures import bisect_new_failures
        from matrix.results.run_directory import reports_root

        stack = args.bisect_stack or result.new_run.get("stack") or "default"
        output = (args.bisect_dir or reports_root(None)) / f"diff-bisect-{new['run']['id']}"
        result.bisections = bisect_new_failures(
            result.changes["new"],
            result.packages,
            stack=stack,
            budget_s=args.bisect_budget,
            output=output,
            new_run=new_file,
            log=lambda line: print(line, file=sys.stderr),
        )
    if args.bisect_budget is not None and result.changes["curve-moved"] and result.packages:
        from matrix.releases.new_failures import bisect_moved_curves
        from matrix.results.run_directory import reports_root

        stack = args.bisect_stack or result.new_run.get("stack") or "default"
        output = (args.bisect_dir or reports_root(None)) / f"diff-bisect-{new['run']['id']}"
        spent = sum(record.get("seconds", 0) for record in result.bisections)
        result.bisections += bisect_moved_curves(
            result.changes["curve-moved"],
            result.packages,
            old,
            new["run"],
            stack=stack,
            budget_s=max(args.bisect_budget - spent, 0),
            output=output,
            log=lambda line: print(line, file=sys.stderr),
        )
    markdown, as_json = compare.diff_markdown(result, fail_on), compare.diff_json(result, fail_on)
    for path, text in ((args.md_out, markdown), (args.json_out, as_json)):
        if path:
            path.write_text(text, encoding="utf-8")
    sys.stdout.write(as_json if args.format == "json" else markdown)
    return 1 if result.gating(fail_on) else 0


def rejudge_run(args) -> int:
    """0: no cell reads new, 1: some do, 2: bad input."""
    import json

    from matrix.catalogue.entries import CatalogueError, assemble
    from matrix.releases import rejudge, triage
    from matrix.results.files import ResultsError, load
    from matrix.selection.cells import SelectionError

    def refuse(message: str) -> int:
        print(f"python -m matrix rejudge: {message}", file=sys.stderr)
        return 2

    try:
        document, file = load(args.run)
    except ResultsError as error:
        return refuse(str(error))
    if not load_plugins("rejudge", list(dict.fromkeys([*args.plugins, *triage.recorded_plugins(document["cells"])]))):
        return 2
    try:
        catalogue = assemble(tuple(args.catalogues), builtin=not args.no_builtin_catalogue)
        judged = rejudge.rejudge(document, catalogue)
    except (CatalogueError, SelectionError) as error:
        return refuse(str(error))
    against = "no built-in catalogue" if args.no_builtin_catalogue else "the built-in catalogue"
    print(f"{file}, judged again against {against}" + "".join(f" + {path}" for path in args.catalogues) + ":")
    for line in rejudge.summary_lines(judged):
        print(line)
    if args.json:
        args.json.write_text(json.dumps([cell.as_dict() for cell in judged], indent=1))
        print(f"written: {args.json}")
    return 1 if any(cell.after == "failed" for cell in judged) else 0


def triage_run(args) -> int:
    """0: triaged (whatever the classifications), 2: bad input, 4: no new signature to triage."""
    from matrix.releases import triage
    from matrix.results.files import ResultsError, load

    def refuse(message: str) -> int:
        print(f"python -m matrix triage: {message}", file=sys.stderr)
        return 2

    for name, value in (("--timeout", args.timeout), ("--budget", args.budget)):
        if value is not None and not value > 0:
            return refuse(f"{name}: {value:g} is not a positive number of seconds")
    try:
        document, file = load(args.run)
    except ResultsError as error:
        return refuse(str(error))
    found = triage.new_signatures(document)
    try:
        chosen = triage.select(found, args.only)  # before the plugins: bad input says so at once
    except triage.TriageError as error:
        return refuse(str(error))
    modules = list(dict.fromkeys([*args.plugins, *triage.recorded_plugins(c for s in chosen for c in s.cells)]))
    if not load_plugins("triage", modules):
        return 2
    result = triage.triage(
        document,
        file,
        modules,
        timeout_s=args.timeout or triage.DEFAULT_TIMEOUT_S,
        only=args.only,
        budget_s=args.budget,
        log=lambda line: print(line, file=sys.stderr),
    )
    summary = result.as_dict()
    for path in triage.write(summary, document, file.parent):
        print(f"written: {path}")
    for entry in summary["signatures"]:
        label = triage.CLASSIFICATIONS[entry["classification"]]
        print(f"{entry['signature']['id']} ({len(entry['cells'])} cells): {label}: {entry['summary']}")
    if not found:
        print(f"python -m matrix triage: {file}: no new failure to triage", file=sys.stderr)
        return triage.NOTHING_NEW_STATUS
    return 0


def compatibility_table(run: Path, output: Path | None) -> int:
    from matrix.results.compatibility import compatibility_markdown
    from matrix.results.files import ResultsError, load

    try:
        document, file = load(run)
    except ResultsError as error:
        print(f"python -m matrix compatibility: {error}", file=sys.stderr)
        return 2
    markdown = compatibility_markdown(document)
    if markdown is None:
        print(f"python -m matrix compatibility: {file}: the run has no hf: cells", file=sys.stderr)
        return 2
    if output:
        output.write_text(markdown, encoding="utf-8")
    else:
        sys.stdout.write(markdown)
    return 0


def merge_runs(args) -> int:
    from matrix.results.files import ResultsError
    from matrix.shards.merge import MergeError, merge, write_merged

    if args.output.exists():
        print(
            f"python -m matrix merge: {args.output}: exists; merge never writes into an existing directory",
            file=sys.stderr,
        )
        return 2
    try:
        document = merge(args.inputs, allow_mixed_stacks=args.allow_mixed_stacks, run_id=args.output.name)
        write_merged(document, args.output)
    except (ResultsError, MergeError) as error:
        print(f"python -m matrix merge: {error}", file=sys.stderr)
        return 2
    counts = document["counts"]
    print(
        f"{args.output}: {len(document['cells'])} cells from {len(args.inputs)} runs: "
        f"{counts['failed']} failures not in the catalogue, "
        f"{counts['fixed']} fixed, {counts['known']} known, {counts['passed']} passed, {counts['skipped']} skipped"
    )
    for warning in document["environment"]["warnings"]:
        print(f"warning: {warning}")
    if document["run"]["incomplete"]:
        print(f"{args.output}: incomplete: {len(document['missing'])} cells missing (listed in its summary.md)")
        return 1
    return 0


def replay_cell(cell_id: str, variant_json: str | None, cuda_index: int) -> int:
    """Exit 0 when the cell passes, 1 when it fails (its signature first, then the cell, its
    message and its whole traceback), 2 on bad input."""
    import tempfile

    from matrix.execute.cell_run import run_cell
    from matrix.grid.variants import InvalidVariant, from_json
    from matrix.models import MODELS
    from matrix.selection.cells import cell_from_id

    cell = cell_from_id(cell_id)
    if cell is None:
        print(f"python -m matrix replay: no cell {cell_id!r}", file=sys.stderr)
        return 2
    variant = None
    if variant_json is not None:
        try:
            variant = from_json(variant_json, MODELS[cell.model].grid_variant)
            MODELS[cell.model].check_variant(variant)
        except (InvalidVariant, ValueError) as error:
            print(f"python -m matrix replay: --variant: {error}", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="matrix-replay-") as workdir:
        result = run_cell(cell, Path(workdir), cuda_index, variant=variant)
    if result.outcome == "passed":
        print(f"{cell.id}: passed")
        return 0
    print(f"{result.signature.id} {result.signature.text}\n{cell.id}: failed in {result.phase}\n{result.message}")
    if result.traceback:  # whole: a record keeps its ends (crash_dump.TRACEBACK_LIMIT), a replay is for reading it all
        print("\n" + result.traceback.rstrip("\n"))
    return 1


def golden_curves(args, extra: list[str]) -> int:
    """curves initial: the golden kinds' saved initial weights; curves run: the golden selection,
    compared with (or written as) the golden curves; curves write RUN: its curves as golden."""
    import os

    from matrix.results import curves

    if args.curves_command == "run":
        import subprocess

        stack = args.stack or os.environ.get("MATRIX_STACK") or "default"
        reports = args.report_dir or Path("reports") / "curves"
        if golden_curves(argparse.Namespace(curves_command="initial", dir=None, force=False), []):
            return 2
        run = [sys.executable, "-m", "matrix", "run", "cases", *curves.GOLDEN_SELECTION]
        run += ["--curve-steps", str(curves.GOLDEN_STEPS), "--initial-weights", str(curves.INITIAL_WEIGHTS_DIR)]
        status = subprocess.run([*run, "--report-dir", str(reports), *extra]).returncode
        latest = reports / "latest"
        if not (latest / "results.json").is_file():
            print(f"python -m matrix curves run: the run wrote no results (exit status {status})", file=sys.stderr)
            return 2
        if args.write:
            written = golden_curves(
                argparse.Namespace(curves_command="write", run=latest, stack=stack, output=None), []
            )
            return written or status
        golden = curves.golden_path(stack)
        if not golden.is_file():
            print(f"python -m matrix curves run: no golden curves for stack {stack} ({golden}); --write makes them")
            return 2
        compared = main(["diff", str(golden), str(latest), "--fail-on", "curve-moved,removed,missing"])
        return compared or status

    if args.curves_command == "initial":
        import tempfile

        from matrix.models import MODELS, initial_weights

        directory = args.dir or curves.INITIAL_WEIGHTS_DIR
        kinds = curves.GOLDEN_SELECTION[curves.GOLDEN_SELECTION.index("--model") + 1].split(",")
        for name in kinds:
            if initial_weights.path_of(name, directory).exists() and not args.force:
                print(f"{initial_weights.path_of(name, directory)}: kept (--force writes it again)")
                continue
            with tempfile.TemporaryDirectory(prefix="matrix-initial-") as workdir:
                print(f"written: {initial_weights.save(MODELS[name], directory, Path(workdir))}")
        return 0
    from matrix.results.files import ResultsError, load

    try:
        results, _ = load(args.run)
    except ResultsError as error:
        print(f"python -m matrix curves write: {error}", file=sys.stderr)
        return 2
    stack = args.stack or results["run"].get("stack") or "default"
    document = curves.golden_document(results)
    if not document["cells"]:
        print(f"python -m matrix curves write: {args.run} has no training cell with a curve", file=sys.stderr)
        return 2
    path = args.output or curves.golden_path(stack)
    curves.write_golden(document, path)
    print(
        f"written: {path} ({len(document['cells'])} curves of {results['run'].get('curve_steps')} steps, stack {stack})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
