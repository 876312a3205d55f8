"""Ops a library compiles the first time it needs them (torch's JIT extension builder): DeepSpeed's
CPU ops. Where they are built, building them once before the first cell that needs them, and the
build lock a killed build leaves behind. No pytest; imports no torch.

Where: torch builds an op `name` in TORCH_EXTENSIONS_DIR/name (by default one directory per
user, ~/.cache/torch_extensions/py311_cpu, shared by every environment and every release, so one
DeepSpeed release loads or rebuilds another's op). The matrix's cells run with it set
(matrix/execute/environment_variables.py) to a directory the run owns, keyed by the releases that decide what
is built: <environment>/torch-extensions/torch-2.13.0-deepspeed-0.19.8 (`sys.prefix`; where that
is not writable, ~/.cache/precision-matrix/torch-extensions/<a hash of it>/...). A setting of
one's own is kept, as every cell variable is: that directory is the user's, not the run's.

When: a library's one-time work is done in the test's setup before the first cell of an engine
that needs it, in this process, under --kind-setup-timeout, and recorded in the report's
"One-time work per kind" (as a kind's is, matrix/harness/kind_setup.py): `establish`. The build runs in
a child process of its own session, killed (with its compilers) when the budget runs out. Its
ranks then load the built op in a second or so instead of building it inside a cell's budget.

The lock: torch builds under a FileBaton, NAME/lock, created exclusively, held open by the
builder while it builds and removed after; a process that finds it waits until the file goes,
however long that is. A build that is killed (a rank killed at its cell's timeout) leaves the
file, and every later build of the op in that directory waits on it: every DeepSpeed cell then
ends in the rank pool's RankTimeout. The file names no owner, but the builder keeps it open: a
lock that no process of this user has open (looked at twice, half a second apart, same file) is
stale. In the run's own directory a stale lock is reclaimed (removed, under a lock of the run's
own, and said); in a directory the user chose it is StaleBuildLock, naming the file, before
anything waits on it. The same check runs in each rank before the library loads its ops.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from matrix.harness.kind_setup import KindSetup

VARIABLE = "TORCH_EXTENSIONS_DIR"
# the releases that decide what an op's build is: the compiler's inputs come from these
KEYED_BY = ("torch", "deepspeed")
CONFIRM_S = 0.5  # a lock nobody holds is looked at again after this, to let a release finish
# the libraries whose engines build ops on first use: required package -> its module's builds
LIBRARIES = {"deepspeed": "matrix.engines.libraries.deepspeed"}


class StaleBuildLock(RuntimeError):
    """A build lock no live process holds, in a directory the run does not own: whatever builds
    that op there would wait on it forever."""


class ExtensionBuildTimedOut(RuntimeError):
    """A library's one-time build ran past its budget (--kind-setup-timeout): its cells in this
    process fail at once instead of building it again inside their own budget."""


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def owned_root() -> Path:
    """Where the run keeps its builds: inside the environment, else in the user's cache."""
    prefix = Path(sys.prefix)
    if os.access(prefix, os.W_OK):
        return prefix / "torch-extensions"
    key = hashlib.sha256(str(prefix.resolve()).encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "precision-matrix" / "torch-extensions" / key


@functools.cache  # asked for every cell; the releases do not change under a running process
def owned_directory() -> Path:
    """The run's directory for this environment's releases: torch-2.13.0-deepspeed-0.19.8."""
    parts = [f"{name}-{_version(name)}" for name in KEYED_BY if _version(name)]
    return owned_root() / "-".join(parts or ["none"])


def variables() -> dict[str, str]:
    """The cell variable (matrix/execute/environment_variables.py): where torch builds extensions."""
    return {VARIABLE: str(owned_directory())}


def directory() -> Path:
    """Where torch builds this process's extensions: the variable, else torch's own default
    (which the run does not own)."""
    chosen = os.environ.get(VARIABLE)
    if chosen:
        return Path(chosen)
    return Path.home() / ".cache" / "torch_extensions" / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"


def owned(path: Path) -> bool:
    return path.resolve().is_relative_to(owned_root().resolve())


def lock_holders(lock: Path) -> list[int]:
    """The processes of this user that have `lock` open (/proc/<pid>/fd): a live builder keeps
    its baton open from creating it until it removes it. Another user's processes cannot be
    looked at; they cannot build in this user's directories either."""
    try:
        target = os.stat(lock)
    except FileNotFoundError:
        return []
    holders = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            for fd in (entry / "fd").iterdir():
                try:
                    opened = os.stat(fd)
                except OSError:
                    continue
                if (opened.st_dev, opened.st_ino) == (target.st_dev, target.st_ino):
                    holders.append(int(entry.name))
                    break
        except (FileNotFoundError, PermissionError, ProcessLookupError, NotADirectoryError):
            continue  # gone meanwhile, or not ours to read
    return holders


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return None
    return status.st_dev, status.st_ino


def stale_lock(op: str, where: Path | None = None) -> Path | None:
    """The op's build lock if it is stale (no live holder, the same file half a second later)."""
    lock = (where or directory()) / op / "lock"
    first = _identity(lock)
    if first is None or lock_holders(lock):
        return None
    time.sleep(CONFIRM_S)  # a builder between closing its baton and removing it
    if _identity(lock) != first or lock_holders(lock):
        return None
    return lock


def clear_stale_lock(op: str, where: Path | None = None, log=print, ours: bool = False) -> Path | None:
    """Before anything builds `op`: a stale lock in the run's own directory is removed (and
    returned); in another directory it is StaleBuildLock. None where there is no stale lock.
    `ours`: the build that left it was this process's child, killed here: its lock is removed
    wherever it is."""
    where = where or directory()
    lock = stale_lock(op, where)
    if lock is None:
        return None
    if not owned(where) and not ours:
        raise StaleBuildLock(
            f"{lock} is held by no live process (left by a build of {op} that was killed): every build of "
            f"{op} in {where} waits on it; delete it (the directory is {VARIABLE}, the run's to read, not to clean)"
        )
    with _reclaiming(where):  # one reclaimer at a time: none removes a lock another has just made
        if stale_lock(op, where) is None:
            return None
        lock.unlink(missing_ok=True)
    log(f"removed {lock}: a stale build lock (no live process held it; left by a build of {op} that was killed)")
    return lock


@contextlib.contextmanager
def _reclaiming(where: Path):
    where.mkdir(parents=True, exist_ok=True)
    with open(where / ".matrix-reclaim.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---------------------------------------------------------------- the one-time build


@dataclass
class LibrarySetup(KindSetup):
    """A library's one-time build in one process, as the report's one-time work shows it: a kind's
    record (matrix/harness/kind_setup.py), `kind` naming the library, with where it built and what stopped
    its cells."""

    training: bool = field(default=True, kw_only=True)  # its cells train and evaluate alike
    directory: str | None = None
    reclaimed: list[str] = field(default_factory=list)  # stale locks removed first
    blocked: BaseException | None = field(default=None, repr=False)  # what stops the cells

    @property
    def for_(self) -> str:
        return "its engines' cells"

    def as_dict(self) -> dict:
        record = asdict(self)
        record.pop("blocked")
        record["for"] = self.for_
        return record


_DONE: dict[tuple[str, str], LibrarySetup] = {}


def libraries_of(engine) -> list[str]:
    return [package for package in getattr(engine, "requires", ()) if package in LIBRARIES]


def establish(engine, device: str, budget_s: float, log=print) -> list[LibrarySetup]:
    """Build the ops the engine's libraries compile on first use on `device`, once per process,
    before the engine's first cell. Returns the records of what was done now."""
    import importlib

    done = []
    for library in libraries_of(engine):
        if (library, device) in _DONE or _version(library) is None:
            continue
        where = Path(
            os.environ.get(VARIABLE) or owned_directory()
        )  # the cells' (matrix/execute/environment_variables.py)
        began = time.perf_counter()
        try:
            module = importlib.import_module(LIBRARIES[library])
            ops = module.ops_built_on_first_use(device)
            names = [module.op_name(op) for op in ops]
        except Exception as error:  # recorded; the cells meet it again in their ranks, with its signature
            setup = LibrarySetup(kind=_kind(library), budget_s=budget_s, directory=str(where), outcome="failed")
            setup.error = f"finding its ops: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            _DONE[(library, device)] = setup
            done.append(setup)
            continue
        if not ops:
            continue
        if all(_built(name, where) for name in names):  # an earlier process built them: nothing to do
            setup = LibrarySetup(kind=_kind(library), budget_s=budget_s, directory=str(where))
            setup.steps = {f"{name} (built already)": 0.0 for name in names}
            setup.seconds = round(time.perf_counter() - began, 3)
        else:
            setup = build(library, module, ops, device, where, budget_s, log)
        _DONE[(library, device)] = setup
        done.append(setup)
    return done


def _kind(library: str) -> str:
    return f"{library} {_version(library)} (the ops it builds on first use)"


def _built(name: str, where: Path) -> bool:
    """The op's library is in its build directory and no lock is there (built, not being built)."""
    return (where / name / f"{name}.so").is_file() and not (where / name / "lock").exists()


def blocking(engine, device: str) -> BaseException | None:
    """What stops the engine's cells in this process: a build that ran out of its budget, or a
    stale lock in a directory the run does not own."""
    for library in libraries_of(engine):
        setup = _DONE.get((library, device))
        if setup is not None and setup.blocked is not None:
            return setup.blocked
    return None


def build(
    library: str, module, ops: tuple[str, ...], device: str, where: Path, budget_s: float, log=print
) -> LibrarySetup:
    """Build `ops` (the library module's builder names) in `where`, in a child process of its own
    session, within `budget_s`."""
    setup = LibrarySetup(kind=_kind(library), budget_s=budget_s, directory=str(where))
    began = time.perf_counter()
    command = [sys.executable, "-m", "matrix.engines.libraries.extension_builds", module.__name__, *ops]
    child = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a session of its own: it and its compilers are killed together (kill_session)
        env={**os.environ, **module.build_variables(device), VARIABLE: str(where)},
    )
    try:
        output, _ = child.communicate(timeout=budget_s)
    except subprocess.TimeoutExpired:
        kill_session(child.pid)
        output, _ = child.communicate()
        setup.outcome = "timed out"
        setup.error = f"building {', '.join(ops)} was still running when the budget of {budget_s:g} s ran out"
        setup.blocked = ExtensionBuildTimedOut(
            f"{library}'s one-time build of its ops ({', '.join(ops)}) ran past --kind-setup-timeout {budget_s:g} s"
        )
    reports = [json.loads(line) for line in output.splitlines() if line.startswith('{"op"')]
    for report in reports:
        if report.get("reclaimed"):
            setup.reclaimed.append(report["reclaimed"])
        if "seconds" in report:
            reclaimed = any(r.get("reclaimed") and r["op"] == report["op"] for r in reports)
            setup.steps[report["op"] + (" (a stale build lock removed first)" if reclaimed else "")] = report["seconds"]
        if report.get("error") and setup.outcome == "done":
            setup.outcome, setup.error = "failed", f"{report['op']}: {report['error']}"
            if report["error"].startswith(StaleBuildLock.__name__):
                setup.blocked = StaleBuildLock(report["error"].split(": ", 1)[1])
    if setup.outcome == "timed out":  # the build killed here left its lock: ours to take back
        for op in dict.fromkeys(report["op"] for report in reports):
            reclaimed = clear_stale_lock(op, where, lambda line: None, ours=True)  # said below
            if reclaimed is not None:
                setup.reclaimed.append(str(reclaimed))
    elif child.returncode and setup.outcome == "done":
        setup.outcome = "failed"
        lines = [line for line in output.splitlines() if line.strip()]
        setup.error = f"the build exited with status {child.returncode}: {lines[-1] if lines else ''}"
    setup.seconds = round(time.perf_counter() - began, 3)
    for lock in setup.reclaimed:
        log(f"{library}: removed a stale build lock, {lock}")
    return setup


def session_members(session: int) -> list[int]:
    """The processes of a session (/proc/<pid>/stat's sixth field): a build's child and everything
    it started. Ninja puts each command it runs in a process group of its own, so the compilers
    are not in the child's group; they are in its session."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[3]) == session and fields[0] != "Z":  # a zombie is dead already, waiting to be reaped
            members.append(int(entry.name))
    return members


def kill_session(session: int) -> None:
    """SIGKILL every process of the session, until none is left (a compiler ninja had started
    dies with it rather than finishing its object file in a directory the next build uses)."""
    for _ in range(50):
        members = session_members(session)
        if not members:
            return
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def forget() -> None:
    """This process's records go (a test's fresh start)."""
    _DONE.clear()


def _build_in_child(module: str, ops: list[str]) -> int:
    """The child's side: for each op, a line of JSON {"op", "reclaimed", "seconds" | "error"}."""
    import importlib

    library = importlib.import_module(module)
    status = 0
    for builder in ops:
        name = library.op_name(builder)
        said: dict = {"op": name}
        try:
            reclaimed = clear_stale_lock(name, log=lambda line: None)
            # before the build: which lock is its, should it be killed, and what was taken back
            print(json.dumps({"op": name, "reclaimed": str(reclaimed) if reclaimed else None}), flush=True)
            began = time.perf_counter()
            library.build_op(builder)
            said["seconds"] = round(time.perf_counter() - began, 3)
        except Exception as error:  # said to the parent, which records it
            said["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            status = 1
        print(json.dumps(said), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(_build_in_child(sys.argv[1], sys.argv[2:]))
