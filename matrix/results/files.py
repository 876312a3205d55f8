"""Reading a run back: a report directory or its results.json, checked before it is trusted.

diff and merge read files that come from other machines, other nights and other versions of
this project. What they rely on is checked here, and a file that is not a results.json of a
version we read fails with one line naming the file and the field, never a traceback.
Standard library only: comparing two runs must not need the stack that produced them.
"""

from __future__ import annotations

import json
from pathlib import Path

from matrix.grid.cell import AXES
from matrix.results import SCHEMA_VERSION

SCHEMA_FILE = Path(__file__).with_name("results.schema.json")  # the JSON Schema results.json follows
# 4 added per-cell placement and rerun, shards; 5 the per-cell traceback (None where a file has none)
READABLE_SCHEMA_VERSIONS = (3, 4, SCHEMA_VERSION)
# What every cell record holds: its axes (matrix/grid/cell.py) and one of the outcomes.
# inapplicable: passed where an entry's hardware condition does not hold here (not applicable here)
OUTCOMES = ("passed", "known", "fixed", "inapplicable", "failed", "skipped")
CELL_FIELDS = ("id", *AXES, "outcome", "signature", "metrics")


class ResultsError(ValueError):
    """A path that is not a readable results.json; str() names the file and the field."""


def results_path(path: Path) -> Path:
    """A report directory -> its results.json; a reports root -> its latest run's."""
    path = Path(path)
    if path.is_dir():
        for candidate in (path / "results.json", path / "latest" / "results.json"):
            if candidate.is_file():
                return candidate
        pointer = path / "LATEST"
        if pointer.is_file():
            return path / pointer.read_text().strip() / "results.json"
        raise ResultsError(f"{path}: no results.json in this directory (nor a latest run under it)")
    return path


def load(path: Path) -> tuple[dict, Path]:
    """The checked document and the file it came from."""
    file = results_path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ResultsError(f"{file}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ResultsError(f"{file}: cannot read it ({error})") from None
    try:
        document = json.loads(text)
    except ValueError as error:
        raise ResultsError(f"{file}: not JSON ({error})") from None
    check(document, file)
    return document, file


def check(document, file: Path) -> None:
    def fail(field: str, problem: str) -> None:
        raise ResultsError(f"{file}: {field}: {problem}")

    if not isinstance(document, dict) or "schema_version" not in document:
        fail("schema_version", "missing: not a precision-matrix results.json")
    if document["schema_version"] not in READABLE_SCHEMA_VERSIONS:
        fail(
            "schema_version",
            f"{document['schema_version']!r} is not one this version reads "
            f"({', '.join(map(str, READABLE_SCHEMA_VERSIONS))})",
        )
    for field, kind in (("run", dict), ("environment", dict), ("cells", list)):
        if not isinstance(document.get(field), kind):
            fail(field, f"missing or not a{'n object' if kind is dict else ' list'}")
    if not isinstance(document["run"].get("id"), str):
        fail("run.id", "missing or not a string")
    seen = set()
    for n, cell in enumerate(document["cells"]):
        where = f"cells[{n}]"
        if not isinstance(cell, dict):
            fail(where, "not an object")
        for field in CELL_FIELDS:
            if field not in cell:
                fail(f"{where}.{field}", "missing")
        if not isinstance(cell["id"], str):
            fail(f"{where}.id", "not a string")
        if cell["id"] in seen:
            fail(f"{where}.id", f"{cell['id']!r} appears twice")
        seen.add(cell["id"])
        if cell["outcome"] not in OUTCOMES:
            fail(f"{where}.outcome", f"{cell['outcome']!r} is not one of {', '.join(OUTCOMES)}")
        signature = cell["signature"]
        if cell["outcome"] in ("failed", "known") and not (
            isinstance(signature, dict) and isinstance(signature.get("id"), str)
        ):
            fail(f"{where}.signature", f"a {cell['outcome']} cell needs a signature with an id")
        if cell["outcome"] in ("known", "fixed", "inapplicable") and not isinstance(cell.get("known_failure"), dict):
            fail(f"{where}.known_failure", f"a {cell['outcome']} cell needs its catalogue entry")
        if not isinstance(cell["metrics"], dict):
            fail(f"{where}.metrics", "not an object")


CPU_FEATURES = (
    ("cpu_avx512_bf16", "AVX512-BF16"),
    ("cpu_amx_tile", "AMX"),
    ("cpu_vnni", "VNNI"),
    ("cpu_onednn_fp16", "oneDNN float16"),
)


def hardware_line(env: dict) -> str:
    """What decided the kernels on the machine, in words (environment.hardware): the capability
    torch dispatched its CPU kernels on, the CPU's own features, what bitsandbytes detected. The
    GPUs' compute capability is in the GPU list beside it."""
    facts = env.get("hardware") or {}
    if not facts:
        return "kernel-deciding hardware not recorded"
    features = [name for key, name in CPU_FEATURES if facts.get(key)]
    parts = [
        f"torch dispatches on {facts.get('cpu_capability') or 'unknown'}",
        "CPU has " + (", ".join(features) if features else "none of " + ", ".join(n for _, n in CPU_FEATURES)),
    ]
    detected = facts.get("bitsandbytes_cpu_avx512_bf16")
    if detected is not None:
        parts.append(f"bitsandbytes detects AVX512-BF16: {'yes' if detected else 'no'}")
    return "; ".join(parts)
