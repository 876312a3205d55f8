"""Hermetic cells (matrix/harness/global_state.py): a cell that changes process-global state is named for
it, setting by setting with the phase that did it, the state is put back before the next cell,
and the cells keep the verdicts they have alone whatever order they run in (--order-seed).
"""

import contextlib
import json
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_compare import cell, document

from matrix.harness import global_state
from matrix.plugin.parametrize import in_seeded_order
from matrix.results import compare
from matrix.results.html import html_report
from matrix.results.markdown import summary_markdown

LEAKER, READER = "user-onednn-bf16-fp32-eval-cpu-torch", "user-precision-aware-fp32-eval-cpu-torch"
# the same kinds under DDP: the model is built in the ranks, which the next cell's DDP reuses
RANK_LEAKER, RANK_READER = "user-onednn-bf16-fp32-eval-cpu-ddp", "user-precision-aware-fp32-eval-cpu-ddp"
ENUMERATED = [LEAKER, READER, RANK_LEAKER, RANK_READER]  # the selection's order (engine by engine)
SELECTION = ("-p", "user_global_settings", "--model", "user-onednn-bf16,user-precision-aware")
SELECTION += ("--precision", "fp32", "--mode", "eval", "--engine", "torch,ddp")


@contextlib.contextmanager
def put_back():
    """The test changes global settings itself: whatever it leaves is put back after it."""
    before = global_state.snapshot()
    try:
        yield
    finally:
        global_state.restore(before)


@pytest.fixture
def watched_process():
    with put_back():
        yield


def legacy_reading():
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError as error:
        assert global_state.MIXED_API_MESSAGE in str(error)
        return "refused"


# writes a library makes to the two fp32 precision APIs, legacy and per-backend
WRITES = st.one_of(
    st.tuples(st.just("legacy"), st.sampled_from(["highest", "high", "medium"])),
    st.tuples(st.just("backends.cuda.matmul.allow_tf32"), st.booleans()),
    st.tuples(st.just("backends.cuda.matmul.fp32_precision"), st.sampled_from(["none", "ieee", "tf32"])),
    st.tuples(st.just("backends.mkldnn.matmul.fp32_precision"), st.sampled_from(["none", "ieee", "bf16", "tf32"])),
    st.tuples(st.just("backends.cudnn.conv.fp32_precision"), st.sampled_from(["ieee", "tf32"])),
    st.tuples(st.just("backends.fp32_precision"), st.sampled_from(["none", "ieee", "tf32"])),
)


def write(path: str, value) -> None:
    if path == "legacy":
        torch.set_float32_matmul_precision(value)
        return
    owner, _, leaf = path.rpartition(".")
    target = torch
    for part in owner.split("."):
        target = getattr(target, part)
    setattr(target, leaf, value)


@given(st.lists(WRITES, max_size=4), st.lists(WRITES, min_size=1, max_size=4))
def test_mixed_fp32_precision_state_is_put_back_whatever_the_cell_wrote(before, during):
    """Whatever state the cell found (the two APIs mixed or not) and wrote, the harness puts back
    every per-backend field and the legacy getter's answer (or its refusal) as they were."""
    with put_back():
        check_put_back(before, during)


def check_put_back(before, during):
    for path, value in before:
        write(path, value)
    found, legacy = global_state.snapshot(reported_only=True), legacy_reading()
    watch = global_state.Watch()
    for path, value in during:
        write(path, value)
    leaks = watch.close("train_steps")
    assert global_state.changed(found, global_state.snapshot(reported_only=True)) == []
    assert legacy_reading() == legacy
    assert all(leak.restored and leak.phase == "train_steps" for leak in leaks)


def test_the_legacy_setter_goes_first_then_the_per_backend_fields(watched_process):
    """A process as torch starts it (per-backend fields 'none', legacy 'highest') and a cell that
    calls torch.set_float32_matmul_precision('high'), as users of Lightning are told to: put back
    legacy first, the per-backend fields end 'none' as they were; the other way round, the legacy
    setter's 'highest' would leave them 'ieee', a state the process never had."""
    for backend in (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul):
        backend.fp32_precision = "none"
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.fp32_precision = torch.backends.mkldnn.matmul.fp32_precision = "none"
    watch = global_state.Watch()
    torch.set_float32_matmul_precision("high")
    leaks = {leak.setting: leak for leak in watch.close()}
    assert torch.backends.cuda.matmul.fp32_precision == torch.backends.mkldnn.matmul.fp32_precision == "none"
    assert torch.get_float32_matmul_precision() == "highest"
    legacy = leaks["torch.get_float32_matmul_precision()"]
    assert (legacy.before, legacy.after) == ("'highest'", "'high'")
    assert leaks["torch.backends.cuda.matmul.fp32_precision"].after == "'tf32'"


def test_each_change_is_named_with_the_phase_that_left_it(watched_process, monkeypatch):
    monkeypatch.delenv("MATRIX_HERMETIC_TEST", raising=False)
    watch = global_state.Watch()
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    watch.checkpoint("kind_setup")
    os.environ["MATRIX_HERMETIC_TEST"] = "1"
    torch.set_default_dtype(torch.float64)
    watch.checkpoint("train_steps")
    torch.set_default_dtype(torch.float32)  # put back by the cell itself: no finding
    torch.manual_seed(3)  # random numbers are every cell's to draw: put back, not a finding
    watch.checkpoint("checkpoint_save")
    torch.set_grad_enabled(False)
    leaks = [(leak.setting, leak.before, leak.after, leak.phase) for leak in watch.close()]
    assert leaks == [
        ("torch.get_float32_matmul_precision()", "'highest'", global_state.REFUSED, "kind_setup"),
        ("torch.backends.mkldnn.matmul.fp32_precision", "'none'", "'bf16'", "kind_setup"),
        ("torch.is_grad_enabled()", "True", "False", "cleanup"),
        ("os.environ['MATRIX_HERMETIC_TEST']", global_state.UNSET, "'1'", "train_steps"),
    ]
    assert torch.get_float32_matmul_precision() == "highest" and torch.is_grad_enabled()
    assert "MATRIX_HERMETIC_TEST" not in os.environ
    assert watch.close() == []  # closed once


def test_compile_config_entries_are_named_and_put_back(watched_process):
    import torch._dynamo  # its config module

    config = torch._dynamo.config
    limit = config.recompile_limit
    watch = global_state.Watch()
    config.recompile_limit = limit + 5
    leaks = watch.close("train_steps")
    assert [(leak.setting, leak.before, leak.after) for leak in leaks] == [
        ("torch._dynamo.config.recompile_limit", global_state.DEFAULT, repr(limit + 5))
    ]
    assert config.recompile_limit == limit and config._is_default("recompile_limit")


def test_a_config_entry_is_attributed_to_the_phase_that_set_it(watched_process):
    """Between checkpoints a config is read again only when its hash moved: an entry the hash
    covers (Inductor's max_autotune) is attributed to its phase."""
    import torch._inductor.config as inductor

    watch = global_state.Watch()
    watch.checkpoint("train_steps")  # nothing changed: the entries are not read again
    inductor.max_autotune = not inductor.max_autotune
    watch.checkpoint("evaluate")
    watch.checkpoint("checkpoint_save")
    leaks = [(leak.setting, leak.phase, leak.restored) for leak in watch.close()]
    assert leaks == [("torch._inductor.config.max_autotune", "evaluate", True)]


def test_the_order_seed_is_a_whole_number():
    from matrix.run import options

    assert options.checked("matrix_order_seed", "12") == 12
    with pytest.raises(options.OptionError, match="--order-seed: 'night' is not a whole number"):
        options.checked("matrix_order_seed", "night")


def test_the_order_seed_shuffles_the_same_way_in_every_process():
    cells = list(range(20))
    assert in_seeded_order(cells, None) == cells
    assert in_seeded_order(cells, 7) == in_seeded_order(cells, 7) != cells
    assert sorted(in_seeded_order(cells, 7)) == cells
    assert in_seeded_order(cells, 7) != in_seeded_order(cells, 8)


def order_of(report_dir, run_id) -> list[str]:
    events = [json.loads(line) for line in (report_dir / run_id / "cells.jsonl").read_text().splitlines()]
    return [e["cell"] for e in events if e["event"] == "start"]


@pytest.fixture(scope="module")
def two_orders(tmp_path_factory):
    """The two kinds of tests/plugins/user_global_settings.py under torch and DDP, run by python -m
    matrix run under two seeds: one that runs the leaking kind's cells before the reader's, one
    that runs the reader's first (each alone in its process so far: its verdict alone)."""
    from conftest import run_matrix_cpu

    def leakers_first(order):
        return max(order.index(LEAKER), order.index(RANK_LEAKER)) < min(order.index(READER), order.index(RANK_READER))

    def readers_first(order):
        return max(order.index(READER), order.index(RANK_READER)) < min(order.index(LEAKER), order.index(RANK_LEAKER))

    report_dir = tmp_path_factory.mktemp("orders")
    runs = {}
    for wanted in (leakers_first, readers_first):
        seed = next(s for s in range(1000) if wanted(in_seeded_order(ENUMERATED, s)))
        run_id = f"seed-{seed}"
        done, results = run_matrix_cpu(report_dir, *SELECTION, "--order-seed", str(seed), run_id=run_id)
        assert order_of(report_dir, run_id) == in_seeded_order(ENUMERATED, seed), done.stdout[-3000:]
        runs[wanted.__name__] = (done, results, report_dir / run_id)
    return runs


def verdicts(results: dict) -> dict:
    return {c["id"]: (c["outcome"], (c["signature"] or {}).get("id")) for c in results["cells"]}


def test_two_order_seeds_give_identical_verdicts(two_orders):
    (first, one, _), (second, other, _) = two_orders.values()
    assert verdicts(one) == verdicts(other) == {cell_id: ("passed", None) for cell_id in ENUMERATED}
    assert first.returncode == second.returncode == 0
    for results in (one, other):
        assert results["run"]["order_seed"] == int(results["run"]["id"].removeprefix("seed-"))


def test_the_leaking_kind_is_named_and_the_reader_after_it_is_not(two_orders):
    """The leaking kind's cells are named with what they changed: in this process, in the kind's
    one-time work (its first model is built there), and in each rank, where the DDP cell builds
    its model; in both orders. The reader's cells after them left nothing and passed."""
    matmul = "torch.backends.mkldnn.matmul.fp32_precision"
    legacy = "torch.get_float32_matmul_precision()"
    for _, results, directory in two_orders.values():
        cells = {c["id"]: c for c in results["cells"]}
        order = order_of(directory.parent, directory.name)
        # the kind's one-time work builds a model before the kind's first cell; after it, the torch
        # cell builds its own in evaluate
        first = order.index(LEAKER) < order.index(RANK_LEAKER)
        leaks = {leak["setting"]: leak for leak in cells[LEAKER]["leaked_state"]}
        assert set(leaks) == {matmul, legacy}
        found = leaks[matmul]
        assert (found["before"], found["after"], found["phase"], found["restored"]) == (
            "'none'",
            "'bf16'",
            "kind_setup" if first else "evaluate",
            True,
        )
        assert leaks[legacy]["after"] == global_state.REFUSED
        in_ranks = {(leak["setting"], leak["phase"]) for leak in cells[RANK_LEAKER]["leaked_state"]}
        assert {(f"rank {rank}: {matmul}", "evaluate") for rank in (0, 1)} <= in_ranks
        assert cells[READER]["leaked_state"] == cells[RANK_READER]["leaked_state"] == []
        summary = (directory / "summary.md").read_text()
        section = summary.split("## Left global state changed (put back before the next cell)")[1]
        assert f"`{LEAKER}` (passed): 'none' -> 'bf16' in `{found['phase']}`" in section
        assert READER not in section and RANK_READER not in section
        assert f"shuffled by `--order-seed {results['run']['order_seed']}`" in summary
        assert 'id="leaked-state"' in (directory / "index.html").read_text()


# ------------------------------------------------------------------ reports and diff


def leaking(record: dict, restored: bool) -> dict:
    leak = {"setting": "torch.backends.cuda.matmul.fp32_precision", "before": "'none'", "after": "'tf32'"}
    return {**record, "leaked_state": [{**leak, "phase": "train_steps", "restored": restored}]}


def seeded(doc: dict, seed) -> dict:
    return {**doc, "run": {**doc["run"], "order_seed": seed}}


def test_a_changed_verdict_between_orders_with_a_leak_left_behind_is_an_order_flip():
    old = seeded(document(cell("a", "passed"), leaking(cell("b", "passed"), restored=False), run_id="old"), 1)
    new = seeded(document(cell("a", "failed", "legacy getter refused"), cell("b", "passed"), run_id="new"), 2)
    result = compare.diff(old, new)
    assert [i["cell"].split("-bf16")[0] for i in result.changes["order-flip"]] == ["a"]
    assert result.changes["new"] == [] and result.gating(compare.DEFAULT_FAIL_ON) == {}
    flip = result.changes["order-flip"][0]
    assert flip["leaking"] == [
        {"run": "old", "cell": "b-bf16-mixed-eval-cpu-torch", "settings": ["torch.backends.cuda.matmul.fp32_precision"]}
    ]
    text = compare.diff_markdown(result)
    assert "## Order flips" in text and "old `b-bf16-mixed-eval-cpu-torch`" in text
    assert "| cell order | --order-seed 1 | --order-seed 2 |" in text


@pytest.mark.parametrize(
    "seeds, restored",
    [((1, 1), False), ((1, 2), True)],
    ids=["same-order", "leak-put-back"],
)
def test_without_an_order_change_or_a_leak_left_behind_it_is_a_regression(seeds, restored):
    old = seeded(document(cell("a", "passed"), leaking(cell("b", "passed"), restored), run_id="old"), seeds[0])
    new = seeded(document(cell("a", "failed", "legacy getter refused"), cell("b", "passed"), run_id="new"), seeds[1])
    result = compare.diff(old, new)
    assert result.changes["order-flip"] == [] and len(result.changes["new"]) == 1
    assert result.changes["new"][0].get("order_differs", False) == (seeds[0] != seeds[1])


def test_reports_show_the_leak_as_its_cells_own():
    import jsonschema
    from test_report import SCHEMA

    doc = seeded(document(cell("a", "passed"), leaking(cell("b", "failed", "fast path"), restored=False)), 5)
    jsonschema.validate(doc, SCHEMA)
    summary = summary_markdown(doc)
    assert "- **1 cell** left global state changed" in summary
    section = summary.split("## Left global state changed (put back before the next cell)")[1]
    line = "`b-bf16-mixed-eval-cpu-torch` (failed): 'none' -> 'tf32' in `train_steps` **(could not be put back)**"
    assert line in section
    assert "a-bf16-mixed-eval-cpu-torch" not in section
    page = html_report(doc)
    assert 'id="leaked-state"' in page and "left global state changed" in page and "--order-seed 5" in page


def test_a_rank_s_leaks_go_to_the_cell_s_watch_in_this_process(watched_process):
    """What a rank put back and reported (matrix/engines/distributed.py end_cell) is the cell's,
    named with the rank, beside this process's own; nested watches close innermost first."""
    outer = global_state.Watch()
    inner = global_state.Watch()
    leak = {"setting": "torch.get_default_dtype()", "before": "torch.float32", "after": "torch.float64"}
    global_state.left_in_another_process("rank 1", [{**leak, "phase": "train_steps", "restored": True}])
    assert [(x.setting, x.phase) for x in inner.close()] == [("rank 1: torch.get_default_dtype()", "train_steps")]
    assert outer.close() == []
