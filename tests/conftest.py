import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = Path(__file__).resolve().parent / "plugins"

# Deterministic by default (CI): derandomized, no example database, bounded examples.
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("explore", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    """The harness's tests run cells in process on xdist workers: they share the cores as the
    matrix's own workers do (the plugin does this only where a matrix test is collected)."""
    from matrix.plugin.session import share_the_cores

    share_the_cores(config)


@pytest.fixture(autouse=True)
def fresh_reference_curves():
    """Each test computes the reference curves its cells compare with afresh: a test that patches
    the stack (an optimizer that skips steps) must not leave its references to the next test in the
    worker. The matrix's own runs patch nothing, so they keep them for the process."""
    yield
    reference_curves = sys.modules.get("matrix.harness.reference_curves")
    if reference_curves is not None:
        reference_curves._REFERENCE_CURVES.clear()


def python_path(*first: Path) -> str:
    """PYTHONPATH for a process a test starts: `first`, then this checkout, then whatever the tests
    were given (a GPU image that carries its packages on PYTHONPATH keeps them in the processes the
    tests start)."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([*map(str, first), str(ROOT), *inherited])


def matrix_plugin() -> tuple[str, ...]:
    """`-p matrix.plugin` where the package is not installed (a source checkout on a GPU image, with
    no pytest11 entry point), nothing where it is (pytest would refuse the plugin registered twice)."""
    installed = any(e.name == "matrix" for e in importlib.metadata.entry_points(group="pytest11"))
    return () if installed else ("-p", "matrix.plugin")


def fresh_pytest_process(*args: str, report_dir: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the matrix in a fresh pytest process, as a user would, with the test plugins."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": python_path(PLUGINS)}
    env.pop("PYTEST_ADDOPTS", None)
    command = [sys.executable, "-m", "pytest", "cases", *matrix_plugin(), "--report-dir", str(report_dir), *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def fresh_pytest():
    """fresh_pytest_process, for a module's fixture: one run that several tests read."""
    return fresh_pytest_process


@pytest.fixture
def run_pytest(tmp_path):
    """fresh_pytest_process, reporting under this test's tmp_path unless told otherwise."""

    def run(*args: str, report_dir: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
        return fresh_pytest_process(*args, report_dir=report_dir or tmp_path / "reports", env=env)

    return run


@pytest.fixture(scope="session")
def matrix_cpu():
    """matrix_cpu(report_dir, *args): `python -m matrix run cases --device cpu` with the given
    selection; the process and its cells by id."""

    def run(report_dir: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
        done, document = run_matrix_cpu(report_dir, *args, run_id="run")
        return done, {c["id"]: c for c in document["cells"]}

    return run


# the engines where the Trainer counts a GPT-2's labels (trainer-num-items-overcounts-unmapped-causal-lm)
GPT2_LABEL_COUNTING_TRAINERS = ("hf-trainer", "hf-trainer-zero2", "hf-trainer-zero3")


@pytest.fixture
def forgetful_training(matrix_cpu, tmp_path):
    """forgetful_training(engines): the training cells of tests/plugins/forgetful_optimizer.py (a
    stack whose optimizers load no state from a checkpoint) on `engines`, checked: each fails in
    resumed_step with the optimizer state compared, and its resumed step differs from the
    uninterrupted one as well (matrix/harness/resume.py)."""

    def run(engines) -> dict:
        models = "forgetful-gpt2,forgetful-llama"
        selection = ("--model", models, "--precision", "fp32", "--mode", "train", "--engine", ",".join(engines))
        done, cells = matrix_cpu(tmp_path, "-p", "forgetful_optimizer", *selection)
        assert len(cells) == 2 * len(engines), done.stdout[-2000:]
        for cell_id, cell in cells.items():
            text = cell["signature"]["text"] if isinstance(cell["signature"], dict) else cell["signature"]
            if cell["model"] == "forgetful-gpt2" and cell["engine"] in GPT2_LABEL_COUNTING_TRAINERS:
                # the Trainer's loss count on a GPT-2 fails its first step first (a known entry); on
                # DeepSpeed too, where its dropout is compared off through the Trainer's compute_loss
                assert cell["outcome"] == "known" and cell["phase"] == "train_steps", text
                assert cell["known_failure"]["id"] == "trainer-num-items-overcounts-unmapped-causal-lm", text
                continue
            assert cell["outcome"] == "failed", (cell_id, cell["outcome"], text)
            assert cell["phase"] == "resumed_step", (cell_id, text)
            assert "matrix.checks.CheckpointMismatch: optimizer state" in text, (cell_id, text)
            record = cell["metrics"]["resume"]
            assert record["optimizer_state_restored"] is False, cell_id
            assert record["tensors_differing"] > 0, cell_id  # the step comparison saw it as well
        assert done.returncode == 1  # new failures: the run says so
        return cells

    return run


@pytest.fixture
def registered():
    """registered(registry, item): the item is registered for this test only."""
    added = []

    def register(registry, item):
        registry.register(item)
        added.append((registry, item.name))
        return item

    yield register
    for registry, name in added:
        registry.unregister(name)


# A user's whole CPU grid in one process: the GPT-2 takes about a minute, the pretrained BERT
# (22M parameters, bf16 autocast on a CPU) several. The tests that use users_grid set a
# pytest-timeout past this limit, so that the run's own limit (and its output) is what a hang reports.
USERS_GRID_RUN_LIMIT_S = 1200


def run_matrix_cpu(report_dir: Path, *args: str, run_id: str = "users") -> tuple[subprocess.CompletedProcess, dict]:
    """`python -m matrix run cases --device cpu ARGS` with tests/plugins importable, its run written
    to report_dir/run_id: the process and its results.json."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env["PYTHONPATH"] = python_path(PLUGINS)
    command = [sys.executable, "-m", "matrix", "run", "cases", *matrix_plugin(), "--device", "cpu", *args]
    done = subprocess.run(
        [*command, "--report-dir", str(report_dir), "--run-id", run_id],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=USERS_GRID_RUN_LIMIT_S,
    )
    results = report_dir / run_id / "results.json"
    assert results.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(results.read_text())


def _check_no_harness_failure(done: subprocess.CompletedProcess, document: dict, report_dir: Path) -> dict:
    """Exit 0, no new failure, every skip naming its capability; the cells by id."""
    cells = {c["id"]: c for c in document["cells"]}
    assert done.returncode == 0, (report_dir / "users" / "summary.md").read_text()
    assert [i for i, c in cells.items() if c["outcome"] == "failed"] == []
    selection = document["run"]["selection"]
    assert len(cells) == len(selection["precision"]) * len(selection["mode"]) * len(selection["engine"])  # the grid
    for cell in cells.values():
        if cell["outcome"] == "skipped":
            assert cell["skip_reason"].startswith("Requires: ["), cell
    return cells


@pytest.fixture(scope="session")
def users_grid():
    """users_grid(plugin, model, report_dir, *extra): a user's kind from tests/plugins through the whole
    CPU matrix with `python -m matrix run` (extra: more of its arguments), checked for exit 0, no new
    failure and skips that name their capability; its cells by id."""

    def run(plugin: str, model: str, report_dir: Path, *extra: str) -> dict:
        done, document = run_matrix_cpu(report_dir, "-p", plugin, "--model", model, *extra)
        return _check_no_harness_failure(done, document, report_dir)

    return run
