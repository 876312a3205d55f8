"""The whole path, cell spec -> run -> outcome -> signature -> record -> report, driven by
model kinds defined outside the matrix package (tests/plugins/broken_models.py)."""

import html
import json
import re
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

PLUGIN = ("-p", "broken_models", "--engine", "torch")
PLUGINS = Path(__file__).resolve().parent / "plugins"


def load_results(tmp_path):
    return json.loads((tmp_path / "reports" / "latest" / "results.json").read_text())


BROKEN = ("--model", "broken-matmul", "--precision", "fp32,bf16-mixed", "--device", "cpu")


@pytest.fixture(scope="module")
def broken_run(tmp_path_factory, fresh_pytest):
    """One run of the broken custom Function's cells, read by the tests below."""
    directory = tmp_path_factory.mktemp("broken")
    return fresh_pytest(*PLUGIN, *BROKEN, report_dir=directory / "reports"), directory


def test_a_broken_custom_function_fails_with_its_signature_and_phase(broken_run):
    done, tmp_path = broken_run
    assert done.returncode == 1, done.stdout[-3000:]
    cells = {c["id"]: c for c in load_results(tmp_path)["cells"]}

    # fp32 trains, evaluates and round-trips its checkpoint
    for mode in ("train", "eval"):
        assert cells[f"broken-matmul-fp32-{mode}-cpu-torch"]["outcome"] == "passed"
    # bf16 autocast: evaluation has no backward, so it passes; training fails in backward
    assert cells["broken-matmul-bf16-mixed-eval-cpu-torch"]["outcome"] == "passed"
    broken = cells["broken-matmul-bf16-mixed-train-cpu-torch"]
    assert broken["outcome"] == "failed"
    assert broken["phase"] == "train_steps"
    assert broken["phases"] == {
        "train_steps": "failed",
        "mid_training_eval": "not run",
        "checkpoint_save": "not run",
        "checkpoint_reload": "not run",
        "resumed_step": "not run",
    }
    signature = broken["signature"]
    assert signature["exception"] == "RuntimeError"
    assert "BFloat16" in signature["message"] and "Float" in signature["message"]
    # innermost frame inside the stack under test: torch's autograd calling the Function
    # (the plugin module itself is not part of the stack)
    assert signature["origin"].startswith("torch.autograd."), signature["origin"]
    assert signature["id"] in load_results(tmp_path)["signatures"]

    # the pytest failure message starts with the signature, then the re-run command
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("_") and "bf16-mixed-train-cpu-torch]" in line)
    first_lines = [line for line in lines[header + 1 :] if line.strip()][:2]
    assert first_lines[0].startswith(f"{signature['id']} train_steps: RuntimeError:")
    # with the plugin module the run loaded: the cell's model kind exists only with it
    rerun = "pytest 'cases/test_cells.py::test_cell[broken-matmul-bf16-mixed-train-cpu-torch]' -p broken_models"
    assert first_lines[1] == f"re-run: {rerun}"
    assert broken["rerun"] == rerun


def test_the_same_failure_gives_the_same_signature_in_two_runs(broken_run, run_pytest, tmp_path):
    """The run above, and a second one, of that cell alone, in another process."""
    cell = "broken-matmul-bf16-mixed-train-cpu-torch"
    run_pytest(*PLUGIN, *BROKEN, "--mode", "train", "-k", "bf16", report_dir=tmp_path / "two" / "reports")
    first, second = (load_results(directory)["cells"] for directory in (broken_run[1], tmp_path / "two"))
    assert [c["id"] for c in second] == [cell] and second[0]["outcome"] == "failed"
    assert next(c for c in first if c["id"] == cell)["signature"]["id"] == second[0]["signature"]["id"]


@pytest.mark.timeout(300)
def test_a_crashed_worker_still_leaves_its_cell_in_the_report(run_pytest, tmp_path):
    done = run_pytest(
        *PLUGIN,
        "--model",
        "crash-abort,broken-matmul",
        "--precision",
        "fp32",
        "--mode",
        "train",
        "--device",
        "cpu",
        "-n",
        "1",
    )
    assert done.returncode == 1, done.stdout[-3000:]
    cells = {c["id"]: c for c in load_results(tmp_path)["cells"]}
    crashed = cells["crash-abort-fp32-train-cpu-torch"]
    assert crashed["outcome"] == "failed"
    assert crashed["phase"] == "crash"
    assert crashed["signature"]["exception"] == "crash"
    assert "crashed" in crashed["signature"]["message"]
    # the other cell still ran, on a replacement worker
    assert cells["broken-matmul-fp32-train-cpu-torch"]["outcome"] == "passed"


# The innermost frame of the broken cell's real traceback: the Function's backward, in the
# plugin module, where the half gradient meets the fp32 weight.
INNERMOST_FRAME = re.compile(r'File "[^"]*broken_models\.py", line \d+, in backward\n')
BROKEN_CELL = "broken-matmul-bf16-mixed-train-cpu-torch"


def assert_innermost(text: str) -> None:
    """`text` holds the traceback's innermost frame, its source line, and the exception last."""
    match = INNERMOST_FRAME.search(text)
    assert match, text[-3000:]
    after = text[match.end() :].splitlines()
    assert "grad_output @ weight" in after[0]
    assert any(line.startswith("RuntimeError: expected m1 and m2 to have the same dtype") for line in after[1:4])


def test_a_failed_cells_traceback_is_in_every_file_of_the_report(broken_run):
    _, tmp_path = broken_run
    directory = tmp_path / "reports" / "latest"
    cells = {c["id"]: c for c in load_results(tmp_path)["cells"]}
    traceback = cells[BROKEN_CELL]["traceback"]
    assert traceback.startswith("Traceback (most recent call last):\n") and "in run_cell" in traceback.splitlines()[1]
    assert_innermost(traceback)
    assert all(c["traceback"] is None for c in cells.values() if c["outcome"] == "passed")

    failure = ElementTree.parse(directory / "junit.xml").getroot().find(f"testcase[@name='{BROKEN_CELL}']/failure")
    assert failure.text.startswith(cells[BROKEN_CELL]["message"] + "\n\nTraceback (most recent call last):\n")
    assert_innermost(failure.text)

    page = (directory / "index.html").read_text(encoding="utf-8")
    detail = page.split(f'<section class="detail" id="cell-{BROKEN_CELL}">')[1].split("</section>")[0]
    # the harness's frames folded (each run a <details class="harness">), the plugin's and torch's shown
    unfolded = re.sub(
        r'<details class="harness">.*?</details>', "", detail.split('<details class="traceback">')[1], flags=re.S
    )
    shown = "\n".join(
        html.unescape(pre) for pre in re.findall(r"<pre>(.*?)</pre>", unfolded.split("</details>")[0], re.S)
    )
    assert_innermost(shown + "\n")
    assert "in run_cell" not in shown and "frames of the harness folded" in detail

    summary = (directory / "summary.md").read_text()
    new = summary.split("## Not in the catalogue: ")[1].split("\n## ")[0]
    assert new.count("<details><summary>traceback</summary>") == 1
    fenced = new.split("<details><summary>traceback</summary>\n\n  ```\n")[1].split("\n  ```\n")[0]
    assert_innermost("\n".join(line.removeprefix("  ") for line in fenced.splitlines()) + "\n")


def test_replay_prints_the_signature_then_the_traceback(broken_run, monkeypatch, capsys, isolated_torch_state):
    """python -m matrix replay, in this process: -p imports the plugin module as the CLI would."""
    from matrix.__main__ import main
    from matrix.models import MODELS

    signature = next(c for c in load_results(broken_run[1])["cells"] if c["id"] == BROKEN_CELL)["signature"]
    monkeypatch.syspath_prepend(str(PLUGINS))
    loaded = "broken_models" in sys.modules
    try:
        assert main(["replay", "-p", "broken_models", BROKEN_CELL]) == 1
    finally:
        if not loaded:  # leave the registry as this process had it: the plugin's kinds exist only with -p
            for name in ("broken-matmul", "crash-abort"):
                MODELS.unregister(name)
            sys.modules.pop("broken_models", None)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"{signature['id']} {signature['text']}"
    assert lines[1] == f"{BROKEN_CELL}: failed in train_steps"
    assert out.index("Traceback (most recent call last):") > out.index(lines[1])
    assert_innermost(out)
