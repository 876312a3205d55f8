"""What a record keeps of a stack or a traceback (standard library only): one condense() for
a crash's faulthandler dump, a cell's Python traceback, pytest's failure text and
pytest-timeout's stacks alike.

A faulthandler dump reads, top to bottom: the fatal error ("Fatal Python error: Segmentation
fault"), one block per thread (each "most recent call first", so a block's first frames are
where that thread was), and last a list of the loaded extension modules. On a big
environment that list alone runs to thousands of characters (182 modules on the GPU image),
so keeping a dump's tail keeps the list and loses the stack. condense() keeps the fatal
line and the crashing thread's stack first, then the other threads while they fit, and
shortens the module list to its count.

Everything else is "most recent call last" (a Python traceback, pytest's, pytest-timeout's):
its first lines say what ran (the outermost frames: the harness's phase, the engine), its last
lines where it broke (the innermost frames and the exception). A long one keeps both ends and
leaves out the middle, with a line saying how many lines are missing. A chained traceback
("The above exception was the direct cause ...", "During handling of the above exception
...") and a rank's traceback appended to the driver's ("raised in the rank as:") are parts of
their own: each keeps its innermost frame and exception lines, where the cause often is.
"""

from __future__ import annotations

import re
from pathlib import Path

RECORD_LIMIT = 6000  # characters of stacks a crash or timeout record's message keeps
# Characters of traceback a record keeps (CellRecord.traceback). The failing cells measured on
# the CPU grid (torch 2.13.0, every engine) have tracebacks of 600 to 5 700 characters, the
# longest 86 lines (Lightning's validate() down to torch's encoder fast path; a ddp rank's,
# appended to the driver's, 2 300): they stay whole, with room for a GPU run's longer library
# stacks and chains. Only the pathological ones are condensed (a compiler's generated code in
# a message, a chain of whole library stacks), and 2 500 failing cells at the limit add 40 MB.
TRACEBACK_LIMIT = 16_000
FATAL = "Fatal Python error"
MODULES = "Extension modules:"
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+ .*\(most recent call first\):$")
_TOTAL = re.compile(r"\(total: (\d+)\)\s*$")
# Lines that start a part of a traceback of its own: Python's chaining, and a rank's traceback
# appended to the driver's (matrix/execute/cell_run.py).
CHAIN_LINES = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
    "raised in the rank as:",
)
TRACEBACK_HEADER = "Traceback (most recent call last):"
_FRAME = re.compile(r'^\s*File "')
# Lines a part's end grows by for each line its start grows by: the innermost frames say
# more than the outermost, and the last part (the exception raised) more than its causes.
_GROWTH = {"last": (1, 3), "earlier": (1, 2)}  # part -> (head lines, tail lines) per round


def is_faulthandler_dump(text: str) -> bool:
    return FATAL in text or any(_THREAD.match(line) for line in text.splitlines())


def _blocks(text: str) -> tuple[list[str], list[list[str]], list[str], list[str]]:
    """(header lines, thread blocks with the current thread first, module lines, other lines)."""
    header: list[str] = []
    threads: list[list[str]] = []
    modules: list[str] = []
    other: list[str] = []
    block: list[str] | None = None
    for line in text.splitlines():
        if _THREAD.match(line):
            block = [line]
            threads.append(block)
        elif line.startswith(MODULES):
            block = None
            modules.append(line)
        elif block is not None and line.startswith("  "):
            block.append(line)
        elif line.strip():
            block = None
            (header if not threads else other).append(line)
    threads.sort(key=lambda lines: not lines[0].startswith("Current thread"))  # stable: dump order otherwise
    return header, threads, modules, other


def _module_summary(line: str) -> str:
    total = _TOTAL.search(line)
    count = total.group(1) if total else str(len(line[len(MODULES) :].split(",")))
    return f"{MODULES} {count} loaded (list left out of the record)"


def condense(text: str, limit: int = RECORD_LIMIT) -> str:
    """At most `limit` characters of `text` that keep what a record exists to keep: a
    faulthandler dump's fatal line and crashing thread, a traceback's ends (condense_traceback)."""
    if not is_faulthandler_dump(text):
        return condense_traceback(text, limit)
    header, threads, modules, other = _blocks(text)
    tail = [_module_summary(line) for line in modules] + other
    out = header[:]
    budget = limit - len("\n".join(out + tail)) - 2
    for index, block in enumerate(threads):
        cost = len("\n".join(block)) + 1
        if cost <= budget:
            out += block
            budget -= cost
            continue
        if index == 0:  # the crashing thread: its innermost frames come first, keep as many as fit
            kept = [block[0]]
            budget -= len(block[0]) + 1
            for frame in block[1:]:
                if len(frame) + 1 > budget - 40:
                    break
                kept.append(frame)
                budget -= len(frame) + 1
            kept.append(f"  ... ({len(block) - len(kept)} more frames left out)")
            out += kept
        left = len(threads) - index - (index == 0)
        if left:
            out.append(f"({left} more thread stacks left out)")
        break
    return "\n".join(out + tail)[:limit]


def left_out(count: int) -> str:
    """The line that stands where `count` lines of a traceback were left out."""
    return f"  ... ({count} lines left out) ..."


def _parts(lines: list[str]) -> list[tuple[int, int]]:
    """(start, end) of each part of a chained traceback; a part starts at the blank lines
    before its chain line."""
    starts = [0]
    for n, line in enumerate(lines):
        if n and line.strip() in CHAIN_LINES:
            start = n
            while start - 1 > starts[-1] and not lines[start - 1].strip():
                start -= 1
            if start > starts[-1]:
                starts.append(start)
    return list(zip(starts, [*starts[1:], len(lines)], strict=True))


def _part_minimum(lines: list[str]) -> tuple[int, int]:
    """How many of a part's first and last lines it always keeps: through its "Traceback (most
    recent call last):" line, and from its innermost frame on (the frame and the exception)."""
    head = 1
    for n, line in enumerate(lines[:4]):
        if line.strip() in CHAIN_LINES or line.strip() == TRACEBACK_HEADER:
            head = n + 1
    frames = [n for n, line in enumerate(lines) if n >= head and _FRAME.match(line)]
    tail = len(lines) - frames[-1] if frames else 1
    head = min(head, len(lines))
    return head, min(tail, len(lines) - head)


def condense_traceback(text: str, limit: int = TRACEBACK_LIMIT) -> str:
    """At most `limit` characters of a most-recent-call-last traceback (`text` itself when it
    fits): its first lines and, of each chained part, the innermost frames and exception, the
    middle left out (left_out() says how many lines)."""
    if len(text) <= limit:
        return text
    newline = "\n" if text.endswith("\n") else ""
    lines = text[: len(text) - len(newline)].split("\n")
    parts = [lines[start:end] for start, end in _parts(lines)]
    kept = [list(_part_minimum(part)) for part in parts]  # per part: [head lines, tail lines]
    marker_cost = len(left_out(len(lines))) + 1  # at most, per part with a gap
    used = len(newline) - 1  # each kept line costs its length and a newline; the last has none
    for part, (head, tail) in zip(parts, kept, strict=True):
        used += sum(len(line) + 1 for line in part[:head] + part[len(part) - tail :])
        used += marker_cost if head + tail < len(part) else 0
    if used > limit:  # the exception lines alone do not fit: the first line, then the end
        return _cut(text, lines, limit, newline)
    growing = True
    while growing:  # round by round, every part's ends grow inwards while the budget lasts
        growing = False
        for index in reversed(range(len(parts))):
            part, ends = parts[index], kept[index]
            for side, lines_per_round in enumerate(_GROWTH["last" if index == len(parts) - 1 else "earlier"]):
                for _ in range(lines_per_round):
                    if ends[0] + ends[1] >= len(part):
                        break
                    line = part[ends[0]] if side == 0 else part[len(part) - ends[1] - 1]
                    if used + len(line) + 1 > limit:
                        break
                    used += len(line) + 1
                    ends[side] += 1
                    growing = True
    out: list[str] = []
    for part, (head, tail) in zip(parts, kept, strict=True):
        out += part[:head]
        if head + tail < len(part):
            out.append(left_out(len(part) - head - tail))
        out += part[len(part) - tail :]
    return "\n".join(out) + newline


def _cut(text: str, lines: list[str], limit: int, newline: str) -> str:
    """The first line and as much of the end as fits: for a traceback whose exception lines
    alone run past the limit. The marker counts lines, or characters where a line is cut."""
    first = lines[0][: limit // 4]
    marker = f"  ... ({len(text)} characters left out) ..."  # longer than any marker below
    room = limit - len(first) - len(marker) - 2
    if room <= 0:
        return text[-limit:]
    end = text[-room:]
    if "\n" in end[:-1]:
        end = end[end.index("\n") + 1 :]  # whole lines
    whole = first == lines[0] and text[: len(text) - len(end)].endswith("\n")
    if whole:
        missing = len(lines) - 1 - (end[: len(end) - len(newline)].count("\n") + 1)
        return f"{first}\n{left_out(missing)}\n{end}"
    return f"{first}\n  ... ({len(text) - len(first) - len(end)} characters left out) ...\n{end}"


def crash_origin(stacks: str) -> str:
    """The innermost frame of the thread that crashed, in a faulthandler dump, as module:function;
    in a Python traceback (pytest's internal error), its last frame."""
    lines = stacks.splitlines()
    if not is_faulthandler_dump(stacks):
        lines = lines[::-1]  # most recent call last
    current = next((n for n, line in enumerate(lines) if line.startswith("Current thread")), 0)
    for line in lines[current:]:
        line = line.strip()
        if line.startswith('File "') and " in " in line:
            path, function = Path(line[len('File "') :].split('"', 1)[0]), line.rsplit(" in ", 1)[1]
            parts = path.with_suffix("").parts
            packages = [n for n, part in enumerate(parts) if part in ("site-packages", "dist-packages")]
            if packages:
                module = ".".join(parts[packages[-1] + 1 :])
            else:  # the standard library or a file of one's own: the file (its package for __init__)
                module = parts[-2] if parts[-1] == "__init__" and len(parts) > 1 else parts[-1]
            return f"{module.removesuffix('.__init__')}:{function}"
    return "<process>"
