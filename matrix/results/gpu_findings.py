"""docs/gpu-findings.md: what the GPU runs the project keeps found, written from their evidence.

Every run kept under docs/gpu-runs/<session>/ (its results.json, gzipped or not, in a folder of its
own beside its summary.md) becomes one table: when it ran, on which GPU, with which stack and
project commit, the command that selected its cells, its cells by device and outcome, and each
failing signature with the catalogue entry that claimed it in that run, or "new here" where none
did.
A first section sums up which engines, kinds and precisions ever ran on a GPU, with how many
GPUs and ranks, and which never did. A session's title is its README's first heading.

    python -m matrix.results.gpu_findings          # rewrites docs/gpu-findings.md
    python -m matrix.results.gpu_findings --check  # exit 1 if the page is not what the runs say

tests/test_gpu_findings.py checks that the committed page is this module's output. Standard
library only: the evidence is read, nothing of the stack is imported.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shlex
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from matrix.results.files import ResultsError, check

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "docs" / "gpu-runs"
PAGE = ROOT / "docs" / "gpu-findings.md"
RESULTS_NAMES = ("results.json", "results.json.gz")
# the engines that run a cell on a group of ranks (matrix/engines/*.py, `distributed = True`;
# tests/test_gpu_findings.py checks this against the registry), and their compiled twins
DISTRIBUTED = (
    "ddp",
    "fsdp2",
    "accelerate-fsdp2",
    "deepspeed-zero0",
    "deepspeed-zero1",
    "deepspeed-zero2",
    "deepspeed-zero3",
    "hf-trainer-zero2",
    "hf-trainer-zero3",
)
# the test tools a report records beside the stack: not what a cell's verdict depends on
NOT_STACK = ("pytest", "pytest-xdist", "pytest-timeout", "hypothesis")
# a run's own bookkeeping, not its selection: where its report went and what it was called
NOT_SELECTION = ("--report-dir", "--run-id")
SHOWN_OUTCOMES = ("failed", "known", "fixed", "inapplicable", "passed", "skipped")  # the headline's order
OUTCOME_HEADINGS = {
    "failed": "new",
    "known": "known",
    "fixed": "fixed",
    "inapplicable": "not applicable",
    "passed": "passed",
    "skipped": "skipped",
}
MESSAGE_AT_MOST = 110
ABSOLUTE_PATH = re.compile(r"(?<![\w.<])/(?:[\w.+-]+/)+[\w.+-]*")


def is_distributed(engine: str) -> bool:
    return engine.removesuffix("-compile") in DISTRIBUTED


@dataclass
class Run:
    """One kept run: its results.json and where it lies."""

    folder: Path  # the run's own folder (summary.md beside results.json)
    document: dict

    @property
    def run(self) -> dict:
        return self.document["run"]

    @property
    def environment(self) -> dict:
        return self.document["environment"]

    @property
    def started(self) -> str:
        return self.run.get("started_at") or ""

    def command_words(self) -> list[str]:
        return shlex.split(self.run.get("command") or "")

    def selection(self) -> str:
        """The command that ran it, less where its report went and what it was called."""
        words, kept, skip = self.command_words(), [], False
        for word in words:
            if skip:
                skip = False
            elif word in NOT_SELECTION:
                skip = True
            elif not word.startswith(tuple(f"{flag}=" for flag in NOT_SELECTION)):
                kept.append(word)
        return shlex.join(kept)

    def world_size(self) -> int | None:
        """--world-size as the command gave it; None where it gave none."""
        words = self.command_words()
        for index, word in enumerate(words):
            if word == "--world-size" and index + 1 < len(words):
                return int(words[index + 1])
            if word.startswith("--world-size="):
                return int(word.split("=", 1)[1])
        return None

    def gpus(self) -> list[dict]:
        return list(self.environment.get("cuda_devices") or [])

    def ran_on_cuda(self) -> list[dict]:
        return [c for c in self.document["cells"] if c["device"] == "cuda" and c["outcome"] != "skipped"]


@dataclass
class Session:
    """A folder of docs/gpu-runs: the runs of one machine's session, and its README."""

    folder: Path
    title: str
    runs: list[Run] = field(default_factory=list)


def read_results(path: Path) -> dict:
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        document = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError) as error:
        raise ResultsError(f"{path}: cannot read it as a results.json ({error})") from None
    check(document, path)
    return document


def readme_title(folder: Path) -> str:
    readme = folder / "README.md"
    if readme.is_file():
        for line in readme.read_text(encoding="utf-8").splitlines():
            if line.startswith("# "):
                return line[2:].strip()
    return folder.name


def sessions(runs_dir: Path = RUNS) -> list[Session]:
    found = []
    for folder in sorted(p for p in runs_dir.iterdir() if p.is_dir()):
        runs = [
            Run(path.parent, read_results(path))
            for path in sorted(folder.rglob("results.json*"))
            if path.name in RESULTS_NAMES
        ]
        if runs:
            runs.sort(key=lambda r: (r.started, r.run.get("id") or ""))
            found.append(Session(folder, readme_title(folder), runs))
    found.sort(key=lambda s: (s.runs[0].started, s.folder.name))
    return found


# --- the page -------------------------------------------------------------------------------------


def cell_text(text: str) -> str:
    """A value fit for a table cell: one line, no pipe, no absolute path."""
    text = ABSOLUTE_PATH.sub("<path>", " ".join(str(text).split()))
    return text.replace("|", "\\|")


def code(text: str) -> str:
    text = cell_text(text)
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def gpu_line(run: Run) -> str:
    gpus = run.gpus()
    if not gpus:
        return "none recorded"
    names = Counter(f"{g.get('name', '?')} (compute capability {g.get('compute_capability', '?')})" for g in gpus)
    text = ", ".join(f"{count} x {name}" for name, count in names.items())
    env = run.environment
    if env.get("driver_version"):
        text += f"; driver {env['driver_version']}"
        if env.get("driver_cuda_version"):
            text += f" (CUDA {env['driver_cuda_version']})"
    return text


def stack_line(run: Run) -> str:
    env = run.environment
    packages = dict(env.get("packages") or {})
    parts = []
    torch = packages.pop("torch", None)
    if torch:
        parts.append(f"torch {torch}" + (f" (CUDA {env['torch_cuda']})" if env.get("torch_cuda") else ""))
    parts += [f"{name} {version or 'absent'}" for name, version in packages.items() if name not in NOT_STACK]
    if env.get("python"):
        parts.append(f"Python {env['python']}")
    return ", ".join(parts)


def commit_line(run: Run) -> str:
    commit = run.run.get("git_commit")
    if not commit:
        return "not recorded"
    return commit[:7] + (" with uncommitted changes" if run.run.get("git_dirty") else "")


def outcome_rows(run: Run) -> list[str]:
    by_device: dict[str, Counter] = {}
    for cell in run.document["cells"]:
        by_device.setdefault(cell["device"], Counter())[cell["outcome"]] += 1
    rows = [
        "| device | cells | ran | " + " | ".join(OUTCOME_HEADINGS[o] for o in SHOWN_OUTCOMES) + " |",
        "|---|---|---|" + "---|" * len(SHOWN_OUTCOMES),
    ]
    for device in sorted(by_device):
        counts = by_device[device]
        total = sum(counts.values())
        ran = total - counts["skipped"]
        rows.append(f"| {device} | {total} | {ran} | " + " | ".join(str(counts[o]) for o in SHOWN_OUTCOMES) + " |")
    return rows


def signature_rows(run: Run) -> list[str]:
    """One row per signature of the run's failing cells (new and known), most cells first."""
    groups: dict[str, dict] = {}
    for cell in run.document["cells"]:
        if cell["outcome"] not in ("failed", "known"):
            continue
        signature = cell.get("signature") or {}
        key = signature.get("id") or "(no signature)"
        group = groups.setdefault(key, {"signature": signature, "cells": Counter(), "entries": Counter()})
        group["cells"][cell["device"]] += 1
        if cell["outcome"] == "known":
            group["entries"][(cell.get("known_failure") or {}).get("id") or "?"] += 1
        else:
            group["entries"]["new here"] += 1
    if not groups:
        return []
    rows = ["| signature | cells | what | catalogue entry |", "|---|---|---|---|"]
    ordered = sorted(groups.items(), key=lambda kv: (-sum(kv[1]["cells"].values()), kv[0]))
    for key, group in ordered:
        signature = group["signature"]
        cells = ", ".join(f"{n} {device}" for device, n in sorted(group["cells"].items()))
        what = " ".join(
            filter(
                None,
                (
                    f"{signature.get('phase')}:" if signature.get("phase") else "",
                    f"{(signature.get('exception') or '').rsplit('.', 1)[-1]}:" if signature.get("exception") else "",
                    shorten(signature.get("message") or ""),
                ),
            )
        )
        rows.append(f"| `{key}` | {cells} | {cell_text(what)} | {entry_text(group['entries'])} |")
    return rows


def shorten(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= MESSAGE_AT_MOST else message[: MESSAGE_AT_MOST - 3].rstrip() + "..."


def entry_text(entries: Counter) -> str:
    """The entries that claimed a signature's cells, "new here" for those none claimed."""
    parts = []
    for entry, count in sorted(entries.items(), key=lambda kv: (kv[0] != "new here", kv[0])):
        label = "new here" if entry == "new here" else f"`{entry}`"
        parts.append(label if len(entries) == 1 else f"{label} ({count})")
    return "; ".join(parts)


def fixed_line(run: Run) -> str | None:
    fixed = Counter(
        (cell.get("known_failure") or {}).get("id") or "?"
        for cell in run.document["cells"]
        if cell["outcome"] in ("fixed", "inapplicable")
    )
    if not fixed:
        return None
    return "Passed where an entry said they fail (fixed, or not applicable on this machine): " + ", ".join(
        f"`{entry}` {count}" for entry, count in sorted(fixed.items())
    )


def relative(path: Path, page: Path) -> str:
    """`path` as a link from `page`."""
    return Path(os.path.relpath(path, page.parent)).as_posix()


def coverage(all_sessions: list[Session]) -> list[str]:
    runs = [run for session in all_sessions for run in session.runs]
    ran = [(run, cell) for run in runs for cell in run.ran_on_cuda()]
    gpu_counts = Counter(len(run.gpus()) for run in runs)
    lines = ["## What has run on a GPU", ""]
    lines.append(
        f"{len(runs)} runs in {len(all_sessions)} sessions; GPUs visible to a run: "
        + ", ".join(f"{n} in {count} runs" for n, count in sorted(gpu_counts.items()))
        + f". Cells that ran on a GPU (not skipped): {len(ran)}."
    )
    lines.append("")
    lines += ["| engine | cells run on a GPU | in runs | ranks per cell (`--world-size`) |", "|---|---|---|---|"]
    newest_axes = (runs[-1].run.get("axes") or {}) if runs else {}
    engines = list(newest_axes.get("engine") or [])
    engines += sorted({cell["engine"] for _, cell in ran} - set(engines))
    never = []
    for engine in engines:
        cells = [(run, cell) for run, cell in ran if cell["engine"] == engine]
        if not cells:
            never.append(engine)
            continue
        run_ids = sorted({(run.started, run.run.get("id")) for run, _ in cells})
        ranks = "-"
        if is_distributed(engine):
            sizes = sorted({run.world_size() for run, _ in cells}, key=lambda s: (s is None, s))
            ranks = ", ".join("default" if s is None else str(s) for s in sizes)
        lines.append(f"| {engine} | {len(cells)} | {len(run_ids)} | {ranks} |")
    lines.append("")
    lines.append("Never run on a GPU in these runs:")
    lines.append("")
    lines.append("- engines: " + (", ".join(never) or "none"))
    for axis, label in (("model", "model kinds"), ("precision", "precisions")):
        values = [v for v in newest_axes.get(axis) or [] if not any(cell[axis] == v for _, cell in ran)]
        lines.append(f"- {label}: " + (", ".join(values) or "none"))
    several = [run for run in runs if len(run.gpus()) > 1]
    lines.append(
        "- several GPUs (ranks or workers on distinct GPUs): "
        + (
            "ran in " + ", ".join(run.run.get("id") or "?" for run in several)
            if several
            else "no run had more than one"
        )
    )
    lines.append("")
    lines.append(
        "(engines, kinds and precisions as the newest run lists them; a distributed engine's cells ran on one "
        "GPU where its ranks per cell are 1)"
    )
    return lines


def render(runs_dir: Path = RUNS, page: Path = PAGE) -> str:
    all_sessions = sessions(runs_dir)
    lines = [
        "# What the GPU runs found",
        "",
        "Generated by `python -m matrix.results.gpu_findings` from the runs kept in "
        f"[{relative(runs_dir, page)}/]({relative(runs_dir, page)}/) (each run's results.json, gzipped, beside its "
        "summary.md): do not edit by hand. How to run the matrix on a GPU: [GPU.md](GPU.md).",
        "",
        'A signature\'s catalogue entry is the one that claimed its cells in that run; "new here" means '
        "no entry of the catalogue of that commit did, which says nothing about a regression (no baseline "
        "was compared). Entries written since cite the runs they settled in their notes "
        "(`matrix/catalogue/known_failures.toml`).",
        "",
    ]
    lines += coverage(all_sessions)
    for session in all_sessions:
        lines += ["", f"## {session.title}", ""]
        readme = session.folder / "README.md"
        if readme.is_file():
            lines += [f"What ran and why: [{relative(readme, page)}]({relative(readme, page)}).", ""]
        for run in session.runs:
            run_id = run.run.get("id") or run.folder.name
            summary = run.folder / "summary.md"
            lines += [f"### Run {run_id}", ""]
            started = run.started.replace("T", " ").rstrip("Z")[:16]
            facts = [
                ("started", f"{started} UTC" if started else "not recorded"),
                ("GPU", gpu_line(run)),
                ("stack", stack_line(run)),
                ("project commit", commit_line(run)),
                ("command", code(run.selection())),
                ("pytest", f"{run.run['duration_s']:.0f} s" if run.run.get("duration_s") else "not recorded"),
            ]
            if summary.is_file():
                facts.append(("report", f"[{relative(summary, page)}]({relative(summary, page)})"))
            lines += ["| | |", "|---|---|"] + [f"| {name} | {value} |" for name, value in facts] + [""]
            lines += [*outcome_rows(run), ""]
            rows = signature_rows(run)
            lines += [*rows, ""] if rows else ["No cell failed.", ""]
            fixed = fixed_line(run)
            if fixed:
                lines += [fixed, ""]
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m matrix.results.gpu_findings", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from what the runs say")
    parser.add_argument("-o", "--output", type=Path, default=PAGE, help="the page (default docs/gpu-findings.md)")
    args = parser.parse_args(argv)
    try:
        text = render(page=args.output.resolve())
    except ResultsError as error:
        print(f"python -m matrix.results.gpu_findings: {error}", file=sys.stderr)
        return 2
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.is_file() else ""
        if current != text:
            print(
                f"{args.output}: not what docs/gpu-runs says; run python -m matrix.results.gpu_findings",
                file=sys.stderr,
            )
            return 1
        return 0
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
