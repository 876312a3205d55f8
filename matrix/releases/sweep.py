"""A release sweep: one cell selection over several releases of one package.

    python -m matrix sweep --package transformers --last 5 [--stack NAME] [pytest selection ...]
    python -m matrix sweep --package accelerate --versions 1.12.0,1.13.0,1.14.0 --model lora

Each release is installed into the stack's scratch environment (matrix/releases/bisection.py's: torch, the
project and the stack's pins, built once, reused and locked against a second user), checked for
import with the rest of the stack, and the selection runs in a fresh `python -m matrix run`
process. A release that pip cannot install, or that installs but does not import, is listed with
pip's or Python's own last line instead of cells. After the sweep the package goes back to the
version the environment was built with (its baseline), so the next sweep or bisection starts
from the stack itself.

It writes reports/sweep-<package>-<time>/: each release's run under runs/<version>/, and
sweep.json (the data), sweep.md and sweep.html (matrix/results/sweep_table.py: release x
precision x engine folded by state, and the first release where each cell changed).
Environments are pruned to the most recently used MATRIX_SCRATCH_KEEP (default 3).

A release whose selected cells did not run (all skipped: a capability this machine or
environment lacks; or no run came back) gives no verdict: the log and the page name it with the
skips' reasons (sweep_table.nothing_ran), and python -m matrix sweep exits 4. The scratch
environment has the extras every nox environment has (matrix/releases/stacks.py DEFAULT_EXTRAS), so a
sweep's cells skip where the default run's would, not more. `in_this_environment`: the releases
go into the interpreter running the sweep instead (bisect.CurrentEnvironment).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from matrix.releases import stacks as version_stacks
from matrix.releases.bisection import (
    DEFAULT_TORCH,
    SCRATCH,
    BisectError,
    CurrentEnvironment,
    ScratchEnvironment,
    final_releases,
    parse_index_listing,
)
from matrix.results.sweep_table import RAN, brief_cell, nothing_ran, nothing_ran_line, sweep_html, sweep_markdown

# What a release must import beside: the stack the matrix runs on.
IMPORT_CHECK = "import torch, transformers, peft, accelerate, lightning, safetensors; import matrix.models"
SCRATCH_KEEP = int(os.environ.get("MATRIX_SCRATCH_KEEP", "3"))


class SweepError(BisectError):
    """Bad input: one line for the user, exit status 2."""


def last_releases(listed: list[str], count: int, newest: str | None = None, per: str = "release") -> list[str]:
    """The `count` newest final releases (at most `newest`), oldest first; with per="minor",
    the newest patch of each of the `count` newest minor lines (4.50.3, 4.51.3, ...)."""
    if per not in ("release", "minor"):
        raise SweepError(f"--per: {per!r}; choose release or minor")
    if count < 1:
        raise SweepError("--last: give a number of releases, 1 or more")
    ordered = [v for v in final_releases(listed, with_local=False) if newest is None or v <= Version(newest)]
    if per == "minor":
        ordered = list({(v.major, v.minor): v for v in ordered}.values())  # the last of each line wins
    return [str(v) for v in ordered[-count:]]


def chosen_versions(text: str) -> list[str]:
    versions = [part.strip() for part in text.split(",") if part.strip()]
    try:
        return [str(v) for v in sorted({Version(v) for v in versions})]
    except InvalidVersion as error:
        raise SweepError(f"--versions: not a version: {error}") from None


def _last_line(text: str, fallback: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip() and not line.startswith("WARNING")]
    return lines[-1] if lines else fallback


def _size_mb(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).lstat().st_size
            except OSError:
                continue
    return round(total / 2**20)


def prune_scratch(keep: int = SCRATCH_KEEP, in_use: Path | None = None, log=print) -> list[str]:
    """Delete the scratch environments beyond the `keep` most recently used (their stamp's
    mtime); never the one in use. Returns the names removed."""
    if not SCRATCH.exists():
        return []
    environments = [p for p in SCRATCH.iterdir() if p.is_dir()]

    def last_used(path: Path) -> float:
        stamp = path / ".bisect-stack"
        return stamp.stat().st_mtime if stamp.exists() else 0.0

    removed = []
    for path in sorted(environments, key=last_used, reverse=True)[keep:]:
        if in_use is not None and path.resolve() == in_use.resolve():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
        log(f"pruned scratch environment {path} (more than {keep} kept)")
    return removed


@dataclass
class ReleaseResult:
    version: str
    status: str  # "ran" | "does not install" | "does not import" | "did not run"
    detail: str | None
    seconds: float
    run: str | None = None  # runs/<version>, relative to the sweep directory
    packages: dict | None = None
    cells: dict | None = None

    def as_dict(self) -> dict:
        return {
            "version": self.version,
            "status": self.status,
            "detail": self.detail,
            "seconds": round(self.seconds, 1),
            "run": self.run,
            "packages": self.packages,
            "cells": self.cells,
        }


def run_release(env: ScratchEnvironment, package: str, version: str, selection: list[str], runs: Path) -> ReleaseResult:
    start = time.perf_counter()
    installed = env.pip("install", "-q", f"{package}=={version}")
    if installed.returncode:
        detail = _last_line(installed.stderr, "pip failed")
        return ReleaseResult(version, "does not install", detail, time.perf_counter() - start)
    imported = subprocess.run([str(env.python), "-c", IMPORT_CHECK], capture_output=True, text=True)
    if imported.returncode:
        detail = _last_line(imported.stderr, "import failed")
        return ReleaseResult(version, "does not import", detail, time.perf_counter() - start)
    command = [str(env.python), "-m", "matrix", "run", "cases", *selection]
    command += ["--report-dir", str(runs), "--run-id", version]
    environment = env.run_environment(package, version)
    done = subprocess.run(
        command, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, env=environment
    )
    results = runs / version / "results.json"
    if not results.exists():
        detail = _last_line(done.stderr or done.stdout, f"exit status {done.returncode}, no results.json")
        return ReleaseResult(version, "did not run", detail, time.perf_counter() - start)
    document = json.loads(results.read_text())
    packages = {name: value for name, value in (document["environment"].get("packages") or {}).items()}
    cells = {cell["id"]: brief_cell(cell) for cell in document["cells"]}
    return ReleaseResult(version, RAN, None, time.perf_counter() - start, f"runs/{version}", packages, cells)


def sweep(
    package: str,
    *,
    versions: list[str] | None,
    last: int | None,
    newest: str | None,
    stack_name: str,
    per: str = "release",
    selection: list[str],
    reports_root: Path,
    in_this_environment: bool = False,
    log=print,
) -> tuple[dict, Path]:
    """The sweep's document and directory. `in_this_environment`: the releases go into the
    interpreter running the sweep (CurrentEnvironment) instead of the stack's scratch environment.
    Where the selected cells did not run in a release (sweep_table.nothing_ran), the log and the
    page say so; python -m matrix sweep then exits with NOTHING_RAN_STATUS."""
    stacks = version_stacks.load()
    if stack_name not in stacks:
        raise SweepError(f"--stack: unknown stack {stack_name!r}; known: {', '.join(stacks)}")
    if (versions is None) == (last is None):
        raise SweepError("give the releases: --last N or --versions A,B,C")
    stack = stacks[stack_name]
    if in_this_environment:
        env = CurrentEnvironment(stack)
        log(f"this environment, as it is (the stack's pins are not installed): {env.path}")
    else:
        env = ScratchEnvironment(stack, os.environ.get("MATRIX_TORCH", DEFAULT_TORCH))
        log(f"scratch environment for stack {stack_name}: {env.path}")
    selection = [*stack.select, *selection]
    started = time.perf_counter()
    with env.held(log):
        env.ensure()
        if env.scratch:
            (env.path / ".bisect-stack").touch()  # last used: what pruning keeps
        if versions is None:
            done = env.pip("index", "versions", package)
            if done.returncode:
                raise SweepError(f"pip's index has no package {package!r}")
            versions = last_releases(parse_index_listing(done.stdout), last, newest, per)
        directory = reports_root / f"sweep-{package}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
        runs = directory / "runs"
        runs.mkdir(parents=True)
        log(f"{len(versions)} releases of {package}: {', '.join(versions)}; selection: {' '.join(selection) or 'all'}")
        results = []
        try:
            for version in versions:
                result = run_release(env, package, version, selection, runs)
                counts = {}
                for cell in (result.cells or {}).values():
                    key = cell["state"].split(" ")[0]
                    counts[key] = counts.get(key, 0) + 1
                log(f"  {package}=={version}: {result.status} {result.detail or counts} ({result.seconds:.0f} s)")
                results.append(result)
        finally:
            env.restore(package, log)
        size = _size_mb(env.path) if env.scratch else None
    document = {
        "kind": "release-sweep",
        "package": package,
        "stack": stack_name,
        "pins": list(stack.pins),
        "torch_requirement": env.torch_requirement,
        "selection": selection,
        "axis_order": _axis_order(directory, results),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - (time.perf_counter() - started))),
        "wall_s": round(time.perf_counter() - started, 1),
        "environment": str(env.path),
        "environment_mb": size,
        "releases": [r.as_dict() for r in results],
    }
    write_sweep(document, directory)
    for entry in nothing_ran(document):
        log(nothing_ran_line(entry))
    if env.scratch:
        prune_scratch(in_use=env.path, log=log)
    return document, directory


def _axis_order(directory: Path, results: list[ReleaseResult]) -> dict:
    """The registries' order of precisions and engines, as the first run that ran recorded it."""
    for result in results:
        if result.run:
            selection = json.loads((directory / result.run / "results.json").read_text())["run"]["selection"]
            return {"precision": selection.get("precision", []), "engine": selection.get("engine", [])}
    return {}


RELEASES_FILE = Path(__file__).with_name("releases.toml")


def published_sweeps(path: Path = RELEASES_FILE) -> tuple[list[str], list[dict]]:
    """The selection and the sweeps of the published table (matrix/releases/releases.toml)."""
    import tomllib

    data = tomllib.loads(path.read_text())
    sweeps = data.get("sweep", [])
    for entry in sweeps:
        if (
            "package" not in entry
            or ("last" in entry) == ("versions" in entry)
            or entry.get("per", "release")
            not in (
                "release",
                "minor",
            )
        ):
            raise SweepError(
                f"{path}: each [[sweep]] names a package and either last or versions (per: release or minor): {entry}"
            )
    return list(data.get("selection", [])), sweeps


def write_sweep(document: dict, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as handle:
        handle.write(json.dumps(document, indent=2) + "\n")
    Path(handle.name).replace(directory / "sweep.json")
    (directory / "sweep.md").write_text(sweep_markdown(document))
    (directory / "sweep.html").write_text(sweep_html(document))
