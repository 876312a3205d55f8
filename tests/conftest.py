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


def fresh_pytest_process(*args: str, report_dir: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the matrix in a fresh pytest process, as a user would, with the test plugins."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(PLUGINS), str(ROOT)])}
    env.pop("PYTEST_ADDOPTS", None)
    command = [sys.executable, "-m", "pytest", "cases", "--report-dir", str(report_dir), *args]
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
