"""python -m matrix entry-releases (matrix/releases/entry_releases.py): the releases an entry's specifiers
name, the verdicts, the script's failure read as a signature, the page's agreement with the
catalogue, and one entry run on two of its releases where the scratch environment is built."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from matrix.catalogue.entries import load
from matrix.releases.entry_releases import (
    PAGE,
    VERDICTS,
    _same_release,
    install_group,
    masking_entries,
    needs,
    page_markdown,
    plan,
    releases_named,
    seen_signature,
    verdict_of,
)

ROOT = Path(__file__).resolve().parent.parent
LISTED = ["5.16.1", "5.17.0", "5.18.0", "5.20.2", "5.21.0", "5.22.0", "5.23.0rc1", "5.21.0+cpu", "not-a-version"]


@pytest.mark.parametrize(
    ("specifier", "named", "fixed"),
    [
        (">=5.17.0,<5.21.0", ("5.17.0", "5.20.2"), "5.21.0"),
        (">=5.20,<5.21", ("5.20.2",), "5.21.0"),  # 5.21 names the listed 5.21.0
        ("==5.18.0", ("5.18.0",), None),
        ("<5.19", ("5.16.1", "5.18.0"), None),  # 5.19 is no release: no fixed one
        (">5.17.0", ("5.18.0", "5.22.0"), None),  # pre-releases and local builds are left out
        (">=5.24", (), None),
        ("<=5.21.0", ("5.16.1", "5.21.0"), None),  # an inclusive bound names no fixed release
    ],
)
def test_releases_an_entry_names(specifier, named, fixed):
    assert releases_named(specifier, LISTED) == (named, fixed)


versions = st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3)).map(lambda v: ".".join(map(str, v)))


@given(st.lists(versions, min_size=1, max_size=12), versions, versions)
def test_named_releases_are_the_ends_of_what_the_specifier_admits(listed, low, high):
    specifier = SpecifierSet(f">={low},<{high}")
    named, fixed = releases_named(specifier, listed)
    admitted = sorted({Version(v) for v in listed if Version(v) in specifier})
    assert [Version(v) for v in named] == sorted({admitted[0], admitted[-1]}) if admitted else named == ()
    if Version(high) in {Version(v) for v in listed}:
        assert fixed is not None and Version(fixed) == Version(high) and Version(fixed) not in specifier
    else:
        assert fixed is None


@pytest.mark.parametrize(
    ("installed", "release", "same"),
    [("2.13.0+cpu", "2.13.0", True), ("0.50.2", "0.50.2", True), ("5.0", "5.0.0", True), ("2.12.1", "2.13.0", False)],
)
def test_an_installed_local_build_is_the_release_it_builds(installed, release, same):
    assert _same_release(installed, release) is same
    assert not _same_release(None, release)


def _row(role, ran, status, matches):
    return {"role": role, "ran": ran, "exit": status, "matches_entry": matches}


@pytest.mark.parametrize(
    ("row", "verdict"),
    [
        (_row("named", True, 1, True), "shows it"),
        (_row("named", True, 1, False), "differs"),  # a failure, not the entry's
        (_row("named", True, 0, None), "differs"),
        (_row("named", True, 2, False), "differs"),
        (_row("named", True, None, None), "differs"),  # ran past its time
        (_row("fixed", True, 0, None), "fixed there"),
        (_row("fixed", True, 1, True), "differs"),
        (_row("named", False, None, None), "not run here"),
        ({**_row("fixed", True, 1, False), "masked_by": ["another-entry"]}, "another bug first"),
        ({**_row("named", True, 1, False), "masked_by": ["another-entry"]}, "another bug first"),
        ({**_row("named", True, 2, False), "masked_by": ["another-entry"]}, "differs"),  # not the check's exit
    ],
)
def test_verdict_from_the_scripts_exit(row, verdict):
    assert verdict_of(row) == verdict


def test_the_scripts_failure_reads_as_the_matrix_signature_its_entry_matches():
    entries = {e.id: e for e in load().entries}
    traceback = (
        "Traceback (most recent call last):\n"
        '  File "/tmp/x/repro.py", line 10, in evaluate\n'
        '  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1, in _call_impl\n'
        '  File "/venv/lib/python3.11/site-packages/torch/nn/modules/transformer.py", line 2, in forward\n'
        "RuntimeError: expected scalar type Float but found BFloat16\n"
    )
    outcome = {
        "phase": "evaluate",
        "failure": {"name": "RuntimeError", "message": "expected scalar type Float but found BFloat16"},
    }
    seen = seen_signature(outcome, traceback)
    assert seen.endswith("@ torch.nn.modules.transformer:forward"), seen
    assert entries["torch-encoder-fastpath-autocast"].matches(seen)
    check = {"phase": "checkpoint_reload", "failure": {"name": "FrozenParameterThawed", "message": "after reload: "}}
    check["failure"]["message"] += "a parameter the model is created with requires_grad=False is trainable"
    seen = seen_signature(check, "")
    assert seen.startswith("checkpoint_reload: matrix.checks.FrozenParameterThawed: after reload"), seen
    assert entries["from-pretrained-thaws-frozen-parameters"].matches(seen)
    assert not entries["torch-encoder-fastpath-autocast"].matches(seen)
    assert seen_signature({"phase": None, "failure": None}, "") is None


def test_a_failure_another_entry_explains_on_that_release_names_it():
    """bitsandbytes 0.47.0 trains lora's int8 cells (bnb-0.46-cpu-int8-training-goes-nan is fixed
    there), and the same cell's reload of its saved base still differs: another entry, in force
    there. One with a condition on what the cell measured is never named: the script does not
    report it (AdamW's extra step at construction, which ZeRO-1 does not take)."""
    entries = load().entries
    fixed = next(e for e in entries if e.id == "bnb-0.46-cpu-int8-training-goes-nan")
    seen = "checkpoint_reload: matrix.checks.CheckpointMismatch: eval logits over the saved quantized base differ "
    seen += "after reload @ "
    cell = "lora-int8-fp16-mixed-train-cpu-accelerate"
    versions = {"bitsandbytes": "0.47.0", "torch": "2.13.0", "transformers": "5.24.0"}
    masking = masking_entries(fixed, cell, seen, versions, entries)
    assert masking == ["bnb-int8-saved-base-reloads-wrong"]
    assert masking_entries(fixed, cell, seen, {**versions, "bitsandbytes": "0.48.1"}, entries) == []  # fixed there
    assert masking_entries(fixed, cell, "evaluate: RuntimeError: other", versions, entries) == []  # not its failure
    zero1 = next(e for e in entries if e.id == "deepspeed-0.18.7-zero12-split-view-modified-inplace")
    curve = "train_steps: matrix.checks.CurveDiverged: the training loss curve leaves the torch engine's at step <n> @ "
    ds = {"deepspeed": "0.19.0", "torch": "2.13.0"}
    assert masking_entries(zero1, "tiny-llama-fp32-train-cpu-deepspeed-zero1", curve, ds, entries) == []


def test_a_masking_entrys_hardware_condition_is_read_for_the_machine_the_row_ran_on():
    """bnb-linear4bit-state-dict-does-not-load-back's script (lora, whose layers are 32 wide) fails first
    with the nf4 inference bug, which bitsandbytes has only where it detects AVX512-BF16
    (bnb-cpu-4bit-inference-needs-whole-blocks): the row run on such a machine names it, whatever machine
    the page is rewritten on; a machine without it would not."""
    entries = load().entries
    entry = next(e for e in entries if e.id == "bnb-linear4bit-state-dict-does-not-load-back")
    (row,) = [r for r in _page_rows() if r["entry"] == entry.id and r["release"] == "0.50.2"]
    assert row["verdict"] == "another bug first" and "AVX512" in row["machine"] and row.get("hardware") is None
    versions = {"bitsandbytes": "0.50.2", "torch": "2.13.0", "transformers": "5.24.0", "peft": "0.21.2"}
    seen = row["seen"]
    assert seen and seen.startswith("mid_training_eval: RuntimeError: shape")
    facts = {"bitsandbytes_cpu_avx512_bf16": True, "cpu_capability": "AVX512", "cpu_avx512_bf16": True}
    with_it = masking_entries(entry, row["cell"], seen, versions, entries, facts)
    assert with_it == ["bnb-cpu-4bit-inference-needs-whole-blocks"]
    without = {**facts, "bitsandbytes_cpu_avx512_bf16": False}
    assert masking_entries(entry, row["cell"], seen, versions, entries, without) == []


def test_a_package_the_cell_needs_and_the_stack_lacks_goes_in_beside():
    """hf-trainer-zero2's ranks import deepspeed, which the default stack does not carry: the row
    installs the release the script is written with beside the entry's own (its ranks once died
    on the import, RankDied, a row that said nothing of the entry)."""
    from matrix.grid.packages import installed_version

    entry = next(e for e in load().entries if e.id == "trainer-scales-a-loss-that-ignores-num-items")
    (row,) = [r for r in plan([entry], {"transformers": ["5.24.0"]}) if r["release"] == "5.24.0"]
    baseline = {"torch": "2.13.0", "transformers": "5.24.0", "accelerate": "1.15.0"}
    reason = needs(entry, row, baseline, {"transformers": ["5.24.0"]})
    if installed_version("deepspeed") is None:
        assert reason == "needs deepspeed, which neither the scratch environment nor the script's writer has"
    else:
        assert reason is None and row["companions"] == [f"deepspeed=={installed_version('deepspeed')}"]
    (row,) = [r for r in plan([entry], {"transformers": ["5.24.0"]}) if r["release"] == "5.24.0"]
    assert needs(entry, row, {**baseline, "deepspeed": "0.19.8"}, {"transformers": ["5.24.0"]}) is None
    assert row["companions"] == []  # the stack has it


def _page_rows(page: Path = PAGE) -> list[dict]:
    return json.loads(page.with_suffix(".json").read_text())["rows"]


def test_the_page_has_every_bug_entry_and_verdicts_that_follow_from_the_exits():
    bugs = {e.id: e for e in load().entries if e.kind == "bug"}
    rows = _page_rows()
    assert sorted(bugs) == sorted({r["entry"] for r in rows}), "rerun: python -m matrix entry-releases --budget 0"
    for row in rows:
        entry = bugs[row["entry"]]
        where = f"{row['entry']} on {row['package']} {row['release']}"
        assert row["cell"] == entry.shown_by, f"{where}: the page's cell is not the entry's shown_by"
        assert row["verdict"] in VERDICTS and row["verdict"] == verdict_of(row), where
        assert row["expected"] == (0 if row["role"] == "fixed" else 1), where
        if row["ran"]:
            assert row["ran_at"] and row["machine"] and isinstance(row["exit"], (int, type(None))), where
        elif row["verdict"] == "not run here":
            assert row["note"], f"{where}: a row not run says what it needs"
        if row["release"] in ("-",) or row["package"] not in entry.versions:
            continue
        specifier = entry.versions[row["package"]]
        if row["role"] == "fixed":
            assert Version(row["release"]) in {Version(s.version) for s in specifier if s.operator == "<"}, where
        elif Version(row["release"]).public == row["release"]:
            assert specifier.contains(Version(row["release"])), f"{where}: {specifier} does not admit it"
    assert PAGE.read_text() == page_markdown(rows), "the page is written from its JSON: regenerate it"


class PipInMemory:
    """A scratch environment whose pip only keeps a table of what is installed: enough to see what
    each row group runs with, without installing anything."""

    def __init__(self, baseline: dict[str, str]):
        self._baseline, self.now = dict(baseline), dict(baseline)

    def baseline(self) -> dict[str, str]:
        return dict(self._baseline)

    def pip(self, command: str, *args: str) -> subprocess.CompletedProcess:
        names = [a for a in args if not a.startswith("-")]
        if command == "install":
            self.now.update(tuple(a.lower().split("==")) for a in names)
        elif command == "uninstall":
            for name in names:
                self.now.pop(name, None)
        listed = [{"name": n, "version": v} for n, v in self.now.items()] if command == "list" else []
        return subprocess.CompletedProcess([command, *args], 0, json.dumps(listed), "")


def test_each_row_group_runs_on_the_baseline_with_only_its_own_releases():
    """A group's releases go into the stack as built, never over the group before: bitsandbytes
    rows once ran over a transformers 4.x an earlier group left behind, and failed in its check."""
    baseline = {"transformers": "5.24.0", "bitsandbytes": "0.50.2", "torch": "2.13.0"}
    env = PipInMemory(baseline)
    install_group(env, ("transformers==4.50.0", "accelerate==1.5.2"), log=lambda line: None)
    assert env.now == {**baseline, "transformers": "4.50.0", "accelerate": "1.5.2"}
    install_group(env, ("bitsandbytes==0.46.1",), log=lambda line: None)
    assert env.now == {**baseline, "bitsandbytes": "0.46.1"}
    assert install_group(env, (), log=lambda line: None) is None  # a group of the baseline's own releases
    assert env.now == baseline


SCRATCH = ROOT / ".bisect" / "default" / ".bisect-stack"
ENTRY = "transformers-prequantized-reload-casts-saved-fp32-tensors"


def test_an_entry_run_on_a_release_it_names_and_on_its_fixed_release(tmp_path):
    if not SCRATCH.exists():
        pytest.skip("needs the default stack's scratch environment (.bisect/default, built by a sweep or bisection)")
    page = tmp_path / "entry-releases.md"
    shutil.copy(PAGE.with_suffix(".json"), page.with_suffix(".json"))  # the other entries' rows, not replanned
    command = [sys.executable, "-m", "matrix", "entry-releases", "--entry", ENTRY, "-o", str(page), "--budget", "900"]
    command += ["--release", "transformers==5.20.2", "--release", "transformers==5.21.0"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["release"]: r for r in _page_rows(page) if r["entry"] == ENTRY}
    named, fixed = rows["5.20.2"], rows["5.21.0"]
    assert (named["exit"], named["verdict"]) == (1, "shows it"), named
    assert named["phase"] == "checkpoint_reload" and named["matches_entry"], named
    assert named["check"] and named["check"]["what"], named  # the check's numbers
    assert (fixed["exit"], fixed["verdict"]) == (0, "fixed there"), fixed
    assert page.read_text() == page_markdown(_page_rows(page))
