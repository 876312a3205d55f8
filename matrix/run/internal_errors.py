"""A pytest plugin `python -m matrix run` loads into the pytest process it supervises
(PYTEST_PLUGINS): an internal error of pytest (a hook that raised, the recording of a cell
included) ends that process with exit status 3 and its traceback on the console only. This
writes the traceback to internalerror-<pid>.log in the run's directory too, where the
supervisor (matrix/run/supervisor.py) reads it into the crash record of the cell that was running, as it
reads faulthandler's stacks after a fatal signal. Standard library only."""

from __future__ import annotations

import os
from pathlib import Path

DIRECTORY_VARIABLE = "MATRIX_INTERNALERROR_DIR"  # set by the supervisor: the run's directory
LOG_PREFIX = "internalerror-"


def log_path(directory: Path, pid: int) -> Path:
    return Path(directory) / f"{LOG_PREFIX}{pid}.log"


def pytest_internalerror(excrepr, excinfo) -> None:
    directory = os.environ.get(DIRECTORY_VARIABLE)
    if not directory or not Path(directory).is_dir():
        return
    with open(log_path(Path(directory), os.getpid()), "a", encoding="utf-8") as log:
        log.write(f"{excrepr}\n")
