"""Failure signatures: the same bug gives the same id on any machine, different bugs differ.

A signature is (phase, exception type, normalized message, origin). The message loses what
varies between runs and machines (addresses, ids, sizes and shapes, paths, line numbers,
numbers) and keeps what names the bug (words, dtype names such as BFloat16 or c10::Half).
The origin is the innermost traceback frame inside the stack under test (torch,
transformers, peft, ...), as module:function; failures raised by the matrix's own checks
fall back to the innermost frame.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

from matrix.grid.packages import ORIGIN_MODULES
from matrix.results.module_moves import signature_name

MAX_MESSAGE_CHARS = 300


def _sorted_set(match: re.Match) -> str:
    """A set as Python prints it, in its elements' order: {torch.float32, torch.float16} iterates in the
    order of the dtypes' hashes, which differs from one process to the next."""
    return "{" + ", ".join(sorted(item.strip() for item in match.group(1).split(","))) + "}"


_NORMALIZERS: tuple[tuple[re.Pattern, str | Callable[[re.Match], str]], ...] = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"\b0x[0-9a-fA-F]+\b", "<addr>"),  # object addresses
        (r"\bat <addr>", "at <addr>"),
        (r"(?:[A-Za-z]:)?(?:[\\/][\w.\-+@~]+){2,}[\\/]?", "<path>"),  # paths, posix or windows
        (r"\bline \d+", "line <n>"),
        (r"torch\.Size\(\[[^\]]*\]\)", "<shape>"),
        (r"\[\s*-?\d+(?:\s*,\s*-?\d+)*\s*,?\s*\]", "<shape>"),  # [2, 8, 32]
        (r"\(\s*-?\d+(?:\s*,\s*-?\d+)+\s*,?\s*\)", "<shape>"),  # (2, 8)
        (r"\b\d+(?:x\d+)+\b", "<shape>"),  # 16x32
        (r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\w.])", "<n>"),  # numbers
        (r"\bid[= ]<n>", "id=<n>"),
        (r"\{([^{}:'\"]+,[^{}:'\"]+)\}", _sorted_set),  # a set's elements, whatever their order
        (r"\s+", " "),
    )
)


# What passes through a cell's except clauses: the interpreter's own exits and interrupts. Any
# other BaseException a library raises is the cell's failure, recorded as an Exception is:
# torch.distributed.checkpoint's CheckpointException derives from BaseException, and a rank that
# let it through died instead of answering (issue 47: the every-engine sweep's sig-53732297)
PASSES_THROUGH = (KeyboardInterrupt, SystemExit, GeneratorExit)


def is_failure(exc: BaseException) -> bool:
    """Whether `exc`, caught as a BaseException, is a failure to record: any Exception, and any other
    BaseException but an exit, an interrupt or one of pytest's outcomes (pytest-timeout stops a
    cell by raising pytest's Failed in it, which pytest must see)."""
    if isinstance(exc, Exception):
        return True
    outcomes = sys.modules.get("_pytest.outcomes")  # pytest is not imported where nothing runs under it
    if outcomes is not None and isinstance(exc, outcomes.OutcomeException):
        return False
    return not isinstance(exc, PASSES_THROUGH)


def message_of(exc: BaseException) -> str:
    """The message a signature is computed from: str(exc); for a failure whose message carries the
    tracebacks of the failures it gathered (DCP's CheckpointException holds every rank's), its own
    first line and the innermost error's line, which name what failed without the frames."""
    message = str(exc) or (str(exc.args[0]) if exc.args else "")
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) > 2 and any(line.startswith("Traceback (most recent call last)") for line in lines):
        return f"{lines[0]}: {lines[-1]}"
    return message


def normalize_message(message: str) -> str:
    text = message
    for pattern, replacement in _NORMALIZERS:
        text = pattern.sub(replacement, text)
    text = text.strip()
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[:MAX_MESSAGE_CHARS] + "..."
    return text


def frame_module(frame) -> str:
    return frame.f_globals.get("__name__") or "<unknown>"


def origin_of(exc: BaseException) -> str:
    """Innermost frame in the stack under test as module:function, else the innermost frame.

    A failure raised by the matrix's own checks keeps the check as its origin, even when a
    library called the check (a Trainer or Lightning callback): the same check failing gives
    the same signature under every engine.
    """
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    if not frames:
        return "<no traceback>"
    if frame_module(frames[-1]).split(".")[0] == "matrix":
        frame = frames[-1]
    else:
        in_stack = [f for f in frames if frame_module(f).split(".")[0] in ORIGIN_MODULES]
        frame = (in_stack or frames)[-1]
    return f"{signature_name(frame_module(frame))}:{frame.f_code.co_name}"


def exception_type(exc: BaseException) -> str:
    cls = type(exc)
    return cls.__name__ if cls.__module__ == "builtins" else f"{signature_name(cls.__module__)}.{cls.__qualname__}"


@dataclass(frozen=True)
class Signature:
    phase: str
    exc_type: str
    message: str  # normalized
    origin: str

    @property
    def text(self) -> str:
        return f"{self.phase}: {self.exc_type}: {self.message} @ {self.origin}"

    @property
    def id(self) -> str:
        return "sig-" + hashlib.sha1(self.text.encode()).hexdigest()[:8]

    def as_dict(self) -> dict[str, str]:
        return {
            "id": self.id,
            "text": self.text,
            "phase": self.phase,
            "exception": self.exc_type,
            "message": self.message,
            "origin": self.origin,
        }


def signature_of(phase: str, exc: BaseException) -> Signature:
    remote = getattr(exc, "remote_signature", None)
    if remote is not None:  # raised in another process (a rank), whose traceback gave the origin
        return Signature(phase, remote.exc_type, remote.message, remote.origin)
    return Signature(phase, exception_type(exc), normalize_message(message_of(exc)), origin_of(exc))


def signature_of_crash(phase: str, description: str) -> Signature:
    """A cell whose process died has no exception object: only what pytest/xdist reported."""
    return Signature(phase, "crash", normalize_message(description), "<worker process>")
