"""A pytest plugin that python -m matrix.tools.bench loads into the runs it times (-p matrix.tools.bench_probe):
at the end of each process's session it writes which of the stack's modules (bench.STACK_MODULES)
that process had imported, so the bench's floor imports just those. It writes nothing unless the
bench named a directory in MATRIX_BENCH_IMPORTS."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from matrix.tools.bench import PROBE_VARIABLE, STACK_MODULES


def pytest_sessionfinish(session) -> None:
    directory = os.environ.get(PROBE_VARIABLE)
    if directory:
        imported = [name for name in STACK_MODULES if name in sys.modules]
        (Path(directory) / f"{os.getpid()}.json").write_text(json.dumps(imported))
