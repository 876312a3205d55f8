"""The matrix as a pytest plugin in a project of its own (pytester): a model kind, a precision, an
engine, a device and a catalogue entry registered from outside the package, each with one
register() call (tests/plugins/user_axes.py, docs/extending.md); their cells
re-run, replay and reproduce from the commands the report records; and a plugin that does not
load, or an option out of range, stops the run in one line before anything is written."""

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import python_path

pytest_plugins = ["pytester"]

PLUGINS = Path(__file__).resolve().parent / "plugins"
ROOT = Path(__file__).resolve().parent.parent
SELECTION = (
    "--model", "user-broken",
    "--precision", "fp32,bf16-mixed,fp16-true,fp16-mixed-unscaled",
    "--mode", "train",
    "--device", "cpu,cpu-alias",
    "--engine", "torch,torch-twin,accelerate",
)  # fmt: skip


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    """One run of the user's axis values through `python -m matrix run -p user_axes`."""
    directory = tmp_path_factory.mktemp("user-run")
    env = {**os.environ, "PYTHONPATH": python_path(PLUGINS)}
    env.pop("PYTEST_ADDOPTS", None)
    command = [sys.executable, "-m", "matrix", "run", "-p", "user_axes", *SELECTION, "-p", "no:cacheprovider"]
    command += ["--report-dir", str(directory / "reports"), "--run-id", "user"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    results = json.loads((directory / "reports" / "user" / "results.json").read_text())
    return done, {cell["id"]: cell for cell in results["cells"]}, env, directory


def test_each_registered_axis_value_runs_beside_the_built_in_ones(user_run):
    done, cells, _, _ = user_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(cells) == 4 * 2 * 3  # precisions x devices x engines, train only
    for device in ("cpu", "cpu-alias"):
        for engine in ("torch", "torch-twin", "accelerate"):
            assert cells[f"user-broken-fp32-train-{device}-{engine}"]["outcome"] == "passed"
            # the user's catalogue entry, added to the built-in catalogue
            assert cells[f"user-broken-bf16-mixed-train-{device}-{engine}"]["known_failure"]["id"] == (
                "user-broken-backward"
            )
            # a built-in known class reaches the user's kind through its trait (full-weights)
            fp16_true = cells[f"user-broken-fp16-true-train-{device}-{engine}"]
            assert (fp16_true["outcome"], fp16_true["known_failure"]["id"]) == ("known", "adamw-fp16-eps-underflow")
        # the user's precision: the torch loops run it; accelerate cannot be told it, and says why
        assert cells[f"user-broken-fp16-mixed-unscaled-train-{device}-torch"]["known_failure"]["id"] == (
            "user-broken-backward"
        )
        skipped = cells[f"user-broken-fp16-mixed-unscaled-train-{device}-accelerate"]
        assert skipped["outcome"] == "skipped"
        assert skipped["skip_reason"] == "Requires: [an accelerate setting for float16 autocast without a grad scaler]"
    # the same loop under another name, on the same device under another name: the same losses
    losses = {c["metrics"]["train_losses"][0] for k, c in cells.items() if "-fp32-" in k and "accelerate" not in k}
    assert len(losses) == 1


def test_a_user_cells_recorded_rerun_runs_it_again(user_run):
    _, cells, env, directory = user_run
    rerun = cells["user-broken-bf16-mixed-train-cpu-alias-torch-twin"]["rerun"]
    assert rerun.endswith("-p user_axes"), rerun  # the plugin the cell's values come from
    command = shlex.split(rerun)
    assert command[0] == "pytest"
    done = subprocess.run(
        [sys.executable, "-m", *command, "--report-dir", str(directory / "rerun")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and "1 xfailed" in done.stdout, done.stdout[-3000:]


def test_replay_and_repro_load_the_users_plugin(user_run, tmp_path):
    _, cells, env, _ = user_run
    cell = "user-broken-bf16-mixed-train-cpu-torch"
    signature = cells[cell]["signature"]
    replay = subprocess.run(
        [sys.executable, "-m", "matrix", "replay", "-p", "user_axes", cell],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert replay.returncode == 1 and replay.stdout.startswith(f"{signature['id']} {signature['text']}")

    script = tmp_path / "repro.py"
    repro = subprocess.run(
        [sys.executable, "-m", "matrix", "repro", "-p", "user_axes", cell, "-o", str(script)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert repro.returncode == 0, repro.stderr
    assert 'importlib.import_module("user_axes")' in script.read_text() or "'user_axes'" in script.read_text()
    ran = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert ran.returncode == 1 and "REPRODUCED in train_steps: RuntimeError: expected m1 and m2" in ran.stdout


# a downstream project: what a user's repository holds to run the matrix's cells as its own tests
PROJECT = {
    "conftest.py": "import user_axes  # noqa: F401  (registers its axis values and catalogue)\n",
    "test_matrix.py": "from matrix.plugin.cases import test_cell  # noqa: F401\n",
    # a test of the project's own that takes an argument named `cell`
    "test_other.py": """
        import pytest

        @pytest.mark.parametrize("cell", ["mine"])
        def test_mine(cell, request):
            assert cell == "mine"
            assert "isolated_torch_state" not in request.fixturenames
        """,
    # tests that change torch's process-wide settings, and one after them that asks for the fixture
    "test_state.py": """
        import os
        import torch

        THREADS = torch.get_num_threads()

        def test_changes_everything(isolated_torch_state):
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.set_default_dtype(torch.float64)
            torch.set_grad_enabled(False)
            torch.set_num_threads(THREADS + 1)
            torch.backends.mkldnn.matmul.fp32_precision = "bf16"  # the legacy getter refuses now
            torch.set_autocast_enabled("cpu", True)
            os.environ["MATRIX_TEST_LEFTOVER"] = "1"

        def test_finds_it_as_it_was(isolated_torch_state):
            assert not torch.are_deterministic_algorithms_enabled()
            assert not torch.is_deterministic_algorithms_warn_only_enabled()
            assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
            assert torch.get_num_threads() == THREADS
            assert torch.get_float32_matmul_precision() == "highest"
            assert not torch.is_autocast_enabled("cpu")
            assert "MATRIX_TEST_LEFTOVER" not in os.environ
        """,
}


def test_a_project_of_its_own_runs_its_cells_beside_its_own_tests(pytester, monkeypatch):
    """A downstream project (PROJECT), run once with plain pytest: its conftest loads the plugin
    module, test_matrix.py imports the matrix's test, and the matrix's own plugin comes from its
    pytest11 entry point. Its cells run and re-run without -p; its other tests are not
    parametrized with the cells, even with a selection given, and get none of the plugin's
    fixtures unasked; isolated_torch_state, asked for, restores torch's process-wide settings
    (the deterministic-algorithms mode and its warn-only flag among them)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    for name, source in PROJECT.items():
        (pytester.path / name).write_text(textwrap.dedent(source))
    done = pytester.runpytest_subprocess(
        "--model", "user-broken", "--precision", "fp32,bf16-mixed", "--mode", "train", "--device", "cpu",
        "--engine", "torch", "--report-dir", str(pytester.path / "reports"), "-p", "no:cacheprovider", "-rA",
    )  # fmt: skip
    summary = "\n".join(done.outlines).rpartition("short test summary info")[2].splitlines()
    outcomes = dict(reversed(line.split(" ", 2)[:2]) for line in summary if line.startswith(("PASSED ", "XFAIL ")))
    assert outcomes == {
        "test_matrix.py::test_cell[user-broken-fp32-train-cpu-torch]": "PASSED",
        "test_matrix.py::test_cell[user-broken-bf16-mixed-train-cpu-torch]": "XFAIL",
        "test_other.py::test_mine[mine]": "PASSED",  # its own parameter, not the cells
        "test_state.py::test_changes_everything": "PASSED",
        "test_state.py::test_finds_it_as_it_was": "PASSED",  # what the test before it changed is back
    }, "\n".join(done.outlines[-60:])
    done.assert_outcomes(passed=4, xfailed=1)
    # put back, and said: the warning names each setting the test left changed
    warned = "\n".join(done.outlines).rpartition("warnings summary")[2]
    assert "LeftGlobalStateChanged" in warned
    assert "torch.backends.mkldnn.matmul.fp32_precision 'none' -> 'bf16'" in warned
    results = json.loads((pytester.path / "reports" / "latest" / "results.json").read_text())
    rerun = {c["id"]: c["rerun"] for c in results["cells"]}
    # the node id is the project's own test module; its conftest loads the plugin, so no -p
    assert rerun == {
        "user-broken-fp32-train-cpu-torch": "pytest 'test_matrix.py::test_cell[user-broken-fp32-train-cpu-torch]'",
        "user-broken-bf16-mixed-train-cpu-torch": (
            "pytest 'test_matrix.py::test_cell[user-broken-bf16-mixed-train-cpu-torch]'"
        ),
    }


# the variables the matrix's cells run under (matrix/execute/environment_variables.py), and the stack the
# plugin must not import where no cell runs
CELL_VARIABLES = ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS", "MKL_CBWR", "TRITON_INTERPRET")
STACK = ("torch", "transformers", "peft", "accelerate", "lightning")
# a project's conftest that notes, for each test's call and at the process's exit, which of the
# stack is imported and the variables' values
OBSERVER = f"""
    import atexit, json, os, sys

    OBSERVED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "observed.json")
    seen = {{}}

    def observe(when):
        seen[when] = {{
            "stack": [name for name in {STACK!r} if name in sys.modules],
            "variables": {{name: os.environ.get(name) for name in {CELL_VARIABLES!r}}},
        }}
        if "torch" in sys.modules:  # Triton's interpreter is for machines without a GPU
            seen[when]["gpu"] = sys.modules["torch"].cuda.is_available()

    def pytest_runtest_call(item):
        observe(item.nodeid)

    def write():
        observe("exit")
        with open(OBSERVED, "w") as out:
            json.dump(seen, out)

    atexit.register(write)
    """
UNSET = dict.fromkeys(CELL_VARIABLES)


def run_project(pytester, monkeypatch, files: dict[str, str], *args: str):
    """A project of its own, with the matrix installed (its pytest11 entry point loads the plugin),
    run in a fresh pytest process whose environment has none of the cells' variables."""
    for name in CELL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    for name, source in {"conftest.py": OBSERVER, **files}.items():
        (pytester.path / name).write_text(textwrap.dedent(source))
    done = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    return done, json.loads((pytester.path / "observed.json").read_text())


def test_a_session_that_selects_no_matrix_test_imports_no_torch_and_keeps_its_environment(pytester, monkeypatch):
    """pytest-timeout and pytest-xdist change nothing until they are used; neither does the
    matrix: its options are there, but no torch (or the rest of the stack) is imported, no
    environment variable is set, and no reports/ directory is left behind."""
    outer = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # what the process is given
    (pytester.path / "outer.json").write_text(json.dumps(outer))
    plain = f"""
        import json, os, sys
        from pathlib import Path

        def test_the_matrix_is_loaded_and_out_of_the_way(request):
            assert request.config.pluginmanager.has_plugin("matrix")  # from its pytest11 entry point
            assert request.config.getoption("matrix_cell_timeout") == "120.0"
            assert [name for name in {STACK!r} if name in sys.modules] == []
            outer = json.loads(Path(__file__).with_name("outer.json").read_text())
            # pytest's own PYTEST_VERSION and PYTEST_CURRENT_TEST aside, the environment is as given
            mine = {{k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PYTEST_")}}
            assert mine == {{k: v for k, v in outer.items() if not k.startswith("PYTEST_")}}
        """
    done, observed = run_project(pytester, monkeypatch, {"test_plain.py": plain})
    done.assert_outcomes(passed=1)
    call = "test_plain.py::test_the_matrix_is_loaded_and_out_of_the_way"
    assert observed[call] == {"stack": [], "variables": UNSET}
    assert observed["exit"] == {"stack": [], "variables": UNSET}  # nor at the session's end
    assert not (pytester.path / "reports").exists()


def test_a_cells_variables_are_set_while_it_runs_and_put_back_for_the_tests_after_it(pytester, monkeypatch):
    """One cheap cell between two plain tests of the same session: the offline, MKL and interpreter
    variables are set during the cell only; the plain test collected after it sees them unset.
    (torch is not imported here: pytester would unload it after the test, and torch cannot be
    imported twice in one process.)"""
    plain = "def test_{}():\n    pass\n"
    files = {
        "test_a_plain.py": plain.format("before"),
        "test_matrix.py": "from matrix.plugin.cases import test_cell  # noqa: F401\n",
        "test_z_plain.py": plain.format("after"),
    }
    selection = ("--model", "tiny-transformer", "--precision", "fp32", "--mode", "eval", "--device", "cpu")
    reports = str(pytester.path / "reports")
    done, observed = run_project(pytester, monkeypatch, files, *selection, "--engine", "torch", "--report-dir", reports)
    done.assert_outcomes(passed=3)
    cell = "test_matrix.py::test_cell[tiny-transformer-fp32-eval-cpu-torch]"
    assert list(observed) == ["test_a_plain.py::test_before", cell, "test_z_plain.py::test_after", "exit"]
    interpreter = None if observed[cell]["gpu"] else "1"
    during = {
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "MKL_CBWR": "AUTO",
        "TRITON_INTERPRET": interpreter,
    }
    assert observed[cell]["variables"] == during
    for when in ("test_a_plain.py::test_before", "test_z_plain.py::test_after", "exit"):
        assert observed[when]["variables"] == UNSET, when


@pytest.mark.parametrize(
    ("plugin_source", "expected"),
    [
        ("def broken(:\n    pass\n", "-p bad_plugin: "),
        (
            "from matrix.models import register\n"
            "from matrix.models.tiny_llama import TinyLlama\n"
            "register(TinyLlama())\n",
            "model kind 'tiny-llama' is already registered (by matrix.models.tiny_llama.TinyLlama)",
        ),
    ],
    ids=["syntax-error", "name-taken"],
)
def test_a_plugin_that_does_not_load_is_one_line_and_exit_2(tmp_path, plugin_source, expected):
    (tmp_path / "bad_plugin.py").write_text(plugin_source)
    env = {**os.environ, "PYTHONPATH": python_path(tmp_path)}
    env.pop("PYTEST_ADDOPTS", None)
    reports = tmp_path / "reports"
    command = [sys.executable, "-m", "matrix", "run", "-p", "bad_plugin", "--model", "tiny-llama", "--report-dir"]
    done = subprocess.run([*command, str(reports)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    message = done.stderr.strip()
    assert message.count("\n") == 0 and expected in message and "Traceback" not in message, message
    assert not reports.exists() or not any(reports.iterdir())


def test_a_taken_name_is_plain_pytests_usage_error(tmp_path):
    (tmp_path / "bad_plugin.py").write_text(
        "from matrix.engines import register\nfrom matrix.engines.torch_loop import TorchEngine\n"
        "register(TorchEngine())\n"
    )
    env = {**os.environ, "PYTHONPATH": python_path(tmp_path)}
    env.pop("PYTEST_ADDOPTS", None)
    command = [sys.executable, "-m", "pytest", "cases", "-p", "bad_plugin", "--report-dir", str(tmp_path / "r")]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 4  # pytest's usage error
    assert done.stderr.strip() == (
        "ERROR: engine 'torch' is already registered (by matrix.engines.torch_loop.TorchEngine)"
    )
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("value", "expected"),
    [("-1", "--cell-timeout: '-1' is not a positive number of seconds"),
     ("abc", "--cell-timeout: 'abc' is not a number of seconds")],
)  # fmt: skip
def test_a_cell_timeout_out_of_range_is_refused(tmp_path, value, expected):
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    reports = tmp_path / "reports"
    plain = [sys.executable, "-m", "pytest", "cases", f"--cell-timeout={value}", "--report-dir", str(reports)]
    done = subprocess.run(plain, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stderr.strip()) == (4, f"ERROR: {expected}")
    run = [sys.executable, "-m", "matrix", "run", "--cell-timeout", value, "--report-dir", str(reports)]
    done = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stderr.strip()) == (2, f"python -m matrix run: {expected}")
    assert not reports.exists()


def test_the_trainer_says_it_cannot_drive_a_kind_whose_forward_takes_no_labels(registered):
    from torch import nn

    from matrix.engines import ENGINES
    from matrix.models import MODELS
    from matrix.models.tiny_transformer import TinyTransformer

    class NoLabels(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(99, 8)

        def forward(self, input_ids, padding_mask):
            return self.embed(input_ids).mean(1)

    class NoLabelsKind(TinyTransformer):
        name = "no-labels"
        description = "forward(input_ids, padding_mask) only (test)"

        def create(self):
            return NoLabels()

    registered(MODELS, NoLabelsKind())
    reason = ENGINES["hf-trainer"].kind_skip_reason(MODELS["no-labels"])
    assert reason == (
        "Requires: [a model whose forward(**batch) takes the batch's keys, labels included, and returns the loss] "
        "(no-labels's forward does not take labels)"
    )
    assert ENGINES["hf-trainer"].kind_skip_reason(MODELS["tiny-transformer"]) is None
    assert ENGINES["torch"].kind_skip_reason(MODELS["no-labels"]) is None  # the loops call the kind's loss()


def test_a_cells_files_stay_only_where_it_failed_in_a_new_way(run_pytest, tmp_path):
    """A cell's working directory (its checkpoints and exports: a real model's fill a CI disk) is
    removed once the cell is recorded, unless the catalogue does not explain its failure; with
    --keep-cell-files every one stays."""
    selection = ("--model", "tiny-llama", "--precision", "fp32,fp16-true", "--mode", "train", "--engine", "torch")
    selection += ("--device", "cpu", "--no-builtin-catalogue", "-p", "no:cacheprovider")

    def directories(basetemp: Path, *extra: str) -> dict[str, list[str]]:
        run_pytest(*selection, "--basetemp", str(basetemp), *extra, report_dir=basetemp.parent / "reports")
        found = [d for d in basetemp.iterdir() if d.is_dir() and not d.is_symlink()]  # not pytest's "current" link
        return {d.name: sorted(p.name for p in d.iterdir()) for d in found}

    def cells(found: dict) -> list[str]:  # pytest cuts a test's directory name at 30 characters
        return sorted("fp32" if "fp32" in name else "fp16-true" if "fp16_true" in name else name for name in found)

    tidied = directories(tmp_path / "tidied")
    # the fp32 cell passed: its directory is gone; the fp16-true one failed (AdamW's eps underflows
    # in float16, which no catalogue here explains) and keeps its directory
    assert cells(tidied) == ["fp16-true"], tidied
    kept = directories(tmp_path / "kept", "--keep-cell-files")
    assert cells(kept) == ["fp16-true", "fp32"], kept
    assert [files for name, files in kept.items() if "fp32" in name] == [["checkpoint"]], kept
