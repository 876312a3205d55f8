"""Every ```python block in README.md and docs/ runs (issue 48): a reader copies them as they are.
(docs/gpu-runs/ is left out: the outputs of GPU runs kept as evidence, not pages.)

Each block is one of three things:
- a file of tests/plugins/ shown whole (tests/test_docs_journeys.py checks it is that file, byte
  for byte, and the tests that load that plugin run it);
- marked `<!-- not run: REASON -->` on the line before its fence (a fragment that cannot run alone,
  the reason saying where its whole is run);
- anything else, run here as a script of its own, in a fresh interpreter (a block that registers
  an axis value changes its process's registries), from an empty directory with the project on
  the path: it must exit 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# docs/gpu-runs/ holds the outputs of GPU runs kept as evidence (their triage pages show the scripts
# a GPU ran), not pages a reader copies from
KEPT_OUTPUTS = ROOT / "docs" / "gpu-runs"
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if not p.is_relative_to(KEPT_OUTPUTS))]
PLUGINS = ROOT / "tests" / "plugins"
BLOCK = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<reason>\S.*?)\s*-->\s*$")


def python_blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """(line, code, the not-run reason or None) of each ```python block of a page."""
    text = page.read_text(encoding="utf-8")
    found = []
    for match in BLOCK.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marked = NOT_RUN.search(before)
        indent = match.group("indent")
        code = "".join(part.removeprefix(indent) for part in match.group("body").splitlines(keepends=True))
        found.append((line, code, marked.group("reason") if marked else None))
    return found


def shown_plugin(code: str) -> Path | None:
    """The tests/plugins file a block shows whole, if it is one."""
    return next((path for path in sorted(PLUGINS.glob("*.py")) if path.read_text(encoding="utf-8") == code), None)


ALL_BLOCKS = [(page, line, code, reason) for page in PAGES for line, code, reason in python_blocks(page)]
RUN_HERE = [
    pytest.param(page, line, code, id=f"{page.relative_to(ROOT).as_posix()}:{line}")
    for page, line, code, reason in ALL_BLOCKS
    if reason is None and shown_plugin(code) is None
]


@pytest.mark.parametrize(("page", "line", "code"), RUN_HERE)
def test_every_python_block_of_the_docs_runs(page, line, code, tmp_path):
    where = f"{page.relative_to(ROOT).as_posix()}:{line}"
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{where}: the block exits {done.returncode}:\n{done.stderr[-3000:]}"


def test_a_block_not_run_here_says_where_it_is_run():
    """A plugin shown whole is run by the tests that load it; a block marked not run names the file
    of the project that holds its whole."""
    problems = []
    for page, line, _code, reason in ALL_BLOCKS:
        if reason is None:
            continue
        named = [path for path in re.findall(r"[\w./-]+\.py", reason) if (ROOT / path).is_file()]
        if not named:
            problems.append(f"{page.relative_to(ROOT).as_posix()}:{line}: the reason names no file: {reason!r}")
    assert not problems, "; ".join(problems)
    assert len(RUN_HERE) >= 3  # precisions.md's, extending.md's two
    assert any(page.name == "precisions.md" for page, *_ in (p.values for p in RUN_HERE))


def test_the_blocks_are_found_and_a_broken_one_fails(tmp_path):
    """The extraction sees an indented block and a marked one, and running catches a NameError."""
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python\nimport sys\n```\n\n- item\n\n  ```python\n  x = 1\n  ```\n\n"
        "<!-- not run: a fragment of tests/plugins/user_trainer.py -->\n```python\nclass A(B): ...\n```\n"
    )
    assert python_blocks(page) == [
        (3, "import sys\n", None),
        (9, "x = 1\n", None),
        (14, "class A(B): ...\n", "a fragment of tests/plugins/user_trainer.py"),
    ]
    precisions_block = next(code for _, code, _ in python_blocks(ROOT / "docs" / "precisions.md"))
    broken = tmp_path / "broken.py"
    broken.write_text(precisions_block.replace("import torch\n", ""), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(broken)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode != 0 and "NameError: name 'torch' is not defined" in done.stderr
