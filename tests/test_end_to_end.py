"""The whole path, cell spec -> run -> outcome -> signature -> record -> report, driven by
model kinds defined outside the matrix package (tests/plugins/broken_models.py)."""

import json

import pytest

PLUGIN = ("-p", "broken_models", "--engine", "torch")


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
