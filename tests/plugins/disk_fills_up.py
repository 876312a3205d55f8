"""The disk fills up in the middle of a run, loaded with `-p disk_fills_up` (tests only).

When the bf16-true cell's test is called, this process may no longer make any file larger than
the run's journal is at that moment (RLIMIT_FSIZE, at the journal's size; SIGXFSZ ignored, so an
over-long write fails with EFBIG instead of killing the process). The operating system then
refuses the cell's checkpoint and the journal's next line the way a full disk refuses them with
ENOSPC: what a 2-core CI machine with a full disk saw, a cell failing and then its record.
The journal's path comes from DISK_FILLS_UP_JOURNAL.
"""

import os
import resource
import signal
from pathlib import Path

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    callspec = getattr(item, "callspec", None)
    cell = callspec.params.get("cell") if callspec else None
    if cell is None or cell.precision != "bf16-true":
        return
    size = Path(os.environ["DISK_FILLS_UP_JOURNAL"]).stat().st_size
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
