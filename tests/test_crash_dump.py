"""What a record keeps of a faulthandler dump: the fatal line and the crashing thread's
stack, whatever the size of the environment (on the GPU image the dump ended in 182
extension modules, and a record that kept the dump's tail lost the stack); and of a long
Python traceback: its first lines and, of each chained part, the innermost frames and the
exception."""

import re
import subprocess
import sys
import textwrap
import traceback

import pytest
from hypothesis import given
from hypothesis import strategies as st

from matrix.grid.cell import Cell
from matrix.results import crash_dump, records

# A real faulthandler dump: a crash 150 calls deep, with four other threads alive.
CRASHING_PROGRAM = textwrap.dedent(
    """
    import ctypes, faulthandler, threading, time
    faulthandler.enable(all_threads=True)
    for _ in range(4):
        threading.Thread(target=time.sleep, args=(100,), daemon=True).start()
    def descend(n):
        if n == 0:
            ctypes.string_at(0)
        descend(n - 1)
    descend(150)
    """
)
# What a big environment appends (the GPU image: 182 modules, about 5 000 characters).
BIG_ENVIRONMENT_MODULES = (
    "Extension modules: " + ", ".join(f"package{n}._native.extension_module_{n}" for n in range(182)) + " (total: 182)"
)


@pytest.fixture(scope="module")
def big_dump() -> str:
    done = subprocess.run([sys.executable, "-c", CRASHING_PROGRAM], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "Fatal Python error: Segmentation fault" in done.stderr
    dump = done.stderr.rstrip("\n")
    dump = dump.rsplit("\nExtension modules:", 1)[0]  # this interpreter's own short list, if any
    return dump + "\n\n" + BIG_ENVIRONMENT_MODULES + "\n"


def test_the_dump_is_as_long_as_a_big_environment_writes(big_dump):
    assert len(big_dump) > 2 * crash_dump.RECORD_LIMIT
    assert big_dump[-crash_dump.RECORD_LIMIT :].count("Fatal Python error") == 0  # its tail has no fatal line


def test_the_record_keeps_the_fatal_line_and_the_crashing_stack_and_counts_the_modules(big_dump):
    kept = crash_dump.condense(big_dump)
    assert len(kept) <= crash_dump.RECORD_LIMIT
    lines = kept.splitlines()
    assert lines[0] == "Fatal Python error: Segmentation fault"
    assert lines[1].startswith("Current thread 0x")  # the crashing thread first, whatever the dump's order
    assert "in string_at" in lines[2] and "in descend" in lines[3]  # innermost frames first
    assert "Extension modules: 182 loaded (list left out of the record)" in kept
    assert "extension_module_" not in kept
    assert crash_dump.crash_origin(kept) == crash_dump.crash_origin(big_dump) == "ctypes:string_at"


def test_a_crash_record_built_from_it_says_where_it_died(big_dump):
    record = records.crash_record(
        Cell("tiny-llama", "bf16-true", "train", "cpu"), "killed by SIGSEGV", big_dump, 1.0
    ).as_dict()
    assert record["signature"]["text"] == "crash: ProcessDied: killed by SIGSEGV @ ctypes:string_at"
    assert "Fatal Python error" in record["message"] and "in descend" in record["message"]
    timeout = records.timeout_record(Cell("tiny-llama", "bf16-true", "train", "cpu"), 2.0, big_dump).as_dict()
    assert "Fatal Python error" in timeout["message"] and "in string_at" in timeout["message"]


def test_other_threads_follow_while_they_fit(big_dump):
    roomy = crash_dump.condense(big_dump, limit=100_000)
    assert roomy.count("(most recent call first)") == 5  # the crashing thread and the four others
    tight = crash_dump.condense(big_dump, limit=1500)
    assert len(tight) <= 1500 and tight.startswith("Fatal Python error")
    assert "more frames left out" in tight and "4 more thread stacks left out" in tight


def test_text_that_is_not_a_faulthandler_dump_keeps_its_tail():
    """pytest-timeout's and pytest's stacks are most-recent-call-last: the end is where it was,
    and the first line says what stopped it."""
    text = "Timeout (>2.0s) from pytest-timeout.\n" + "".join(f'  File "x.py", line {n}, in f{n}\n' for n in range(900))
    kept = crash_dump.condense(text)
    assert len(kept) <= crash_dump.RECORD_LIMIT and kept.endswith("in f899\n")
    head, tail = kept.split(" lines left out) ...\n")
    assert head.startswith('Timeout (>2.0s) from pytest-timeout.\n  File "x.py", line 0, in f0\n')
    assert text.endswith(tail) and len(tail) > crash_dump.RECORD_LIMIT / 2  # the end has most of the room


@given(st.text(max_size=3000), st.integers(min_value=200, max_value=8000))
def test_a_record_never_exceeds_its_limit(text, limit):
    assert len(crash_dump.condense(text, limit)) <= limit


# ------------------------------------------------------------------ Python tracebacks


def innermost_raise(message):
    raise ValueError(message)


def ping(n, message):
    """Two functions calling each other: a traceback Python does not fold as a repeated line."""
    return pong(n - 1, message) if n > 0 else innermost_raise(message)


def pong(n, message):
    return ping(n - 1, message)


def raised(function) -> str:
    try:
        function()
    except Exception as exc:  # the traceback as execute._record_failure formats it
        return "".join(traceback.format_exception(exc))
    raise AssertionError("did not raise")


def the_cause():
    ping(400, "the cause: expected float32, got bfloat16")


def raise_from():
    try:
        the_cause()
    except ValueError as cause:
        raise RuntimeError("the engine gave up") from cause


def raise_while_handling():
    try:
        the_cause()
    except ValueError:
        pong(400, "while handling it")


def accounted(kept: str, text: str) -> None:
    """Every kept line is a line of `text`, in order, and the markers count the rest."""
    lines, out = text.rstrip("\n").split("\n"), kept.rstrip("\n").split("\n")
    markers = [re.fullmatch(r"  \.\.\. \((\d+) lines left out\) \.\.\.", line) for line in out]
    rest = iter(lines)
    assert all(line in rest for line, marker in zip(out, markers, strict=True) if not marker)
    assert sum(int(m[1]) for m in markers if m) + sum(not m for m in markers) == len(lines)


def test_a_traceback_that_fits_is_kept_whole():
    text = raised(lambda: ping(3, "short"))
    assert crash_dump.condense_traceback(text) == text == crash_dump.condense(text, crash_dump.TRACEBACK_LIMIT)


def test_a_long_traceback_keeps_its_first_lines_and_its_innermost_frames():
    text = raised(lambda: ping(600, "expected float32, got bfloat16"))
    assert len(text) > 3 * crash_dump.TRACEBACK_LIMIT
    kept = crash_dump.condense_traceback(text)
    assert len(kept) <= crash_dump.TRACEBACK_LIMIT
    lines = kept.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert "in raised" in lines[1] and "in <lambda>" in lines[3]  # the outermost frames
    assert lines[-1] == "ValueError: expected float32, got bfloat16" and kept.endswith("\n")
    assert "in innermost_raise" in lines[-3] and "raise ValueError(message)" in lines[-2]  # where it raised
    assert sum(" lines left out) ..." in line for line in lines) == 1
    assert len(kept) > crash_dump.TRACEBACK_LIMIT - 200  # the room is used
    accounted(kept, text)


@pytest.mark.parametrize(
    ("function", "separator", "last"),
    [
        (
            raise_from,
            "The above exception was the direct cause of the following exception:",
            "RuntimeError: the engine gave up",
        ),
        (
            raise_while_handling,
            "During handling of the above exception, another exception occurred:",
            "ValueError: while handling it",
        ),
    ],
)
def test_a_chained_traceback_keeps_the_innermost_frames_of_each_part(function, separator, last):
    text = raised(function)
    kept = crash_dump.condense_traceback(text)
    assert len(kept) <= crash_dump.TRACEBACK_LIMIT < len(text)
    cause, final = kept.split(f"\n\n{separator}\n\n")
    cause_lines = cause.splitlines()
    assert cause_lines[0] == "Traceback (most recent call last):"
    assert cause_lines[-1] == "ValueError: the cause: expected float32, got bfloat16"
    assert "in innermost_raise" in cause_lines[-3]  # the cause's innermost frame, from the middle of the text
    assert final.startswith("Traceback (most recent call last):\n") and final.rstrip("\n").endswith(last)
    accounted(kept, text)


def test_a_ranks_traceback_appended_to_the_drivers_keeps_both_innermost_frames():
    """execute._record_failure appends a rank's own traceback to the driver's RankFailure."""
    driver = raised(lambda: ping(300, "rank 1 raised TypeError: BF16 hook needs NCCL"))
    rank = raised(lambda: pong(300, "BF16 hook needs NCCL"))
    text = driver + "\nraised in the rank as:\n" + rank
    kept = crash_dump.condense_traceback(text)
    assert len(kept) <= crash_dump.TRACEBACK_LIMIT < len(text)
    mine, theirs = kept.split("\nraised in the rank as:\n")
    assert mine.rstrip("\n").endswith("ValueError: rank 1 raised TypeError: BF16 hook needs NCCL")
    assert theirs.startswith("Traceback (most recent call last):\n")
    assert theirs.splitlines()[-1] == "ValueError: BF16 hook needs NCCL"
    assert "in innermost_raise" in mine.splitlines()[-3] and "in innermost_raise" in theirs.splitlines()[-3]
    accounted(kept, text)


def test_exception_lines_longer_than_the_limit_keep_the_first_line_and_the_end():
    text = raised(lambda: ping(50, "a tensor: " + "\n".join(f"[{n}.0, 0.5]" for n in range(5000))))
    kept = crash_dump.condense_traceback(text, 2000)
    assert len(kept) <= 2000 and kept.startswith("Traceback (most recent call last):\n")
    assert kept.endswith("[4999.0, 0.5]\n")
    accounted(kept, text)


frames = st.lists(st.from_regex(r"[a-z_]{1,30}", fullmatch=True), max_size=300)
exception_line = st.text(
    st.characters(blacklist_characters="\n", blacklist_categories=("Cs",)), min_size=1, max_size=150
)


@st.composite
def tracebacks(draw) -> str:
    """Python's layout: parts, each a header, frames (a File line and its source line) and an
    exception line, joined by chaining lines or a rank's."""
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        lines = ["Traceback (most recent call last):"]
        for name in draw(frames):
            lines += [f'  File "/site-packages/lib/{name}.py", line 12, in {name}', f"    {name}(state)"]
        parts.append("\n".join([*lines, draw(exception_line)]) + "\n")
    text = parts[0]
    for part in parts[1:]:
        text += "\n" + draw(st.sampled_from(crash_dump.CHAIN_LINES)) + "\n\n" + part
    return text


@given(tracebacks(), st.integers(min_value=300, max_value=20_000))
def test_a_condensed_traceback_fits_and_keeps_its_first_and_last_lines(text, limit):
    kept = crash_dump.condense_traceback(text, limit)
    assert len(kept) <= limit
    if len(text) <= limit:
        assert kept == text
    assert kept.split("\n")[0] == "Traceback (most recent call last):"
    assert kept.rstrip("\n").split("\n")[-1] == text.rstrip("\n").split("\n")[-1]  # the exception raised
    accounted(kept, text)
