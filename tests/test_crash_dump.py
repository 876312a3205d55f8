"""What a crash record keeps of a faulthandler dump: the fatal line and the crashing thread's
stack, whatever the size of the environment (on the GPU image the dump ended in 182
extension modules, and a record that kept the dump's tail lost the stack)."""

import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from matrix.cell import Cell
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
    """pytest-timeout's and pytest's stacks are most-recent-call-last: the end is where it was."""
    text = "Timeout (>2.0s) from pytest-timeout.\n" + "".join(f'  File "x.py", line {n}, in f{n}\n' for n in range(900))
    kept = crash_dump.condense(text)
    assert kept == text[-crash_dump.RECORD_LIMIT :] and kept.endswith("in f899\n")


@given(st.text(max_size=3000), st.integers(min_value=200, max_value=8000))
def test_a_record_never_exceeds_its_limit(text, limit):
    assert len(crash_dump.condense(text, limit)) <= limit
