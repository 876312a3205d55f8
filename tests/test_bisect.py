"""Bisection: the candidate list, the search, and bad input."""

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from matrix.releases import bisection as bisect
from matrix.releases.bisection import BisectError, first_change, parse_index_listing, versions_between

LISTING = (
    "transformers (5.23.0)\n"
    "Available versions: 4.51.3, 4.51.0, 4.50.3, 4.50.2, 4.50.1, 4.50.0, 4.49.0, 4.51.0rc1, 4.5.1"
)


def test_index_listing_is_parsed():
    assert parse_index_listing(LISTING)[:3] == ["4.51.3", "4.51.0", "4.50.3"]
    with pytest.raises(BisectError):
        parse_index_listing("ERROR: No matching distribution found")


def test_candidates_are_releases_between_the_ends_in_version_order():
    listed = parse_index_listing(LISTING)
    expected = ["4.50.0", "4.50.1", "4.50.2", "4.50.3", "4.51.0"]
    assert versions_between(listed, "4.50.0", "4.51.0") == expected
    assert versions_between(listed, "4.51.0", "4.50.0") == expected  # either order: breaking or fixing
    # numeric, not string, order: 4.5.1 is far older than 4.50.0 and left out
    assert "4.5.1" not in versions_between(listed, "4.49.0", "4.51.3")
    assert "4.51.0rc1" not in versions_between(listed, "4.49.0", "4.51.3")  # no pre-releases


def test_an_end_the_index_does_not_list_is_refused():
    with pytest.raises(BisectError, match=r"4\.50\.9 is not a released version"):
        versions_between(parse_index_listing(LISTING), "4.50.9", "4.51.0")


@given(st.integers(min_value=2, max_value=60), st.data())
def test_the_search_finds_the_first_changed_version_with_few_trials(count, data):
    versions = [f"1.{i}.0" for i in range(count)]
    change = data.draw(st.integers(min_value=1, max_value=count - 1))
    fixing = data.draw(st.booleans())
    tried = []

    def state_of(version):
        tried.append(version)
        after = versions.index(version) >= change
        return ("passed" if after else "failed sig-1") if fixing else ("failed sig-1" if after else "passed")

    found, before, after = first_change(versions, state_of)
    assert found == versions[change]
    assert before != after
    assert len(set(tried)) <= 2 + (count - 1).bit_length()  # ends + a binary search


def test_a_signature_change_counts_as_a_change():
    versions = ["1.0", "1.1", "1.2"]
    states = {"1.0": "failed sig-a", "1.1": "failed sig-a", "1.2": "failed sig-b"}
    assert first_change(versions, states.__getitem__) == ("1.2", "failed sig-a", "failed sig-b")


def test_same_result_at_both_ends_is_refused():
    with pytest.raises(BisectError, match="nothing to bisect"):
        first_change(["1.0", "1.1"], lambda version: "passed")


def test_bad_input_is_one_line_and_exit_status_2():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "matrix",
            "bisect",
            "--package",
            "transformers",
            "--good",
            "4.51.0",
            "--bad",
            "4.50.0",
            "--cell",
            "gemma-cache-bf16-loaded-mixed-eval-cpu-accelerate",
            "--stack",
            "no-such-stack",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    from matrix.releases import stacks

    known = ", ".join(stacks.load())
    assert known.startswith("default, seed-001-gemma3-hybridcache, liger, seed-002-liger-flce")
    assert done.stderr.strip().splitlines() == [
        f"python -m matrix bisect: --stack: unknown stack 'no-such-stack'; known: {known}"
    ]


def test_two_bisections_of_one_stack_take_its_scratch_environment_in_turn(tmp_path, monkeypatch):
    """Concurrent bisections of the same stack would install candidates into one venv under each
    other's cells: the second waits, saying why, until the first is done."""
    import threading

    from matrix.releases import stacks

    monkeypatch.setattr(bisect, "SCRATCH", tmp_path)
    stack = stacks.Stack("some-stack", "a stack", ("accelerate==1.13.0",), (), ())
    first, second = bisect.ScratchEnvironment(stack, "torch"), bisect.ScratchEnvironment(stack, "torch")
    said, order = [], []

    def later():
        with second.held(said.append):
            order.append("second")

    with first.held(said.append):
        waiting = threading.Thread(target=later)
        waiting.start()
        waiting.join(timeout=1.0)
        assert waiting.is_alive() and order == []  # blocked while the first holds it
        order.append("first")
    waiting.join(timeout=10.0)
    assert order == ["first", "second"]
    assert said == [f"waiting: another bisection is using the scratch environment {tmp_path / 'some-stack'}"]


def test_a_bisection_whose_cell_skips_decides_nothing_and_says_why(tmp_path, monkeypatch):
    """For real, cheaply: this environment (the release already installed: a no-op install), a cell
    that skips here for want of a GPU. The bisection stops at the first release with NothingRan,
    naming the release and the skip's reason (python -m matrix bisect exits 4 on it)."""
    from importlib.metadata import version as installed

    import torch

    from matrix.releases import stacks

    if torch.cuda.is_available():
        pytest.skip("Requires: [no CUDA device] (the cell must skip: it runs here)")
    monkeypatch.setattr(bisect, "SCRATCH", tmp_path)
    env = bisect.CurrentEnvironment(stacks.load()["default"])
    now = installed("safetensors")
    monkeypatch.setattr(env, "released_versions", lambda package: [now, "999.0"])
    cell = "tiny-llama-fp32-eval-cuda-torch"
    with pytest.raises(bisect.NothingRan) as info:
        bisect._bisect_in(env, "safetensors", now, "999.0", cell, "default", stacks.load(), tmp_path, [], print)
    message = str(info.value)
    assert message.startswith(f"nothing ran in safetensors=={now}: the cell skipped: Requires: [CUDA device]"), message
    assert message.endswith("the bisection decides nothing")
    assert installed("safetensors") == now
