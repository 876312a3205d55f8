"""What a crash or timeout record keeps of a dead process's stacks (standard library only).

A faulthandler dump reads, top to bottom: the fatal error ("Fatal Python error: Segmentation
fault"), one block per thread (each "most recent call first", so a block's first frames are
where that thread was), and last a list of the loaded extension modules. On a big
environment that list alone runs to thousands of characters (182 modules on the GPU image),
so keeping a dump's tail keeps the list and loses the stack. condense() keeps the fatal
line and the crashing thread's stack first, then the other threads while they fit, and
shortens the module list to its count.

Other stack texts (pytest-timeout's, pytest's tracebacks) are "most recent call last": their
tail is what matters, and condense() keeps that.
"""

from __future__ import annotations

import re
from pathlib import Path

RECORD_LIMIT = 6000  # characters of stacks a record keeps
FATAL = "Fatal Python error"
MODULES = "Extension modules:"
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+ .*\(most recent call first\):$")
_TOTAL = re.compile(r"\(total: (\d+)\)\s*$")


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
    """At most `limit` characters of `text` that keep what a crash record exists to keep."""
    if not is_faulthandler_dump(text):
        return text[-limit:]
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


def crash_origin(stacks: str) -> str:
    """The innermost frame of the thread that crashed, in a faulthandler dump, as module:function."""
    lines = stacks.splitlines()
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
