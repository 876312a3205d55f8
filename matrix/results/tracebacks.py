"""A failed cell's traceback as the reports show it: the frames of the user's code and of the
libraries first, the harness's own folded (standard library only).

A cell's traceback (results.json `traceback`, kept whole there) runs through the harness before
it reaches the code under test: the phase runner, the pipeline, the engine's adapter, and for a
distributed engine a second traceback, the rank's, appended to the driver's after "raised in the
rank as:". The driver's side of that pair is plumbing only (the rank pool's RankFailure, which
repeats the rank's exception); the rank's side holds the failure. So the reports show:

- of a rank's failure, the rank's side first, and the driver's side folded whole;
- in each part shown, every run of consecutive frames of the matrix package folded into one
  line that counts them and names the innermost, where the harness handed over to the library
  or the user's code (or, for a failure of the harness's own checks, the check that raised).

`shown(text)` returns the parts in the order shown, each a Segment: text to show as it is, or a
fold (its text, and the line that stands for it). summary.md writes each fold as its line;
index.html as a <details> whose summary is that line.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

from matrix.results.crash_dump import CHAIN_LINES
from matrix.results.module_moves import FLAT_ENTRIES

RANK_LINE = "raised in the rank as:"  # matrix/execute/cell_run.py: what joins the rank's traceback to the driver's
_FILE = re.compile(r'^(?P<indent>\s*)File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<function>.+)$')
# The entries of the matrix package (modules and subpackages): a frame is the harness's when its
# file sits in a directory named matrix, under one of these (on this machine or the one that ran),
# or under one of the flat package's modules (a traceback recorded before the folders, issue 49).
PACKAGE = Path(__file__).resolve().parents[1]
HARNESS_ENTRIES = frozenset(entry.name for entry in PACKAGE.iterdir() if not entry.name.startswith(".")) | FLAT_ENTRIES


@dataclass(frozen=True)
class Segment:
    text: str  # the lines, joined by newlines
    folded: bool = False  # harness frames (or the driver's side of a rank's failure), folded
    line: str = ""  # a fold's one line: what it stands for

    @property
    def shown_text(self) -> str:
        return self.line if self.folded else self.text


def harness_file(path: str) -> bool:
    """A frame's file is the matrix package's: .../matrix/<one of its entries>/..."""
    parts = path.replace("\\", "/").split("/")
    return any(part == "matrix" and after in HARNESS_ENTRIES for part, after in itertools.pairwise(parts))


def _relative(path: str) -> str:
    """A harness file as matrix/...: the part that is the same on every machine."""
    parts = path.replace("\\", "/").split("/")
    start = max(n for n, part in enumerate(parts[:-1]) if part == "matrix" and parts[n + 1] in HARNESS_ENTRIES)
    return "/".join(parts[start:])


def _split_parts(lines: list[str]) -> list[list[str]]:
    """The parts of a chained traceback, each from its chain line (or the start) on."""
    parts: list[list[str]] = [[]]
    for line in lines:
        if line.strip() in CHAIN_LINES and parts[-1]:
            parts.append([])
        parts[-1].append(line)
    return parts


def _frames(part: list[str]) -> list[tuple[str, list[str]]]:
    """A part as runs: ("text", lines) and ("frame", lines of one frame: its File line and the
    indented lines under it, code and carets). Lines after the exception's first line stay text."""
    runs: list[tuple[str, list[str]]] = []
    in_frame = False
    for line in part:
        if _FILE.match(line):
            runs.append(("frame", [line]))
            in_frame = True
        elif in_frame and line.startswith((" ", "\t")):
            runs[-1][1].append(line)
        else:
            in_frame = False
            if runs and runs[-1][0] == "text":
                runs[-1][1].append(line)
            else:
                runs.append(("text", [line]))
    return runs


def _fold_line(frames: list[list[str]]) -> str:
    match = _FILE.match(frames[-1][0])
    count = len(frames)
    where = f"{_relative(match['path'])}, line {match['line']}, in {match['function']}"
    innermost = "" if count == 1 else "innermost: "
    return f"{match['indent']}... {count} frame{'s' if count != 1 else ''} of the harness folded ({innermost}{where})"


def _fold_part(part: list[str]) -> list[Segment]:
    """A part's lines with each run of consecutive harness frames folded."""
    segments: list[Segment] = []
    shown: list[str] = []
    harness: list[list[str]] = []

    def flush_harness() -> None:
        if harness:
            segments.append(Segment("\n".join(line for frame in harness for line in frame), True, _fold_line(harness)))
            harness.clear()

    for kind, lines in _frames(part):
        match = _FILE.match(lines[0]) if kind == "frame" else None
        if match and harness_file(match["path"]):
            if shown:
                segments.append(Segment("\n".join(shown)))
                shown = []
            harness.append(lines)
            continue
        flush_harness()
        shown += lines
    flush_harness()
    if shown:
        segments.append(Segment("\n".join(shown)))
    return segments


def _driver_line(driver: list[str]) -> str:
    frames = sum(1 for line in driver if _FILE.match(line))
    raised = next((line.split(":", 1)[0] for line in reversed(driver) if line and not line[0].isspace()), "")
    return (
        f"(the driver's side, {frames} frame{'s' if frames != 1 else ''} of the harness"
        + (f" ending in {raised}" if raised else "")
        + ", folded: it passes on the rank's exception)"
    )


def shown(text: str) -> list[Segment]:
    """The traceback as shown: the rank's side first, harness frames folded (module docstring)."""
    if not text:
        return []
    lines = text.rstrip("\n").split("\n")
    parts = _split_parts(lines)
    rank = next((n for n, part in enumerate(parts) if part[0].strip() == RANK_LINE), None)
    if rank is None:
        return [segment for part in parts for segment in _fold_part(part)]
    driver = [line for part in parts[:rank] for line in part]
    while driver and not driver[-1].strip():
        driver.pop()
    rank_side = [line for part in parts[rank:] for line in part][1:]  # without the "raised in the rank as:" line
    while rank_side and not rank_side[0].strip():
        rank_side.pop(0)
    segments = [segment for part in _split_parts(rank_side) for segment in _fold_part(part)]
    return [*segments, Segment("\n".join(driver), True, "\n" + _driver_line(driver))]


def harness_frames(segments: list[Segment]) -> int:
    """How many frames of the harness the segments fold."""
    return sum(1 for s in segments if s.folded for line in s.text.split("\n") if _FILE.match(line))


def shown_text(text: str) -> str:
    """The traceback as summary.md shows it: each fold as its one line."""
    return "\n".join(segment.shown_text for segment in shown(text)) + ("\n" if text.endswith("\n") else "")
