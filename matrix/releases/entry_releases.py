"""Each catalogued bug shown on the releases it names (`python -m matrix entry-releases`).

    python -m matrix entry-releases [--entry ID ...] [--release PKG==V ...] [--budget S]

For every entry of kind "bug" in matrix/catalogue/known_failures.toml, and for each package its `versions`
names: the releases the specifier names are the lowest release on the index it admits and the
newest it admits; its fixed release is the one an upper bound `<X` names, where X is a release on
the index. The entry's `shown_by` cell is written out once as a standalone script (`python -m
matrix repro`, on the interpreter running this command, or --writer's), each release is installed
into the stack's scratch environment (matrix/releases/bisection.py ScratchEnvironment: torch, the project, the
stack's pins; locked against a second user, put back to its baseline after), and the script runs
there in a fresh process in which nothing of this project imports (a `matrix` that refuses to
import comes first on its path). Another package the entry names stays at the environment's
version where that meets the entry, else the newest release it admits goes in beside.

The expectation: exit 1 on a named release with the entry's check (the script's failure, written
as the matrix writes a signature, matches the entry's pattern): "shows it"; exit 0 on the fixed
release: "fixed there"; exit 1 with a failure another entry explains (it selects the cell, the row's
releases meet it, its pattern matches): "another bug first", naming it; anything else: "differs",
with what happened. A row that cannot run here
says what it needs: a GPU, a hardware condition of the entry, a torch release (the scratch
environment keeps its stack's torch), a release pip cannot install, an extra the script's writer
lacks, or the time the budget left. Rows not run by this invocation keep what an earlier one
recorded, with its date and machine.

It writes docs/entry-releases.md (one row per entry x release) and docs/entry-releases.json beside it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from matrix.grid.packages import installed_version
from matrix.releases.bisection import DEFAULT_TORCH, ROOT, BisectError, ScratchEnvironment, final_releases

PAGE = ROOT / "docs" / "entry-releases.md"
SCRIPT_TIMEOUT_S = 900  # one script on one release (the slowest CPU cells train, save and resume)
WRITE_TIMEOUT_S = 600
KEPT = ("torch",)  # the scratch environment's own: a release of it is a stack, not a row's install
# the order rows are run in: cheap installs first (deepspeed builds its wheel from source)
INSTALL_ORDER = ("transformers", "accelerate", "bitsandbytes", "lightning", "peft", "liger-kernel", "torchao")
VERDICTS = ("shows it", "fixed there", "another bug first", "differs", "not run here")
BUDGET_REASON = "the time budget ran out before it"


class EntryReleasesError(BisectError):
    """Bad input: one line for the user, exit status 2."""


class NamedReleases(NamedTuple):
    named: tuple[str, ...]  # the lowest and the newest release the specifier admits (one, if the same)
    fixed: str | None  # the release an upper bound `<X` names, where the index has X


def releases_named(specifier: SpecifierSet | str, listed: Iterable[str]) -> NamedReleases:
    """The releases a specifier names among an index listing (final releases, local ones left out)."""
    specifier = SpecifierSet(str(specifier))
    finals = final_releases(list(listed), with_local=False)
    admitted = [v for v in finals if specifier.contains(v)]
    named = tuple(dict.fromkeys(str(v) for v in (admitted[:1] + admitted[-1:])))
    bounds = [Version(s.version) for s in specifier if s.operator == "<"]
    fixed = None
    if bounds:
        bound = min(bounds)
        fixed = next((str(v) for v in finals if v == bound), None)
    return NamedReleases(named, fixed)


def verdict_of(row: dict) -> str:
    """A row's verdict from what the script did: its exit and whether its failure is the entry's."""
    if not row["ran"]:
        return "not run here"
    if row["exit"] == 1 and not row["matches_entry"] and row.get("masked_by"):
        return "another bug first"
    if row["role"] == "fixed":
        return "fixed there" if row["exit"] == 0 else "differs"
    return "shows it" if row["exit"] == 1 and row["matches_entry"] else "differs"


def masking_entries(
    entry, cell_id: str, seen: str | None, versions: dict[str, str], entries, hardware: dict | None = None
) -> list[str]:
    """The other catalogue entries that explain the script's failure where it is not the entry's own:
    they select the cell, the row's releases meet their versions, their hardware and run conditions
    hold on this machine, and their pattern matches what the script raised. A cell can carry two
    bugs, and its script shows the one in the earlier phase (bitsandbytes 0.47.0 no longer turns the
    int8 training NaN, and the same cell's reload still differs, bnb-int8-saved-base-reloads-wrong).
    An entry with a condition on what the cell measured (deepspeed-zero0-bf16-adamw-stepped-at-construction
    holds where AdamW stepped before the first step) is never one: the script does not report it,
    so a failure that only such an entry would explain stays "differs". `hardware`: the facts of the
    machine the script ran on, where that was another (a kept row's), in place of this one's."""
    from matrix.catalogue.entries import Context, local_context
    from matrix.selection.cells import cell_from_id

    cell = cell_from_id(cell_id)
    if seen is None or cell is None:
        return []
    context = local_context()
    if hardware is not None:
        context = Context(hardware=hardware, run=context.run)
    return [
        other.id
        for other in entries
        if other.id != entry.id
        and not any(requirement.reads == "cell" for requirement in other.when)
        and not other.unmet(context, "hardware")
        and not other.unmet(context, "run")
        and other.selects(cell)
        and other.versions_hold(versions)
        and other.matches(seen)
    ]


# ---------------------------------------------------------------- the script's failure as a signature


def _qualified_exception(name: str, stderr: str) -> str:
    """The exception as the matrix's signature names it: a check's class in matrix/checks/assertions.py or
    matrix/precisions/policies.py, by its module's name in signatures (matrix/results/module_moves.py);
    another's as Python's traceback printed it (module-qualified, builtins bare)."""
    from matrix.checks import assertions as checks
    from matrix.precisions import policies as precisions
    from matrix.results.module_moves import signature_name

    for module in (checks, precisions):
        if isinstance(getattr(module, name, None), type):
            return f"{signature_name(module.__name__)}.{name}"
    printed = re.findall(rf"^([\w.]*\b{re.escape(name)}):", stderr, re.MULTILINE)
    return printed[-1] if printed else name


def _origin(stderr: str) -> str:
    """The innermost traceback frame inside the stack under test (matrix/results/signatures.py's origin),
    from the traceback the script printed, as module:function."""
    from matrix.grid.packages import ORIGIN_MODULES

    frames = re.findall(r'^\s*File "([^"]+)", line \d+, in (\S+)', stderr, re.MULTILINE)
    origins = []
    for path, function in frames:
        if "site-packages/" not in path:
            continue
        module = path.split("site-packages/", 1)[1].removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        if module.split(".")[0] in ORIGIN_MODULES:
            origins.append(f"{module}:{function}")
    return origins[-1] if origins else ""


def seen_signature(outcome: dict, stderr: str) -> str | None:
    """The script's failure written as the matrix writes a signature's text, or None if none."""
    from matrix.results.signatures import normalize_message

    failure = outcome.get("failure")
    if not failure:
        return None
    exception = _qualified_exception(failure["name"], stderr)
    return f"{outcome['phase']}: {exception}: {normalize_message(failure['message'])} @ {_origin(stderr)}"


def failing_check(outcome: dict) -> dict | None:
    """The last comparison that did not hold, with its numbers, or None."""
    failed = [c for c in outcome.get("checks") or [] if not c.get("held", True)]
    if not failed:
        return None
    keys = ("name", "phase", "what", "value", "reference", "allowance")
    return {k: failed[-1].get(k) for k in keys}


# ---------------------------------------------------------------- the plan


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs ({capability}), {gpu}"


def _row(entry, package: str, release: str, role: str) -> dict:
    return {
        "entry": entry.id,
        "cell": entry.shown_by,
        "package": package,
        "release": release,
        "role": role,
        "expected": 0 if role == "fixed" else 1,
        "ran": False,
        "exit": None,
        "phase": None,
        "failure": None,
        "check": None,
        "seen": None,
        "matches_entry": None,
        "masked_by": [],
        "note": "not run yet",
        "companions": [],
        "ran_at": None,
        "machine": None,
        "hardware": None,  # the facts hardware conditions read, of the machine the script ran on
        "seconds": None,
    }


def plan(entries, listings: dict[str, list[str]]) -> list[dict]:
    """One row per entry x package x release it names (named, then fixed), nothing run yet."""
    rows = []
    for entry in entries:
        if not entry.versions:
            row = _row(entry, "-", "-", "named")
            row["note"] = "its entry names no release (no versions)"
            rows.append(row)
        for package, specifier in entry.versions.items():
            named = releases_named(specifier, listings.get(package, []))
            if not named.named:
                row = _row(entry, package, str(specifier), "named")
                row["note"] = f"the index lists no release of {package} that {specifier} admits"
                rows.append(row)
            rows += [_row(entry, package, release, "named") for release in named.named]
            if named.fixed:
                rows.append(_row(entry, package, named.fixed, "fixed"))
    return rows


def _meets(version: str | None, specifier: SpecifierSet) -> bool:
    try:
        return version is not None and specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def capability_refusal(cell) -> str | None:
    """Why the matrix skips `cell` on this machine for a capability its device lacks (DeepSpeed's CPU
    accelerator refusing fp16 where the CPU has no fp16 support), or None: its script cannot show the
    entry here either. Packages the cell needs are not asked about here (needs() installs them)."""
    from matrix.devices import DEVICES
    from matrix.engines import ENGINES
    from matrix.precisions.policies import PRECISIONS

    precision, device = PRECISIONS[cell.precision], DEVICES[cell.device]
    return device.skip_reason(precision, 0) or ENGINES[cell.engine].precision_device_skip_reason(precision, device)


def needs(entry, row: dict, baseline: dict[str, str], listings: dict[str, list[str]]) -> str | None:
    """What the row needs that this machine or environment lacks, decided before installing, or None;
    sets the row's companions (the releases another named package needs beside it)."""
    from matrix.catalogue.entries import local_context
    from matrix.models import MODELS
    from matrix.selection.cells import cell_from_id

    if row["release"] == "-" or row["note"] != "not run yet":
        return row["note"]
    if row["package"] in KEPT and not _same_release(baseline.get(row["package"]), row["release"]):
        return (
            f"needs {row['package']} {row['release']} installed: the scratch environment keeps its stack's "
            f"{row['package']} ({baseline.get(row['package'])})"
        )
    cell = cell_from_id(entry.shown_by)
    if cell is None:
        return f"needs the plugin that registers the model kind of {entry.shown_by} (-p MODULE)"
    module = type(MODELS[cell.model]).__module__
    if module.split(".")[0] != "matrix":
        return (
            f"needs precision-matrix importable: the model kind {cell.model} is a plugin's ({module}), "
            "which its script builds through the matrix"
        )
    if cell.device != "cpu":
        import torch

        if cell.device != "cuda" or not torch.cuda.is_available():
            return f"needs a {cell.device} device (the cell's script runs there only)"
    unmet = entry.unmet(local_context(), "hardware")
    if unmet:
        return "needs " + ", ".join(str(r) for r in unmet) + " (the entry's hardware condition)"
    refused = capability_refusal(cell)
    if refused:
        return f"needs what the matrix skips the cell for on this machine: {refused}"
    companions = []
    for other, specifier in entry.versions.items():
        if other == row["package"] or _meets(baseline.get(other.lower()), specifier):
            continue
        if other in KEPT:
            return f"needs {other} {specifier} beside it: the scratch environment keeps {other} {baseline.get(other)}"
        admitted = releases_named(specifier, listings.get(other, [])).named
        if not admitted:
            return f"needs {other} {specifier} beside it, which the index does not list"
        companions.append(f"{other}=={admitted[-1]}")
    # what the cell itself needs (its engine's, kind's and precision's packages) and the stack lacks:
    # the release the script was written with goes in beside (hf-trainer-zero2's ranks need deepspeed)
    named = {c.split("==")[0].lower() for c in companions} | {row["package"].lower()}
    for needed in cell_requirements(cell):
        if needed.lower() in named or needed.lower() in baseline:
            continue
        version = installed_version(needed)
        if version is None:
            return f"needs {needed}, which neither the scratch environment nor the script's writer has"
        companions.append(f"{needed}=={version}")
    row["companions"] = companions
    return None


def cell_requirements(cell) -> list[str]:
    """The packages a cell's engine, model kind and precision require, by name."""
    from matrix.engines import ENGINES
    from matrix.models import MODELS
    from matrix.precisions.policies import PRECISIONS

    found = []
    for axis_value in (ENGINES.get(cell.engine), MODELS.get(cell.model), PRECISIONS.get(cell.precision)):
        for requirement in getattr(axis_value, "requires", ()) or ():
            name = re.split(r"[\s<>=!~\[]", requirement.strip(), maxsplit=1)[0]
            if name and name not in found:
                found.append(name)
    return found


# ---------------------------------------------------------------- running


@contextlib.contextmanager
def held_until(env: ScratchEnvironment, deadline: float, log=print):
    """The scratch environment's lock (the one bisections and sweeps take), waited for until the deadline."""
    env.lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(env.lock_path, "w") as lock:
        said = False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EntryReleasesError(
                        f"the scratch environment {env.path} stayed in use past the time budget"
                    ) from None
                if not said:
                    log(f"waiting: another bisection or sweep is using the scratch environment {env.path}")
                    said = True
                time.sleep(5)
        try:
            yield env
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def installed(env: ScratchEnvironment) -> dict[str, str]:
    done = env.pip("list", "--format=json")
    return {p["name"].lower(): p["version"] for p in json.loads(done.stdout or "[]")}


def restore_all(env: ScratchEnvironment, log=print) -> None:
    """Every package back to the environment's baseline: changed ones reinstalled, added ones removed."""
    baseline, now = env.baseline(), installed(env)
    changed = [f"{name}=={version}" for name, version in baseline.items() if now.get(name) not in (None, version)]
    changed += [f"{name}=={version}" for name, version in baseline.items() if name not in now]
    added = sorted(set(now) - set(baseline))
    if added:
        env.pip("uninstall", "-y", "-q", *added)
    if changed:
        done = env.pip("install", "-q", "--no-deps", *changed)
        if done.returncode:
            log(f"could not put {', '.join(changed)} back: {_last_line(done.stderr)}")
    if added or changed:
        log(f"scratch environment back to its baseline ({len(changed)} reinstalled, {len(added)} removed)")


def _last_line(text: str, fallback: str = "pip failed") -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip() and not line.startswith("WARNING")]
    return lines[-1] if lines else fallback


WRITER = """
import importlib, json, sys, traceback
from pathlib import Path

jobs = json.loads(Path(sys.argv[1]).read_text())
for module in jobs["plugins"]:
    importlib.import_module(module)
from matrix.releases.repro import generate

for name, (cell, path) in jobs["scripts"].items():
    try:
        Path(path).write_text(generate(cell))
        said = None
    except Exception as error:  # ReproError: one line; anything else: its last line
        said = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    print(json.dumps([name, said]), flush=True)
"""


def write_scripts(cells: dict[str, str], writer: str, plugins: list[str], directory: Path) -> dict[str, Path | str]:
    """Each entry's cell written out as a standalone script (matrix/releases/repro generate(), as `python -m
    matrix repro` writes it) by one `writer` process: entry -> its script, or what it needs."""
    jobs = directory / "jobs.json"
    paths = {name: directory / f"{name}.py" for name in cells}
    jobs.write_text(json.dumps({"plugins": plugins, "scripts": {n: [c, str(paths[n])] for n, c in cells.items()}}))
    try:
        done = subprocess.run(
            [writer, "-c", WRITER, str(jobs)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=WRITE_TIMEOUT_S + 60 * len(cells),
        )
        output, failed = done.stdout, _last_line(done.stderr, f"exit status {done.returncode}")
    except subprocess.TimeoutExpired as error:
        output, failed = error.stdout or "", "writing the scripts ran past their time"
        output = output.decode() if isinstance(output, bytes) else output
    written: dict[str, Path | str] = {}
    for line in output.splitlines():
        with contextlib.suppress(ValueError):
            name, said = json.loads(line)
            if said is None:
                written[name] = paths[name]
            else:
                written[name] = "needs " + said.split(" needs ", 1)[1] if " needs " in said else f"no script: {said}"
    return {name: written.get(name, f"no script: {failed}") for name in cells}


def shadow_project(directory: Path) -> Path:
    """A directory whose `matrix` refuses to import: first on a script's path, it hides the project
    (installed editable in the scratch environment) from the script."""
    package = directory / "matrix"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(
        'raise ImportError("a standalone script imports nothing of precision-matrix (entry-releases)")\n'
    )
    return directory


def run_script(
    env: ScratchEnvironment, script: Path, shadow: Path, work: Path, timeout: float = SCRIPT_TIMEOUT_S
) -> tuple[int | None, dict, str]:
    """(exit status or None if it ran past its time, the --json outcome, stderr's tail)."""
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REPRO_WORKDIR")}
    environment["PYTHONPATH"] = str(shadow)
    out = work / "outcome.json"
    process = subprocess.Popen(
        [str(env.python), str(script), "--json", str(out)],
        cwd=work,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a distributed cell's ranks end with it
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return None, {}, f"ran past {timeout:.0f} s"
    finally:
        with contextlib.suppress(ProcessLookupError):  # ranks or compile workers it left behind
            os.killpg(process.pid, signal.SIGKILL)
    outcome = json.loads(out.read_text()) if out.exists() else {}
    return process.returncode, outcome, (stderr or "")[-20000:] + (stdout or "")[-4000:]


def record(
    row: dict,
    entry,
    status: int | None,
    outcome: dict,
    output: str,
    seconds: float,
    where: str,
    masking=lambda seen: [],
) -> None:
    """The script's run, into its row. `masking(seen)`: the other entries that explain a failure."""
    from matrix.catalogue.entries import local_context

    row.update(ran=True, exit=status, ran_at=time.strftime("%Y-%m-%d", time.gmtime()), machine=where)
    row["hardware"] = dict(local_context().hardware)
    row["seconds"] = round(seconds, 1)
    row["phase"] = outcome.get("phase")
    row["failure"] = outcome.get("failure")
    row["check"] = failing_check(outcome)
    row["seen"] = seen_signature(outcome, output) if outcome else None
    row["matches_entry"] = bool(row["seen"] and entry.matches(row["seen"]))
    row["masked_by"] = []
    if status is None:
        row["note"] = output
    elif not outcome:
        row["note"] = f"exit {status} without its outcome: {_last_line(output, 'no output')[:200]}"
    elif status == 0:
        row["note"] = "every check held"
    elif status == 2:
        row["note"] = "another failure than the matrix's (exit 2)"
    else:
        row["note"] = ""
    judge(row, entry, masking)


def judge(row: dict, entry, masking=lambda seen: []) -> None:
    """A row's verdict from what its script did, against the catalogue as it is now: whether an exit
    1 is the entry's failure, or one another entry explains (`masking(seen)`: their ids)."""
    if row["ran"] and row["exit"] == 1 and row["seen"]:
        row["matches_entry"] = entry.matches(row["seen"])
        row["masked_by"] = [] if row["matches_entry"] else masking(row["seen"])
        if row["masked_by"]:
            row["note"] = f"fails first with {', '.join(row['masked_by'])}, which the catalogue names for this release"
        elif not row["matches_entry"]:
            row["note"] = "its failure is not the entry's (the entry's pattern does not match it)"
        else:
            row["note"] = ""
    row["verdict"] = verdict_of(row)


def row_versions(row: dict, baseline: dict[str, str]) -> dict[str, str]:
    """The releases a row's script ran with: the stack's, with the row's release and companions in."""
    installed = [f"{row['package']}=={row['release']}", *row["companions"]]
    return {**baseline, **dict(r.lower().split("==", 1) for r in installed)}


def install_group(env: ScratchEnvironment, key: tuple[str, ...], log=print):
    """A group's releases installed into the baseline, not over the group before it: a row runs with
    its own releases and the stack's everything else (pip's process, or None where the group needs
    nothing). Without the reset, rows of bitsandbytes and deepspeed releases ran over the
    transformers 4.x that an earlier group had left, and failed in ways their releases do not."""
    restore_all(env, log)
    if not key:
        return None
    log(f"installing {' '.join(key)}")
    return env.pip("install", "-q", *key)


def _same_release(installed: str | None, release: str) -> bool:
    """Whether the installed version is the release (a local build of it too: 2.13.0+cpu is 2.13.0)."""
    try:
        return installed is not None and Version(Version(installed).public) == Version(release)
    except InvalidVersion:
        return False


def _install_key(row: dict, baseline: dict[str, str]) -> tuple[str, ...]:
    wanted = [f"{row['package']}=={row['release']}", *row["companions"]]
    return tuple(r for r in wanted if not _same_release(baseline.get(r.split("==")[0].lower()), r.split("==")[1]))


def _order(key: tuple[str, ...]) -> tuple:
    packages = [r.split("==")[0] for r in key]
    rank = max((INSTALL_ORDER.index(p) if p in INSTALL_ORDER else len(INSTALL_ORDER) for p in packages), default=-1)
    return (rank, key)


def run(
    entry_ids: list[str] | None = None,
    releases: list[str] | None = None,
    budget: float = 3000.0,
    stack_name: str = "default",
    writer: str = sys.executable,
    plugins: list[str] = (),
    page: Path = PAGE,
    log=print,
) -> list[dict]:
    """Run the rows of the selected bug entries (all: None) within `budget` seconds, merge them with
    the page's earlier rows and write the page and its JSON. `releases`: only those (PKG==V)."""
    from matrix.catalogue.entries import load
    from matrix.releases import stacks as version_stacks

    deadline = time.monotonic() + budget
    previous = previous_rows(page)
    entries = [e for e in load().entries if e.kind == "bug"]
    known = {e.id for e in entries}
    unknown = sorted(set(entry_ids or ()) - known)
    if unknown:
        raise EntryReleasesError(f"--entry: no bug entry {unknown[0]!r} in the catalogue")
    selected = set(entry_ids) if entry_ids else known
    stacks = version_stacks.load()
    if stack_name not in stacks:
        raise EntryReleasesError(f"--stack: unknown stack {stack_name!r}; known: {', '.join(stacks)}")
    env = ScratchEnvironment(stacks[stack_name], os.environ.get("MATRIX_TORCH", DEFAULT_TORCH))
    where = machine()
    log(f"scratch environment for stack {stack_name}: {env.path}")
    main_thread = threading.current_thread() is threading.main_thread()
    stopped_by = signal.signal(signal.SIGTERM, _stop) if main_thread else None  # still puts the environment back
    try:
        rows, chosen, baseline = _run_rows(
            env, entries, selected, releases, previous, deadline, writer, plugins, where, log
        )
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, stopped_by)
    merged = merge(entries, rows, previous, {id(r) for r in chosen})
    # the rows kept from earlier runs, judged against the catalogue as it is now (its patterns and
    # entries may have changed since) and the hardware they ran on: what their scripts did stays as
    # recorded. A row run on another machine that holds no hardware facts keeps its verdict: an
    # entry's hardware condition cannot be read for a machine the row does not describe.
    by_id, fresh, here = {e.id: e for e in entries}, {id(r) for r in rows}, machine()
    for row in merged:
        if id(row) not in fresh and row["entry"] in by_id:
            hardware = row.get("hardware")
            if row["ran"] and hardware is None and row.get("machine") != here:
                continue
            versions = row_versions(row, baseline)
            entry = by_id[row["entry"]]
            row.setdefault("masked_by", [])
            judge(
                row,
                entry,
                lambda seen, e=entry, r=row, v=versions, h=hardware: masking_entries(e, r["cell"], seen, v, entries, h),
            )
    write(merged, page)
    log(f"written: {page}, {page.with_suffix('.json')}")
    return merged


def _run_rows(env, entries, selected, releases, previous, deadline, writer, plugins, where, log):
    """(the planned rows, those chosen to run), run within the scratch environment's lock."""
    with held_until(env, deadline, log):
        env.ensure()
        (env.path / ".bisect-stack").touch()  # last used: what pruning keeps
        baseline = env.baseline()
        # planned afresh: the selected entries, and those the page has no rows of yet
        planned = [e for e in entries if e.id in selected or e.id not in {r["entry"] for r in previous}]
        listings = {p: env.released_versions(p) for p in sorted({p for e in planned for p in e.versions})}
        rows = plan(planned, listings)
        by_id = {e.id: e for e in entries}
        chosen = [
            r
            for r in rows
            if r["entry"] in selected and (not releases or f"{r['package']}=={r['release']}" in releases)
        ]
        runnable = []
        for row in chosen:
            reason = needs(by_id[row["entry"]], row, baseline, listings)
            if reason:
                row.update(note=reason, ran_at=time.strftime("%Y-%m-%d", time.gmtime()), machine=where)
            else:
                runnable.append(row)
        with tempfile.TemporaryDirectory(prefix="entry-releases-") as scratch:
            scratch = Path(scratch)
            shadow = shadow_project(scratch / "shadow")
            # every script written first, by one process (its imports once), before any release goes in
            wanted = {r["entry"]: by_id[r["entry"]].shown_by for r in runnable}
            log(f"writing {len(wanted)} scripts with {writer}")
            scripts = write_scripts(wanted, writer, list(plugins), scratch) if wanted else {}
            groups: dict[tuple[str, ...], list[dict]] = {}
            for row in runnable:
                groups.setdefault(_install_key(row, baseline), []).append(row)
            try:
                for key in sorted(groups, key=_order):
                    group = []
                    for row in groups[key]:
                        if isinstance(scripts[row["entry"]], str):
                            row.update(note=scripts[row["entry"]], ran_at=time.strftime("%Y-%m-%d", time.gmtime()))
                            row["machine"] = where
                        elif time.monotonic() > deadline:
                            row["note"] = BUDGET_REASON
                        else:
                            group.append(row)
                    if not group:
                        continue
                    done = install_group(env, key, log)
                    if done is not None and done.returncode:
                        for row in group:
                            row["note"] = f"needs {' '.join(key)}, which pip does not install here: "
                            row["note"] += _last_line(done.stderr)
                        continue
                    for row in group:
                        if time.monotonic() > deadline:
                            row["note"] = BUDGET_REASON
                            continue
                        entry = by_id[row["entry"]]
                        work = scratch / f"{entry.id}-{row['package']}-{row['release']}"
                        work.mkdir()
                        start = time.perf_counter()
                        left = max(120.0, min(SCRIPT_TIMEOUT_S, deadline - time.monotonic() + 120))
                        status, outcome, output = run_script(env, scripts[entry.id], shadow, work, left)
                        versions = row_versions(row, baseline)

                        def masking(seen, entry=entry, row=row, versions=versions):
                            return masking_entries(entry, row["cell"], seen, versions, entries)

                        seconds = time.perf_counter() - start
                        record(row, entry, status, outcome, output, seconds, where, masking)
                        log(
                            f"  {entry.id} on {row['package']}=={row['release']} ({row['role']}): exit {status}, "
                            f"{row['verdict']} ({row['seconds']:.0f} s)"
                        )
            finally:
                restore_all(env, log)
    for row in rows:
        row["verdict"] = verdict_of(row)
    return rows, chosen, baseline


def _stop(signum, frame):
    raise SystemExit(f"stopped by signal {signum}")


def previous_rows(page: Path) -> list[dict]:
    data = page.with_suffix(".json")
    return json.loads(data.read_text())["rows"] if data.exists() else []


def _key(row: dict) -> tuple:
    return (row["entry"], row["cell"], row["package"], row["release"], row["role"])


def merge(entries, rows: list[dict], previous: list[dict], attempted: set[int]) -> list[dict]:
    """The page's rows, entry by entry in the catalogue's order: a planned entry's rows, each with
    this invocation's result where it decided one (ran, or found what the row needs), else the
    earlier result recorded for the same entry, cell and release; an entry not planned keeps its rows."""
    before = {_key(r): r for r in previous}
    merged = []
    for entry in entries:
        planned = [r for r in rows if r["entry"] == entry.id]
        if not planned:
            merged += [r for r in previous if r["entry"] == entry.id]
        for row in planned:
            decided = id(row) in attempted and row["note"] not in ("not run yet", BUDGET_REASON)
            old = before.get(_key(row))
            merged.append(row if decided or old is None else old)
    return merged


# ---------------------------------------------------------------- the page


def _cell_text(value) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


def check_text(row: dict) -> str:
    """The check (or exception) the script stopped at, with the check's numbers."""
    if not row["ran"]:
        return "-"
    if row["exit"] == 0:
        return "every check held"
    parts = []
    if row["failure"]:
        message = " ".join(row["failure"]["message"].split())  # a message of several lines, on one
        parts.append(f"{row['phase']}: {row['failure']['name']}: {message[:160]}")
    if row["check"]:
        check = row["check"]
        parts.append(
            f"{check['what']}: {_cell_text(check['value'])} vs {_cell_text(check['reference'])}, "
            f"allowed {_cell_text(check['allowance'])}"
        )
    return "; ".join(parts) or row["note"]


def _escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def page_markdown(rows: list[dict]) -> str:
    runs = sorted({(r["ran_at"], r["machine"]) for r in rows if r["ran_at"]})
    counts = {v: sum(1 for r in rows if r["verdict"] == v) for v in VERDICTS}
    lines = [
        "<!-- generated by `python -m matrix entry-releases` (matrix/releases/entry_releases.py); do not edit -->",
        "# Catalogued bugs on the releases they name",
        "",
        'Each entry of kind "bug" in matrix/catalogue/known_failures.toml, its `shown_by` cell\'s standalone script '
        "(`python -m matrix repro`), run in the stack's scratch environment with each release the entry's "
        "`versions` names installed and nothing of this project importable. A named release (the lowest and "
        "the newest its specifier admits) should exit 1 with the entry's check; the fixed release (an upper "
        'bound `<X`) should exit 0. Verdicts: "shows it", "fixed there", "another bug first" (the script '
        "fails with another entry the catalogue names for the cell on that release, which hides this one), "
        '"differs" (what happened is in the row), "not run here" (what the row needs).',
        "",
        "Rows: " + ", ".join(f"{counts[v]} {v}" for v in VERDICTS) + ".",
        "",
        "Ran on: " + ("; ".join(f"{day}, {where}" for day, where in runs) or "nothing ran yet") + ".",
        "",
        "| entry | cell | release | exit | check / numbers | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        release = f"{row['package']} {row['release']}" + (" (fixed)" if row["role"] == "fixed" else "")
        if row["companions"]:
            release += " with " + ", ".join(row["companions"])
        status = "-" if not row["ran"] else ("timeout" if row["exit"] is None else str(row["exit"]))
        verdict = row["verdict"]
        if verdict in ("another bug first", "differs", "not run here") and row["note"]:
            verdict += f": {row['note']}"
        cells = [row["entry"], f"`{row['cell']}`", release, status, check_text(row), verdict]
        lines.append("| " + " | ".join(_escape(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def write(rows: list[dict], page: Path = PAGE) -> None:
    page.parent.mkdir(parents=True, exist_ok=True)
    document = {"generated_by": "python -m matrix entry-releases", "rows": rows}
    page.with_suffix(".json").write_text(json.dumps(document, indent=1, default=str) + "\n")
    page.write_text(page_markdown(rows))
