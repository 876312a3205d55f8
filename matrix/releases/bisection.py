"""Bisection over released versions: which release of a package changed one cell's outcome.

    python -m matrix bisect --package transformers --good 4.51.3 --bad 4.50.0 \
        --cell gemma-cache-bf16-loaded-mixed-eval-cpu-accelerate --stack seed-001-gemma3-hybridcache

The candidates are the package's releases between the two versions as pip's index lists them
(pre-releases left out). A scratch environment is built once per stack (torch, the project,
the stack's pins) and reused; each candidate is installed into it and the one cell is run in a
fresh pytest process. The state of a version is the cell's raw result: passed, or failed with
its signature id (catalogue classification is ignored); or, bisecting a loss curve that moved
(CurveJudge), whether the cell's curve is within the old run's row. A cell that skips with a
release, or does not run, decides nothing: the bisection stops with NothingRan (exit status 4),
naming the release and the reason. The search finds the first version,
in version order, whose state differs from the older end's: the release that broke the cell,
or the one that fixed it. Every version tried is recorded as evidence in bisect.json.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from matrix.releases import stacks as version_stacks

ROOT = Path(__file__).resolve().parents[2]
SCRATCH = ROOT / ".bisect"
DEFAULT_TORCH = "torch==2.13.0"


class BisectError(ValueError):
    """Bad input or an impossible bisection: one line for the user, exit status 2."""


NOTHING_RAN_STATUS = 4  # python -m matrix sweep, releases and bisect: the selected cells did not run


class NothingRan(BisectError):
    """The selected cell(s) did not run with a release (they skipped, or no run came back): the
    bisection or sweep decides nothing about it. One line saying where and why; exit status 4."""


@dataclass
class Trial:
    version: str
    state: str  # "passed" or "failed <signature id>"; "error: ..." when the cell could not run
    signature: str | None
    seconds: float


def outcome_state(record: dict) -> tuple[str, str | None]:
    """A version's state by the cell's outcome: (state, its signature text)."""
    signature = record["signature"]
    if record["outcome"] in ("failed", "known"):
        return f"failed {signature['id']}", signature["text"]
    if record["outcome"] in ("passed", "fixed", "inapplicable"):
        return "passed", None
    return f"error: {record['outcome']} ({record.get('skip_reason')})", None


@dataclass(frozen=True)
class CurveJudge:
    """A version's state by the cell's loss curve: within the row of the old run's curve, or moved
    (matrix/results/curves.py). `arguments`: what the cell runs with so that its curve is the runs' own
    (their --curve-steps and --initial-weights)."""

    reference_losses: tuple[float, ...]
    row: dict
    arguments: tuple[str, ...] = ()

    def __call__(self, record: dict) -> tuple[str, str | None]:
        from matrix.results import curves

        losses, _ = curves.curve_of(record)
        if not losses:
            return f"error: no curve ({record['outcome']} in {record.get('phase')})", None
        compared = curves.compare(
            losses, list(self.reference_losses), curves.CurveTolerance.from_dict(self.row), curves.GOLDEN
        )
        if compared.held:
            return "curve as the old run's", None
        return "curve moved", compared.outside(losses)


def final_releases(listed: list[str], with_local: bool = True) -> list[Version]:
    """The versions of an index listing that parse, pre- and dev releases left out (and local
    ones, 2.13.0+cpu, unless `with_local`), unique, in version order."""
    parsed = set()
    for text in listed:
        try:
            version = Version(text)
        except InvalidVersion:
            continue
        if not version.is_prerelease and not version.is_devrelease and (with_local or not version.local):
            parsed.add(version)
    return sorted(parsed)


def versions_between(listed: list[str], first: str, second: str) -> list[str]:
    """The releases from the older to the newer of the two, inclusive, in version order."""
    try:
        low, high = sorted((Version(first), Version(second)))
    except InvalidVersion as error:
        raise BisectError(f"not a version: {error}") from None
    chosen = [str(v) for v in final_releases(listed) if low <= v <= high]
    for end in (str(low), str(high)):
        if end not in chosen:
            raise BisectError(f"{end} is not a released version the index lists")
    return chosen


def parse_index_listing(text: str) -> list[str]:
    match = re.search(r"Available versions:\s*(.+)", text)
    if not match:
        raise BisectError("pip's index listed no versions")
    return [v.strip() for v in match.group(1).split(",") if v.strip()]


def first_change(versions: list[str], state_of) -> tuple[str, str, str]:
    """Binary search for the first version whose state differs from versions[0]'s.

    Assumes one change between the ends (as any bisection does). Returns (version, old
    state, new state)."""
    start, end = state_of(versions[0]), state_of(versions[-1])
    if start == end:
        raise BisectError(f"{versions[0]} and {versions[-1]} give the same result ({start}): nothing to bisect")
    lo, hi = 0, len(versions) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if state_of(versions[mid]) == start:
            lo = mid
        else:
            hi = mid
    return versions[hi], start, state_of(versions[hi])


NOTHING_RAN = "nothing ran:"  # a Trial's state where the cell did not run


class ScratchEnvironment:
    """A venv with torch, the project and a stack's pins, reused across bisections."""

    def __init__(self, stack: version_stacks.Stack, torch_requirement: str) -> None:
        self.stack = stack
        self.path = SCRATCH / stack.name
        self.python = self.path / "bin" / "python"
        self.torch_requirement = torch_requirement
        self.lock_path = SCRATCH / f"{stack.name}.lock"
        self.scratch = True  # built here, pruned by sweeps; CurrentEnvironment is neither

    def pip(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.python), "-m", "pip", *args], capture_output=True, text=True)

    def run_environment(self, package: str, version: str) -> dict[str, str]:
        """The environment variables a run of one release gets: the stack's name. (A package that
        compiles its ops on first use, DeepSpeed's CPU ops, builds them in a directory of the
        environment's keyed by its release: matrix/engines/libraries/extension_builds.py.)"""
        return {**os.environ, "MATRIX_STACK": self.stack.name}

    @contextlib.contextmanager
    def held(self, log=print):
        """The environment for one bisection at a time: two bisections of the same stack would
        install their candidates into one venv under each other's cells. A second one waits."""
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log(f"waiting: another bisection is using the scratch environment {self.path}")
                fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield self
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def ensure(self) -> None:
        stamp = self.path / ".bisect-stack"
        project = version_stacks.project_requirement(ROOT)  # the default extras, as nox's environments have
        key = json.dumps([self.torch_requirement, project, *self.stack.pins, (ROOT / "pyproject.toml").read_text()])
        if stamp.exists() and stamp.read_text() == key:
            return
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(self.path)], check=True)
        for args in ([self.torch_requirement], ["-e", project], list(self.stack.pins)):
            if args:
                done = self.pip("install", "-q", *args)
                if done.returncode:
                    raise BisectError(f"could not install {' '.join(args)}: {done.stderr.strip().splitlines()[-1:]}")
        stamp.write_text(key)
        self.baseline_file.unlink(missing_ok=True)
        self.baseline()

    @property
    def baseline_file(self) -> Path:
        return self.path / ".bisect-baseline"

    def baseline(self) -> dict[str, str]:
        """The versions the environment was built with (name -> version, lower-case names),
        recorded once after it is built: what a bisection or sweep puts a package back to."""
        if not self.baseline_file.exists():
            done = self.pip("list", "--format=json")
            versions = {p["name"].lower(): p["version"] for p in json.loads(done.stdout or "[]")}
            self.baseline_file.write_text(json.dumps(versions, indent=1, sort_keys=True) + "\n")
        return json.loads(self.baseline_file.read_text())

    def restore(self, package: str, log=print) -> None:
        """Put `package` back to the baseline's version after candidates were installed."""
        version = self.baseline().get(package.lower())
        if version is None:
            return
        done = self.pip("install", "-q", f"{package}=={version}")
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
            log(f"could not put {package} back to {version}: {last}")

    def released_versions(self, package: str) -> list[str]:
        done = self.pip("index", "versions", package)
        if done.returncode:
            raise BisectError(f"pip's index has no package {package!r}")
        return parse_index_listing(done.stdout)

    def run_cell(self, package: str, version: str, cell: str, extra: list[str], judge=outcome_state) -> Trial:
        start = time.perf_counter()
        installed = self.pip("install", "-q", f"{package}=={version}")
        if installed.returncode:
            last = (installed.stderr.strip().splitlines() or ["pip failed"])[-1]
            return Trial(version, f"error: install failed: {last}", None, time.perf_counter() - start)
        with tempfile.TemporaryDirectory() as reports:
            command = [
                str(self.python),
                "-m",
                "pytest",
                f"cases/test_cells.py::test_cell[{cell}]",
                "-q",
                "-p",
                "no:cacheprovider",
                "--report-dir",
                reports,
                *extra,
            ]
            env = self.run_environment(package, version)
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
            results = sorted(Path(reports).glob("*/results.json"))
            records = [c for c in json.loads(results[-1].read_text())["cells"] if c["id"] == cell] if results else []
        if not records:
            said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
            last = said[-1].strip() if said else f"pytest exit status {done.returncode}"
            return Trial(version, f"{NOTHING_RAN} the cell did not run ({last})", None, time.perf_counter() - start)
        (record,) = records
        if record["outcome"] == "skipped":
            state = f"{NOTHING_RAN} the cell skipped: {record.get('skip_reason')}"
            return Trial(version, state, None, time.perf_counter() - start)
        state, text = judge(record)
        return Trial(version, state, text, time.perf_counter() - start)


def bisect(
    package: str,
    good: str,
    bad: str,
    cell: str,
    stack_name: str,
    reports_root: Path,
    extra: list[str],
    log=print,
    deadline: float | None = None,
    judge=outcome_state,
) -> dict:
    """`deadline` (time.monotonic()): no new release is tried after it; the bisection stops
    with a BisectError naming what it tried. `judge`: a cell record -> (state, text)."""
    from matrix.selection.cells import cell_from_id

    stacks = version_stacks.load()
    if stack_name not in stacks:
        raise BisectError(f"--stack: unknown stack {stack_name!r}; known: {', '.join(stacks)}")
    if cell_from_id(cell) is None:
        raise BisectError(f"--cell: no cell {cell!r} (ids look like gemma-cache-bf16-mixed-eval-cpu-torch)")
    env = ScratchEnvironment(stacks[stack_name], os.environ.get("MATRIX_TORCH", DEFAULT_TORCH))
    log(f"scratch environment for stack {stack_name}: {env.path}")
    with env.held(log):
        return _bisect_in(env, package, good, bad, cell, stack_name, stacks, reports_root, extra, log, deadline, judge)


def _bisect_in(
    env, package, good, bad, cell, stack_name, stacks, reports_root, extra, log, deadline=None, judge=outcome_state
) -> dict:
    env.ensure()
    versions = versions_between(env.released_versions(package), good, bad)
    log(f"{len(versions)} releases of {package} from {versions[0]} to {versions[-1]}")
    trials: dict[str, Trial] = {}

    def state_of(version: str) -> str:
        if version not in trials:
            if deadline is not None and time.monotonic() > deadline:
                tried = ", ".join(f"{v}: {t.state}" for v, t in trials.items()) or "nothing"
                raise BisectError(f"the time budget ran out before {package}=={version} (tried {tried})")
            trials[version] = env.run_cell(package, version, cell, extra, judge)
            log(f"  {package}=={version}: {trials[version].state}")
        if trials[version].state.startswith(NOTHING_RAN):
            why = trials[version].state.removeprefix(NOTHING_RAN).strip()
            raise NothingRan(f"nothing ran in {package}=={version}: {why}; the bisection decides nothing")
        if trials[version].state.startswith("error"):
            raise BisectError(f"{package}=={version}: {trials[version].state}")
        return trials[version].state

    try:
        changed, before, after = first_change(versions, state_of)
    finally:
        env.restore(package, log)
    result = {
        "package": package,
        "cell": cell,
        "stack": stack_name,
        "pins": list(stacks[stack_name].pins),
        "range": [versions[0], versions[-1]],
        "candidates": versions,
        "first_changed": changed,
        "from_state": before,
        "to_state": after,
        "last_before_change": versions[versions.index(changed) - 1],
        "evidence": [asdict(t) for t in sorted(trials.values(), key=lambda t: Version(t.version))],
    }
    directory = reports_root / ("bisect-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    directory.mkdir(parents=True)
    (directory / "bisect.json").write_text(json.dumps(result, indent=2) + "\n")
    log(
        f"first version where {cell} changes: {package}=={changed} ({before} -> {after}); "
        f"last before it: {result['last_before_change']}"
    )
    log(f"written: {directory / 'bisect.json'}")
    return result


class CurrentEnvironment(ScratchEnvironment):
    """The interpreter running the command, used as it is (as nox's --no-venv is): nothing is
    built and the stack's pins are not installed; each release is installed into it and the
    package put back to the version it had when the command started. For a machine that already
    has the stack (a GPU CI image), and for a sweep of the release already installed (a no-op)."""

    def __init__(self, stack: version_stacks.Stack) -> None:
        super().__init__(stack, "torch (as installed)")
        self.python = Path(sys.executable)
        self.path = Path(sys.prefix)
        key = hashlib.sha256(str(self.path.resolve()).encode()).hexdigest()[:12]
        self.lock_path = SCRATCH / f"current-{key}.lock"
        self.scratch = False
        self._baseline: dict[str, str] | None = None

    def ensure(self) -> None:
        self.baseline()

    def baseline(self) -> dict[str, str]:
        if self._baseline is None:
            done = self.pip("list", "--format=json")
            self._baseline = {p["name"].lower(): p["version"] for p in json.loads(done.stdout or "[]")}
        return self._baseline
