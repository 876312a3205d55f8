"""python -m matrix triage RUN: is each new failure of a run the stack's bug or the harness's?

For every new signature of the run (a failure no catalogue entry explains: outcome `failed`), its
smallest cell (the least recorded cell time, ties by id) is written as a standalone script
(matrix/repro: RUN/triage/<signature>.py) and run in a fresh process, in an empty directory,
with nothing of this project importable but the -p modules' directories (a user's model kind is
built through its own module). Where the device does not step deterministically (cuda,
matrix/devices Device.deterministic_steps) it runs twice. Each signature gets one classification:

  reproduces          the script failed the way the cell did, with no harness around it: a bug
                      of the stack (or of the user's code) and an upstream candidate; a draft
                      catalogue entry and a draft upstream issue go with it
  does-not-reproduce  every check of the cell held standalone: a harness suspect, with the phase
                      the cell failed in and what differed (the run's numbers, the script's)
  another-failure     the script failed some other way (another phase, another exception): its
                      failure is named; neither verdict holds until that is understood
  timed-out           the script ran past --timeout: no verdict
  no-script           the cell cannot be written as a standalone script (repro's one line)
  not-run             its cell cannot run on this machine (the device's skip reason: a cuda cell
                      triaged where no GPU is), or --budget was spent before its turn

On a nondeterministic device a signature that reproduces in one of its runs is a candidate (the
page says in how many). The script's verdict is read from its --json file where it wrote one, else
from its exit status (1 the cell's failure, 0 every check held, 2 another failure) and its last
line; a REPRODUCED line naming another phase or exception than the cell's signature is another
failure.

What it writes: RUN/triage/ (the scripts, each run's output and --json file), RUN/triage.json,
RUN/triage.md, and RUN/index.html again with a triage section (matrix/results/html.py). Reading the
run and writing the pages need the standard library only; writing the scripts needs the stack
(matrix/releases/repro), running them a subprocess.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from matrix.grid.cell import AXES
from matrix.grid.packages import STACK

TRIAGE_DIR = "triage"
TRIAGE_JSON = "triage.json"
TRIAGE_MD = "triage.md"
DEFAULT_TIMEOUT_S = 600.0
NOTHING_NEW_STATUS = 4  # the run has no new signature: nothing to triage

CLASSIFICATIONS = {
    "reproduces": "reproduces without the harness (upstream candidate)",
    "does-not-reproduce": "does not reproduce (harness suspect)",
    "another-failure": "another failure",
    "timed-out": "timed out (no verdict)",
    "no-script": "no script (cannot be written standalone)",
    "not-run": "not run (its device is not here, or the budget was spent)",
}
# a script's own verdicts (its --json "outcome", or its exit status) -> the classification
SCRIPT_OUTCOMES = {"reproduced": "reproduces", "holds": "does-not-reproduce", "another": "another-failure"}
EXIT_OUTCOMES = {1: "reproduced", 0: "holds", 2: "another"}
LAST_LINE = re.compile(r"^(REPRODUCED|ANOTHER FAILURE) in (?P<phase>[\w.<>-]+): (?P<name>[\w.]+): (?P<message>.*)$")
# phases a cell record names that are not phases of a script: what happened to the cell's process
PROCESS_PHASES = ("timeout", "crash")
REGEX_SPECIAL = re.compile(r"([.^$*+?{}\[\]\\|()])")


class TriageError(ValueError):
    """Bad input (a run that cannot be read, --only naming no new signature): one line, exit 2."""


# ------------------------------------------------------------------ what the run says


@dataclass(frozen=True)
class NewSignature:
    """One new signature of a run: its record, its failed cells (records), the one triaged."""

    signature: dict
    cells: tuple[dict, ...]

    @property
    def id(self) -> str:
        return self.signature["id"]

    @property
    def smallest(self) -> dict:
        """The cell with the least recorded time, ties by id."""
        return min(self.cells, key=lambda c: (c.get("duration_s") or 0.0, c["id"]))


def new_signatures(document: dict) -> list[NewSignature]:
    """The run's new (uncatalogued) failures, grouped by signature: the most cells first, then by id."""
    grouped: dict[str, list[dict]] = {}
    signatures: dict[str, dict] = {}
    for cell in document["cells"]:
        if cell["outcome"] == "failed" and cell.get("signature"):
            grouped.setdefault(cell["signature"]["id"], []).append(cell)
            signatures.setdefault(cell["signature"]["id"], cell["signature"])
    found = [
        NewSignature(signatures[key], tuple(sorted(cells, key=lambda c: c["id"]))) for key, cells in grouped.items()
    ]
    return sorted(found, key=lambda s: (-len(s.cells), s.id))


def recorded_plugins(cells) -> list[str]:
    """The -p modules the cells were run with (each record's re-run command names them): a
    user's model kind exists only once its module is imported."""
    import shlex

    found: list[str] = []
    for cell in cells:
        words = shlex.split(cell.get("rerun") or "")
        for before, word in itertools.pairwise(words):
            if before == "-p" and not word.startswith("no:") and word != "matrix.plugin" and word not in found:
                found.append(word)
    return found


def module_directories(modules: list[str]) -> list[Path]:
    """The directory each imported -p module is found from (what a script's PYTHONPATH needs),
    leaving out any that would make this project's own package importable."""
    directories: list[Path] = []
    for name in modules:
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if not file:
            continue
        path = Path(file).resolve()
        depth = len(name.split(".")) - (0 if path.name == "__init__.py" else 1)
        directory = path.parents[depth]
        if not (directory / "matrix" / "__init__.py").exists() and directory not in directories:
            directories.append(directory)
    return directories


def script_environment(plugin_directories: list[Path]) -> dict[str, str]:
    """The environment a script runs in: this one, with a PYTHONPATH of the -p modules'
    directories and of what was inherited minus any entry holding this project's package (a
    script must not import the harness by accident)."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    kept = [p for p in inherited if not (Path(p) / "matrix" / "__init__.py").exists()]
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    path = [*map(str, plugin_directories), *kept]
    if path:
        environment["PYTHONPATH"] = os.pathsep.join(path)
    return environment


def not_runnable_here(cell: dict) -> str | None:
    """Why the cell cannot run on this machine (its device's skip reason for its precision), or None."""
    from matrix.devices import DEVICES
    from matrix.precisions.policies import PRECISIONS

    device, precision = DEVICES.get(cell["device"]), PRECISIONS.get(cell["precision"])
    if device is None or precision is None:  # an axis value no module registered here: the script says
        return None
    return device.skip_reason(precision)


def runs_for(device: str) -> int:
    """How many times a script runs: twice where the device does not step deterministically."""
    from matrix.devices import DEVICES

    found = DEVICES.get(device)  # a device no module registered here: once
    return 1 if found is None or found.deterministic_steps else 2


# ------------------------------------------------------------------ one run of a script


@dataclass
class ScriptRun:
    """What one run of a script said: its verdict (reproduced, holds, another, timeout), the
    phase and failure it names, its checks (from --json), its environment, its last line."""

    outcome: str
    exit_status: int | None
    seconds: float
    phase: str | None = None
    failure: dict | None = None  # {"name", "message"}
    checks: list = field(default_factory=list)
    environment: dict = field(default_factory=dict)
    last_line: str = ""
    log: str = ""  # the file its output went to, relative to the run's directory
    note: str = ""  # why triage read its verdict otherwise than the script said it

    def as_dict(self) -> dict:
        return {
            "outcome": self.outcome,
            "exit_status": self.exit_status,
            "seconds": round(self.seconds, 2),
            "phase": self.phase,
            "failure": self.failure,
            "checks": self.checks,
            "environment": self.environment,
            "last_line": self.last_line,
            "log": self.log,
            "note": self.note,
        }


def run_script(script: Path, json_path: Path, environment: dict, timeout_s: float) -> tuple[ScriptRun, str]:
    """Run `script --json json_path` in a fresh process and an empty directory -> (its verdict,
    its output). A run past `timeout_s` is stopped with its whole process group."""
    json_path.unlink(missing_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="matrix-triage-") as workdir:
        process = subprocess.Popen(
            [sys.executable, str(script.resolve()), "--json", str(json_path.resolve())],
            cwd=workdir,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: a timeout stops its children too
        )
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended meanwhile
                pass
            stdout, stderr = process.communicate()
            output = f"{stdout}\n{stderr}\n[stopped by triage after {timeout_s:g} s]\n"
            return ScriptRun("timeout", None, time.monotonic() - started), output
    seconds = time.monotonic() - started
    lines = [line for line in stdout.splitlines() if line.strip()]
    last = lines[-1].strip() if lines else ""
    verdict = read_verdict(process.returncode, last, stderr, json_path)
    verdict.seconds, verdict.last_line = seconds, last
    return verdict, f"{stdout}\n{stderr}"


def read_verdict(status: int, last_line: str, stderr: str, json_path: Path) -> ScriptRun:
    """A finished script's verdict: its --json file where it wrote a readable one, else its exit
    status and last line. An exit status that is none of the script's (an uncaught exception
    exits 1 too, without a REPRODUCED line; a signal) is another failure."""
    written = None
    if json_path.is_file():
        try:
            written = json.loads(json_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            written = None
    if isinstance(written, dict) and written.get("outcome") in SCRIPT_OUTCOMES:
        failure = written.get("failure") if isinstance(written.get("failure"), dict) else None
        return ScriptRun(
            written["outcome"],
            status,
            0.0,
            phase=written.get("phase"),
            failure=failure,
            checks=list(written.get("checks") or []),
            environment=dict(written.get("environment") or {}),
        )
    found = LAST_LINE.match(last_line)
    outcome = EXIT_OUTCOMES.get(status)
    if outcome == "reproduced" and not (found and found.group(1) == "REPRODUCED"):
        outcome = None  # exit 1 without the script's line: Python's own exit on an uncaught exception
    if outcome is None:
        cause = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
        error = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
        name, _, message = error.partition(": ")
        failure = {"name": name.strip() or "ProcessDied", "message": message.strip() or cause}
        return ScriptRun(
            "another", status, 0.0, failure=failure, note=f"the script ended without its verdict ({cause})"
        )
    if found is None:
        return ScriptRun(outcome, status, 0.0)
    return ScriptRun(
        outcome,
        status,
        0.0,
        phase=found.group("phase"),
        failure={"name": found.group("name"), "message": found.group("message")},
    )


def short_name(exception: str | None) -> str:
    return (exception or "").rsplit(".", 1)[-1]


def same_failure(run: ScriptRun, signature: dict) -> str | None:
    """None when a run that says REPRODUCED names the cell's phase and exception, else what differs.
    A cell whose process died or hung (phase crash or timeout) has no exception to compare."""
    if signature.get("phase") in PROCESS_PHASES:
        return None
    differences = []
    if run.phase and run.phase != signature.get("phase"):
        differences.append(f"phase {run.phase}, not {signature.get('phase')}")
    if run.failure and short_name(run.failure.get("name")) != short_name(signature.get("exception")):
        differences.append(f"{run.failure.get('name')}, not {signature.get('exception')}")
    return "; ".join(differences) or None


# ------------------------------------------------------------------ one signature's triage


@dataclass
class Verdict:
    """One signature's triage: its classification and what goes on the page with it."""

    signature: dict
    cells: list[str]
    smallest: str
    cell_seconds: float | None
    classification: str
    summary: str  # one line: why this classification
    script: str | None = None  # relative to the run's directory
    runs: list[ScriptRun] = field(default_factory=list)
    differed: list[str] = field(default_factory=list)  # does-not-reproduce: what differed
    catalogue_entry: str | None = None  # reproduces: draft TOML
    issue: str | None = None  # reproduces: draft upstream issue (Markdown)

    def as_dict(self) -> dict:
        return {
            "signature": self.signature,
            "cells": self.cells,
            "smallest_cell": self.smallest,
            "cell_seconds": self.cell_seconds,
            "classification": self.classification,
            "summary": self.summary,
            "script": self.script,
            "runs": [run.as_dict() for run in self.runs],
            "differed": self.differed,
            "catalogue_entry": self.catalogue_entry,
            "issue": self.issue,
        }


def combine(runs: list[ScriptRun], signature: dict) -> tuple[str, str]:
    """The classification of a signature from its script's runs, and its one line: any run that
    reproduced makes it a candidate (a nondeterministic device may show it once); else another
    failure; else every check held; else every run timed out."""
    for run in runs:
        if run.outcome == "reproduced":
            differs = same_failure(run, signature)
            if differs:
                run.outcome, run.note = "another", f"REPRODUCED, but {differs}"
    count = len(runs)

    def of(outcome: str) -> list[ScriptRun]:
        return [run for run in runs if run.outcome == outcome]

    times = "" if count == 1 else f" (in {{n}} of {count} runs)"
    if of("reproduced"):
        first = of("reproduced")[0]
        what = failure_text(first) or "the cell's failure"
        where = first.phase or signature.get("phase")
        return "reproduces", f"{what} in {where}" + times.format(n=len(of("reproduced")))
    if of("another"):
        first = of("another")[0]
        where = f" in {first.phase}" if first.phase else ""
        line = f"{failure_text(first) or 'the script failed'}{where}" + times.format(n=len(of("another")))
        return "another-failure", line + (f" ({first.note})" if first.note else "")
    if of("holds"):
        return "does-not-reproduce", "every check of the cell held standalone" + times.format(n=len(of("holds")))
    return "timed-out", "the script did not finish within the timeout" + ("" if count == 1 else f" ({count} runs)")


def failure_text(run: ScriptRun) -> str:
    if not run.failure:
        return ""
    return f"{run.failure.get('name')}: {first_line(run.failure.get('message'))}"


def first_line(text, limit: int = 300) -> str:
    line = next((line for line in str(text or "").splitlines() if line.strip()), "").strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."


def what_differed(new: NewSignature, runs: list[ScriptRun]) -> list[str]:
    """For a harness suspect: the phase the cell failed in and its message (the run's numbers),
    beside what the script measured in that phase (its checks) or that its phases completed."""
    record, signature = new.smallest, new.signature
    phase = record.get("phase") or signature.get("phase")
    message = first_line(record.get("message") or signature.get("message"))
    exception = str(signature.get("exception"))
    if not message.startswith((exception, short_name(exception))):
        message = f"{exception}: {message}"
    lines = [f"in the matrix, {record['id']} failed in {phase}: {message}"]
    for number, run in enumerate(runs, 1):
        label = "standalone" if len(runs) == 1 else f"standalone (run {number})"
        checks = [c for c in run.checks if isinstance(c, dict) and c.get("phase") == phase] or [
            c for c in run.checks if isinstance(c, dict)
        ]
        if checks:
            for check in checks:
                lines.append(
                    f"{label}, {check.get('phase')}: {check.get('name')} = {check.get('value')} "
                    f"(reference {check.get('reference')}, allowance {check.get('allowance')}): "
                    f"{'held' if check.get('held') else 'did not hold'}"
                )
        else:
            lines.append(f"{label}: {run.last_line or 'every phase completed'}")
    return lines


# ------------------------------------------------------------------ drafts


def regex_literal(text: str) -> str:
    """A regular expression that matches `text` literally (only the metacharacters escaped)."""
    return REGEX_SPECIAL.sub(r"\\\1", text)


def toml_string(text: str) -> str:
    """`text` as one TOML string: literal where it can be (the catalogue's style), else basic."""
    if "'" not in text and "\n" not in text:
        return f"'{text}'"
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def cell_selectors(cells: list[dict]) -> list[dict[str, list[str]]]:
    """Catalogue selectors that select exactly these cells: one over every axis' values where
    their product is the cells, else one per model x mode x device x engine with its precisions."""
    values = {axis: sorted({c[axis] for c in cells}) for axis in AXES}
    product = 1
    for axis in AXES:
        product *= len(values[axis])
    if product == len({c["id"] for c in cells}):
        return [values]
    groups: dict[tuple, list[str]] = {}
    rest = [axis for axis in AXES if axis != "precision"]
    for cell in cells:
        groups.setdefault(tuple(cell[axis] for axis in rest), []).append(cell["precision"])
    return [
        {**{axis: [value] for axis, value in zip(rest, key, strict=True)}, "precision": sorted(set(precisions))}
        for key, precisions in sorted(groups.items())
    ]


def stack_versions(document: dict) -> dict[str, str]:
    packages = document.get("environment", {}).get("packages") or {}
    return {name: packages[name] for name in STACK if packages.get(name)}


def catalogue_entry(new: NewSignature, document: dict, script: str) -> str:
    """A draft [[entry]] for matrix/catalogue/known_failures.toml (or a user's catalogue), for a failure
    that reproduces without the harness: what a maintainer fills in is marked TODO."""
    signature = new.signature
    selectors = []
    for selector in cell_selectors(list(new.cells)):
        fields = ", ".join(
            f"{axis} = [{', '.join(json.dumps(v) for v in values)}]" for axis, values in selector.items()
        )
        selectors.append(f"    {{ {fields} }},")
    versions = ", ".join(
        f'{json.dumps(name) if not re.fullmatch(r"[A-Za-z0-9_-]+", name) else name} = ">={version.split("+")[0]}"'
        for name, version in stack_versions(document).items()
    )
    run = document["run"]["id"]
    notes = (
        f"Found new in run {run} ({len(new.cells)} cells) and reproduced without the harness by the "
        f"script triage wrote, {script} ({new.smallest['id']}). TODO: the mechanism, and the "
        f"versions narrowed to the package at fault (these are the run's)."
    )
    lines = [
        "[[entry]]",
        'id = "TODO-name-this-failure"',
        f"title = {toml_string('TODO: one line. ' + signature['exception'] + ' in ' + signature['phase'])}",
        'kind = "bug"',
        "upstream = []  # TODO: owner/repo#number of the issue once filed",
        f"signature = {toml_string(regex_literal(signature['text']))}",
        "cells = [",
        *selectors,
        "]",
        f"versions = {{ {versions} }}",
        'workaround = "TODO"',
        f"notes = {toml_string(notes)}",
    ]
    return "\n".join(lines) + "\n"


def issue_text(new: NewSignature, document: dict, runs: list[ScriptRun], script_path: str, script_text: str) -> str:
    """A draft upstream issue a maintainer could paste: what, versions, the script, expected and
    actual (the script's failing checks, or the exception it raised)."""
    signature, cell = new.signature, new.smallest
    reproduced = next(run for run in runs if run.outcome == "reproduced")
    environment = document.get("environment") or {}
    versions = ", ".join(f"{name} {version}" for name, version in stack_versions(document).items())
    python = environment.get("python") or environment.get("python_version")
    platform = environment.get("platform")
    machine = "; ".join(str(part) for part in (f"Python {python}" if python else None, platform) if part)
    failing = [c for c in reproduced.checks if isinstance(c, dict) and not c.get("held")]
    if failing:
        expected = "\n".join(
            f"- {c.get('name')} ({c.get('phase')}): within {c.get('allowance')} of {c.get('reference')}"
            for c in failing
        )
        actual = "\n".join(f"- {c.get('name')} ({c.get('phase')}): {c.get('value')}" for c in failing)
    else:
        phase = reproduced.phase or signature["phase"]
        expected = f"{phase} completes in {cell['precision']}, and every check the script makes holds."
        actual = f"`{reproduced.last_line or failure_text(reproduced)}`"
    uses_plugin = "importlib.import_module(" in script_text
    plugin_note = (
        "\nThe model is a user's model kind: the script builds it through its own module, which must be "
        "importable (paste that module's model code in place of it before filing).\n"
        if uses_plugin
        else ""
    )
    title = f"{signature['exception']} in {signature['phase']} under {cell['precision']} ({cell['device']})"
    return f"""**{title}**

### What happens

{cell["model"]} in {cell["precision"]} on {cell["device"]} fails in {signature["phase"]}:
`{signature["exception"]}: {first_line(signature["message"])}` (at `{signature["origin"]}`). It fails
the same way in a standalone script that imports only the libraries below (found by a
precision-matrix run: {len(new.cells)} cells share this failure).

### Versions

{versions}{("; " + machine) if machine else ""}

### Reproduction

`python {Path(script_path).name}` (exit status 1 when the failure is present){plugin_note}

<details><summary>{Path(script_path).name}</summary>

```python
{script_text.rstrip()}
```

</details>

### Expected

{expected}

### Actual

{actual}
"""


# ------------------------------------------------------------------ the whole triage


@dataclass
class Triage:
    run_id: str
    source: str
    timeout_s: float
    budget_s: float | None
    verdicts: list[Verdict]
    kept: list[dict] = field(default_factory=list)  # a previous triage's entries --only did not redo

    def as_dict(self) -> dict:
        entries = sorted(
            [*(v.as_dict() for v in self.verdicts), *self.kept],
            key=lambda e: (-len(e["cells"]), e["signature"]["id"]),
        )
        counts = {key: sum(e["classification"] == key for e in entries) for key in CLASSIFICATIONS}
        return {
            "run": self.run_id,
            "source": self.source,
            "timeout_s": self.timeout_s,
            "budget_s": self.budget_s,
            "counts": counts,
            "signatures": entries,
        }


def select(found: list[NewSignature], only: list[str] | None) -> list[NewSignature]:
    if not only:
        return found
    known = {s.id for s in found}
    unknown = [sig for sig in only if sig not in known]
    if unknown:
        listed = ", ".join(sorted(known)) or "none"
        raise TriageError(f"--only {unknown[0]}: not a new signature of this run (its new signatures: {listed})")
    return [s for s in found if s.id in only]


def triage_signature(
    new: NewSignature,
    document: dict,
    run_file: Path,
    directory: Path,
    environment: dict,
    timeout_s: float,
    deadline: float | None,
    log=print,
) -> Verdict:
    cell = new.smallest
    verdict = Verdict(
        signature=new.signature,
        cells=[c["id"] for c in new.cells],
        smallest=cell["id"],
        cell_seconds=cell.get("duration_s"),
        classification="not-run",
        summary="",
    )
    from matrix.releases.repro import ReproError, generate

    try:
        text = generate(cell["id"], run_file)
    except ReproError as error:
        verdict.classification, verdict.summary = "no-script", str(error)
        return verdict
    scripts = directory / TRIAGE_DIR
    scripts.mkdir(exist_ok=True)
    script = scripts / f"{new.id}.py"
    script.write_text(text, encoding="utf-8")
    verdict.script = script.relative_to(directory).as_posix()
    elsewhere = not_runnable_here(cell)
    if elsewhere:  # the script is written for a machine that has what the cell needs
        verdict.summary = f"not on this machine: {elsewhere}"
        return verdict
    count = runs_for(cell["device"])
    for number in range(1, count + 1):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            break
        limit = timeout_s if left is None else min(timeout_s, left)
        log(f"{new.id}: running {verdict.script} ({cell['id']}, run {number} of {count}, at most {limit:.0f} s)")
        stem = f"{new.id}.run{number}"
        run, output = run_script(script, scripts / f"{stem}.json", environment, limit)
        (scripts / f"{stem}.log").write_text(output, encoding="utf-8")
        run.log = (scripts / f"{stem}.log").relative_to(directory).as_posix()
        if run.outcome == "timeout":
            run.note = f"stopped after {limit:g} s" + ("" if limit == timeout_s else " (what was left of --budget)")
        verdict.runs.append(run)
    if not verdict.runs:
        verdict.summary = "--budget was spent before its turn"
        return verdict
    verdict.classification, verdict.summary = combine(verdict.runs, new.signature)
    if verdict.classification == "timed-out":
        verdict.summary = f"the script ran past {verdict.runs[0].note.removeprefix('stopped after ')}"
    if verdict.classification == "does-not-reproduce":
        verdict.differed = what_differed(new, verdict.runs)
    if verdict.classification == "reproduces":
        verdict.catalogue_entry = catalogue_entry(new, document, verdict.script)
        verdict.issue = issue_text(new, document, verdict.runs, verdict.script, text)
    return verdict


def triage(
    document: dict,
    run_file: Path,
    plugins: list[str],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    only: list[str] | None = None,
    budget_s: float | None = None,
    log=print,
) -> Triage:
    """Triage the run's new signatures (all, or `only` those): the -p `plugins` are imported
    already. Writes nothing but the scripts and their outputs; write() writes the pages."""
    chosen = select(new_signatures(document), only)
    directory = run_file.parent
    environment = script_environment(module_directories(plugins))
    deadline = None if budget_s is None else time.monotonic() + budget_s
    verdicts = [
        triage_signature(new, document, run_file, directory, environment, timeout_s, deadline, log) for new in chosen
    ]
    kept = []
    if only:  # the other new signatures keep what an earlier triage of this run found
        previous = read_triage(directory)
        still_new = {s.id for s in new_signatures(document)} - set(only)
        kept = [e for e in (previous or {}).get("signatures", []) if e["signature"]["id"] in still_new]
    return Triage(document["run"]["id"], str(run_file), timeout_s, budget_s, verdicts, kept)


def read_triage(directory: Path) -> dict | None:
    """A run directory's triage.json, or None where it has none (or one that cannot be read)."""
    path = Path(directory) / TRIAGE_JSON
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and isinstance(found.get("signatures"), list) else None


# ------------------------------------------------------------------ the page


def _md(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def short_signature(text: str, limit: int = 90) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def triage_markdown(summary: dict) -> str:
    """triage.md: one row per signature, then the drafts and findings under it."""
    entries = summary["signatures"]
    lines = [f"# Triage of run {summary['run']}", ""]
    if not entries:
        lines += ["No new failure: nothing to triage (every failure of this run is catalogued, or none failed).", ""]
        return "\n".join(lines)
    counts = ", ".join(f"{n} {CLASSIFICATIONS[key]}" for key, n in summary["counts"].items() if n)
    lines += [
        f"{len(entries)} new signatures: {counts}. Each signature's smallest cell ran as a standalone script "
        f"in a fresh process (timeout {summary['timeout_s']:g} s"
        + (f", budget {summary['budget_s']:g} s" if summary.get("budget_s") is not None else "")
        + "; twice on a device that does not step deterministically). How to read it: docs/triage.md.",
        "",
        "| signature | cells | smallest cell | classification | script |",
        "|---|---|---|---|---|",
    ]
    for e in entries:
        signature = e["signature"]
        script = f"[{Path(e['script']).name}]({e['script']})" if e.get("script") else "-"
        lines.append(
            f"| `{signature['id']}` {_md(short_signature(signature['text']))} | {len(e['cells'])} | "
            f"`{e['smallest_cell']}` | **{CLASSIFICATIONS[e['classification']]}**: {_md(e['summary'])} | {script} |"
        )
    for e in entries:
        signature, kind = e["signature"], e["classification"]
        lines += ["", f"## `{signature['id']}`: {CLASSIFICATIONS[kind]}", "", f"`{signature['text']}`", ""]
        lines += [f"{e['summary']}. Smallest of its {len(e['cells'])} cells: `{e['smallest_cell']}`."]
        for run in e.get("runs") or []:
            lines.append(
                f"- run: {run['outcome']}, exit status {run['exit_status']}, {run['seconds']} s"
                + (f", {run['note']}" if run.get("note") else "")
                + (f", last line `{run['last_line']}`" if run.get("last_line") else "")
                + (f" ([output]({run['log']}))" if run.get("log") else "")
            )
        if kind == "does-not-reproduce":
            lines += ["", "What differed:", "", *(f"- {line}" for line in e.get("differed") or [])]
        if kind == "reproduces":
            lines += [
                "",
                "Draft catalogue entry (matrix/catalogue/known_failures.toml, or your own catalogue with --catalogue):",
                "",
                "```toml",
                e["catalogue_entry"].rstrip(),
                "```",
                "",
                "Draft upstream issue:",
                "",
                "````markdown",
                e["issue"].rstrip(),
                "````",
            ]
    return "\n".join(lines) + "\n"


def write(summary: dict, document: dict, directory: Path) -> list[Path]:
    """triage.json, triage.md and index.html (with its triage section) into the run's directory."""
    from matrix.results.html import html_report
    from matrix.results.journal import json_safe

    written = [directory / TRIAGE_JSON, directory / TRIAGE_MD, directory / "index.html"]
    written[0].write_text(json.dumps(json_safe(summary), indent=2) + "\n", encoding="utf-8")
    written[1].write_text(triage_markdown(summary), encoding="utf-8")
    written[2].write_text(html_report(json_safe(document), triage=json_safe(summary)), encoding="utf-8")
    return written
