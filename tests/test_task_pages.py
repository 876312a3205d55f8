"""The task pages (docs/tasks/) work as written: every command in their shell blocks is either run
here, as the page gives it, or checked for what it must hold (a pip install that cannot replace
torch, a nox session that runs exactly `python -m matrix run cases`), and the reports the runs
write answer the page's question with a verdict in every cell (no harness error).

How a page's command is run: in a fresh directory (this test's tmp_path), as a user runs it from
the directory holding their module: `python` is this interpreter (the project is installed in
it), `cases` is this checkout's, `nox -s matrix -- ARGS` is what that session runs
(`python -m matrix run cases ARGS`, checked against noxfile.py), and `-p matrix.plugin` is left
out where the package is installed (pytest refuses a plugin registered twice). The modules the
pages tell the user to copy (the loop of ENGINES.md, the kind of extending.md) are taken from the
section the page links to and written beside it. Only the library-branch page's runs are narrowed,
by a `-k` appended to the page's selection (four cells instead of the hundreds a real
comparison runs); the GPU page's runs go as written: on a machine without CUDA every cell skips,
naming it, and the shards, the merge and the diff run on those reports.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "docs" / "tasks"
PAGES = ("own-loop.md", "own-model.md", "library-branch.md", "gpu-cluster-upgrade.md")
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
# the library-branch page's runs, narrowed to the torch engine's bf16-mixed cells and fp32 eval cells
BRANCH_NARROWING = ("-k", "bf16-mixed-train-cpu-torch] or fp32-eval-cpu-torch]")
# what a harness error looks like, as opposed to a verdict about the user's loop or model
HARNESS_PHASES = ("crash", "record", "setup", "call")
HARNESS_SIGNS = (
    "EngineContractBroken",
    "EngineIncomplete",
    "SettingsUnrecordable",
    "ProcessDied",
    "RecordUnwritable",
    "KindSetupTimedOut",
    "INTERNALERROR",
)
RUN_LIMIT_S = 900


# ---------------------------------------------------------------- reading a page


def page_text(name: str) -> str:
    return (TASKS / name).read_text(encoding="utf-8")


def commands(name: str) -> list[str]:
    """Every command of a page's shell blocks (fences with no language, or bash/sh/console), one
    per `&&`-joined part, its comment left on."""
    found, language = [], None  # None: outside a fence
    for line in page_text(name).splitlines():
        fence = re.match(r"^```\s*(\w*)\s*$", line)
        if fence:
            language = None if language is not None else fence.group(1)
        elif language in ("", "bash", "sh", "console") and line.strip():
            found += [part.strip() for part in line.split("&&")]
    return found


def words(command: str) -> list[str]:
    lexer = shlex.shlex(command, posix=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    return list(lexer)


def linked_module(name: str, target: str) -> str:
    """The Python block of the section the page links to (`../ENGINES.md#a-hand-written-loop`):
    the module the page tells the user to copy whole."""
    text = page_text(name)
    assert f"]({target})" in text, f"{name} no longer links {target}"
    path, _, anchor = target.partition("#")
    linked = (TASKS / path).resolve().read_text(encoding="utf-8")
    heading = next(m for m in re.finditer(r"^#+ (.*)$", linked, re.MULTILINE) if slug(m.group(1)) == anchor)
    found = PYTHON_BLOCK.search(linked, heading.end())
    assert found, f"no python block under {target}"
    return found.group(1)


def slug(heading: str) -> str:
    text = "".join(ch for ch in heading.lower() if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


# ---------------------------------------------------------------- how each command is checked

PIP = re.compile(r"(?:^|\s)-m pip (install|wheel)\b")


def how_checked(command: str) -> str:
    """'run' for a command this module runs; otherwise what it checks instead ('pip', 'nox')."""
    argv = words(command)
    if PIP.search(command):
        return "pip"
    if argv[:3] == ["nox", "-s", "matrix"] and "--" in argv:
        return "run"
    if argv and argv[0] in ("python", "python3"):
        return "run"
    return "unchecked"


def matrix_session_runs_matrix_run_cases() -> bool:
    source = (ROOT / "noxfile.py").read_text(encoding="utf-8")
    session = source[source.index("def matrix(session") :]
    session = session[: session.index("\n@nox.session")]
    return 'session.run("python", "-m", "matrix", "run", "cases", *session.posargs)' in session


def installed() -> bool:
    return any(e.name == "matrix" for e in importlib.metadata.entry_points(group="pytest11"))


def argv_of(command: str, *extra: str) -> tuple[list[str], str | None]:
    """The command as this test runs it, and the file its stdout goes to (`> FILE`)."""
    argv = words(command)
    output = None
    if ">" in argv:
        output = argv[argv.index(">") + 1]
        argv = argv[: argv.index(">")]
    if argv[:2] == ["nox", "-s"]:
        assert matrix_session_runs_matrix_run_cases(), "nox -s matrix no longer runs python -m matrix run cases ARGS"
        argv = ["python", "-m", "matrix", "run", "cases", *argv[argv.index("--") + 1 :]]
    assert argv[0] in ("python", "python3"), command
    argv = [sys.executable, *argv[1:]]
    if "-p" in argv and argv[argv.index("-p") + 1] == "matrix.plugin" and installed():
        del argv[argv.index("-p") : argv.index("-p") + 2]
    argv = [str(ROOT / "cases") if word == "cases" else word for word in argv]
    return [*argv, *extra], output


def run_command(command: str, cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    argv, output = argv_of(command, *extra)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "MATRIX_STACK")}
    if words(command)[:3] == ["nox", "-s", "matrix"]:
        env["MATRIX_STACK"] = "default"  # what nox's install_stack() sets for the matrix session
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_LIMIT_S)
    if output is not None:
        (cwd / output).write_text(done.stdout)
    return done


def run_ids(name: str) -> list[str]:
    return [words(c)[words(c).index("--run-id") + 1] for c in commands(name) if "--run-id" in words(c)]


def cells_of(report: Path) -> dict[tuple, dict]:
    document = json.loads((report / "results.json").read_text())
    return {(c["model"], c["precision"], c["mode"], c["engine"]): c for c in document["cells"]}


def assert_a_verdict(cell: dict) -> None:
    """Passed (or passed where a known failure's hardware condition does not hold: not applicable
    here), known, or failed by one of the matrix's checks: never the harness's own error."""
    verdicts = ("passed", "inapplicable", "known", "failed")
    assert cell["outcome"] in verdicts, (cell["id"], cell["outcome"], cell.get("skip_reason"))
    if cell["outcome"] == "inapplicable":  # it passed; the entry that selects it names the condition unmet here
        assert cell["signature"] is None and cell["known_failure"]["id"], cell["id"]
    elif cell["outcome"] != "passed":
        text = cell["signature"]["text"]
        assert cell["phase"] not in HARNESS_PHASES, (cell["id"], text)
        assert not any(sign in text for sign in HARNESS_SIGNS), (cell["id"], text)


# ---------------------------------------------------------------- every command is checked


@pytest.mark.parametrize("name", PAGES)
def test_every_command_of_a_task_page_is_run_or_checked_here(name):
    found = commands(name)
    assert found, f"{name}: no shell block"
    unchecked = [c for c in found if how_checked(c) == "unchecked"]
    assert not unchecked, f"{name}: commands this test neither runs nor checks: {unchecked}"


def extras() -> set[str]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


@pytest.mark.parametrize("name", PAGES)
def test_pip_on_a_task_page_never_replaces_torch_and_names_real_extras(name):
    for command in (c for c in commands(name) if how_checked(c) == "pip"):
        argv = words(command)
        if argv[-1] == "nox":  # installing nox itself
            continue
        # --no-deps, or the constraint file that pins the torch the machine has
        assert "--no-deps" in argv or ("-c" in argv and argv[argv.index("-c") + 1] == "keep-torch.txt"), command
        for word in argv:
            named = re.fullmatch(r"\.\[([\w,-]+)\]", word)
            if named:
                assert set(named.group(1).split(",")) <= extras(), (command, sorted(extras()))
    if any("keep-torch.txt" in c for c in commands(name)):
        made = [c for c in commands(name) if c.endswith("> keep-torch.txt")]
        assert made, f"{name} uses keep-torch.txt and never writes it"


# ---------------------------------------------------------------- own-loop.md


@pytest.fixture(scope="module")
def own_loop(tmp_path_factory) -> tuple[Path, list]:
    directory = tmp_path_factory.mktemp("own-loop")
    (directory / "my_loop.py").write_text(linked_module("own-loop.md", "../ENGINES.md#a-hand-written-loop"))
    runs = [(c, run_command(c, directory)) for c in commands("own-loop.md") if how_checked(c) == "run"]
    return directory, runs


def test_own_loop_page_runs_and_every_cell_is_a_verdict_about_the_loop(own_loop):
    directory, runs = own_loop
    assert len(runs) == 2, [c for c, _ in runs]  # the environment's first run, then the page's question
    for command, done in runs:
        assert done.returncode in (0, 1), (command, done.stdout[-3000:], done.stderr[-3000:])
        assert "INTERNALERROR" not in done.stdout + done.stderr, command
    cells = cells_of(directory / "reports" / "latest")  # the page reads reports/latest/summary.md
    assert {key[3] for key in cells} == {"my-loop", "torch"}
    assert len(cells) == 2 * 4 * 2 * 2  # tiny-llama, lora x four precisions x train, eval x two engines
    for (model, precision, mode, engine), cell in cells.items():
        assert_a_verdict(cell)
        if engine == "my-loop":  # the page's loop does what plain torch does, cell for cell
            torch_cell = cells[(model, precision, mode, "torch")]
            assert cell["outcome"] == torch_cell["outcome"], (cell["id"], cell.get("signature"))
            assert (cell.get("known_failure") or {}).get("id") == (torch_cell.get("known_failure") or {}).get("id")
    summary = (directory / "reports" / "latest" / "summary.md").read_text()
    assert "| tiny-llama | my-loop |" in summary and "| lora | torch |" in summary  # the rows the page reads


def test_the_pages_loop_with_its_grad_scaler_left_out_is_marked_as_not_exercising_fp16(tmp_path):
    """The buggy twin a user writes by leaving the scaler out: these tiny models' fp16 gradients do
    not underflow on a CPU, so every check can hold; the report still says the cell ran without
    the grad scaler its precision asks for (metrics.effective.grad_scaler_in_run), where the
    page's own loop is not marked."""
    source = linked_module("own-loop.md", "../ENGINES.md#a-hand-written-loop")
    wanted = "enabled=state.settings.grad_scaler"
    assert wanted in source
    twin = source.replace(wanted, "enabled=False").replace('"my-loop"', '"no-scaler"')
    (tmp_path / "no_scaler.py").write_text(twin)
    (tmp_path / "my_loop.py").write_text(source)
    done = subprocess.run(
        [sys.executable, "-m", "matrix", "run", str(ROOT / "cases"), "-p", "no_scaler", "-p", "my_loop",
         "--model", "tiny-llama", "--precision", "fp16-mixed", "--mode", "train", "--engine", "no-scaler,my-loop",
         "--device", "cpu", "--report-dir", str(tmp_path / "reports")],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
        capture_output=True, text=True, timeout=RUN_LIMIT_S,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    cells = cells_of(tmp_path / "reports" / "latest")
    twin_cell, loop_cell = (
        cells[("tiny-llama", "fp16-mixed", "train", "no-scaler")],
        cells[("tiny-llama", "fp16-mixed", "train", "my-loop")],
    )
    assert twin_cell["metrics"]["effective"]["grad_scaler_in_run"] is False
    assert loop_cell["metrics"]["effective"]["grad_scaler_in_run"] is True
    summary = (tmp_path / "reports" / "latest" / "summary.md").read_text()
    assert "under no-scaler on cpu the model's first forward ran without a grad scaler" in summary
    assert "under my-loop on cpu" not in summary


# ---------------------------------------------------------------- own-model.md


@pytest.fixture(scope="module")
def own_model(tmp_path_factory) -> tuple[Path, list]:
    directory = tmp_path_factory.mktemp("own-model")
    (directory / "my_model.py").write_text(linked_module("own-model.md", "../extending.md#a-model-kind"))
    runs = [(c, run_command(c, directory)) for c in commands("own-model.md") if how_checked(c) == "run"]
    return directory, runs


def test_own_model_page_runs_eager_and_compiled_with_a_verdict_in_every_cell(own_model):
    directory, runs = own_model
    assert len(runs) == 1, [c for c, _ in runs]
    command, done = runs[0]
    assert done.returncode in (0, 1), (command, done.stdout[-3000:], done.stderr[-3000:])
    assert "INTERNALERROR" not in done.stdout + done.stderr
    cells = cells_of(directory / "reports" / "latest")
    assert len(cells) == 4 * 2 * 2  # four precisions x train, eval x torch, torch-compile
    for (model, _, mode, engine), cell in cells.items():
        assert model == "my-model"
        assert_a_verdict(cell)
        if engine == "torch-compile":
            assert cell["metrics"]["compiled"]["how"].startswith("model = torch.compile(model)"), cell["id"]
            if mode == "train":  # the kind's save() got the plain module: its state_dict() reloads
                assert cell["phases"]["checkpoint_reload"] == "passed", (cell["id"], cell.get("signature"))


# ---------------------------------------------------------------- library-branch.md


def test_library_branch_page_two_runs_on_one_environment_diff_to_no_change(tmp_path):
    runs = []
    for command in (c for c in commands("library-branch.md") if how_checked(c) == "run"):
        narrowing = BRANCH_NARROWING if "--run-id" in words(command) else ()
        done = run_command(command, tmp_path, *narrowing)
        runs.append((command, done))
        if " diff " not in command:  # 1: a new failure, which the page says a baseline may have
            assert done.returncode in (0, 1), (command, done.stdout[-3000:], done.stderr[-3000:])
            assert "INTERNALERROR" not in done.stdout + done.stderr, command
    page_diff = "python -m matrix diff reports/peft-base reports/peft-branch"
    assert [c.split(" -- ")[0] for c, _ in runs] == ["nox -s matrix", "nox -s matrix", page_diff]
    for run_id in run_ids("library-branch.md"):
        cells = cells_of(tmp_path / "reports" / run_id)
        ran = [c for c in cells.values() if c["outcome"] != "skipped"]
        assert ran, run_id
        for cell in ran:
            assert_a_verdict(cell)
    command, done = runs[-1]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]  # the same environment: no change
    assert "no changes;" in done.stdout, done.stdout[-3000:]


def uses() -> dict[str, dict[str, set[str]]]:
    """library -> axis -> the built-in values whose `requires` name it (compiled twins left out)."""
    from matrix.engines import ENGINES
    from matrix.grid import packages
    from matrix.models import MODELS
    from matrix.models.hf_architecture import HfArchitecture
    from matrix.precisions.policies import PRECISIONS

    found: dict[str, dict[str, set[str]]] = {}

    def add(requirements, axis, name):
        for requirement in requirements:
            found.setdefault(packages.package(requirement).name, {}).setdefault(axis, set()).add(name)

    for name, kind in MODELS.items():
        if type(kind).__module__.startswith("matrix."):
            add(kind.requires, "model", name)
    add(HfArchitecture.requires, "model", "hf:*")
    for name, engine in ENGINES.items():
        if type(engine).__module__.startswith("matrix.engines") and not engine.compiled:
            twin = ENGINES.get(f"{name}-compile")
            assert twin is None or twin.requires == engine.requires, name
            add(engine.requires, "engine", name)
    for name, precision in PRECISIONS.items():
        add(precision.requires, "precision", name)
    return {library: axes for library, axes in found.items() if library in packages.STACK}


def markdown_table(text: str, heading: str) -> list[list[str]]:
    section = text[text.index(heading) :]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows and not line.startswith("|"):
            break
    return rows


def names(cell: str) -> set[str]:
    return set() if cell == "-" else {name.strip().strip("`") for name in cell.split(",")}


def test_library_branch_page_says_which_cells_use_each_library_as_the_code_does():
    header, *rows = markdown_table(page_text("library-branch.md"), "## Which cells use your library")
    assert header == ["library", "model kinds", "engines (each with its `-compile` twin)", "precisions"]
    on_page = {
        row[0]: {
            axis: names(cell)
            for axis, cell in zip(("model", "engine", "precision"), row[1:], strict=True)
            if names(cell)
        }
        for row in rows
    }
    assert on_page == uses()


def test_library_branch_page_selections_select_cells_that_use_the_library():
    from matrix.engines import ENGINES
    from matrix.models import MODELS
    from matrix.precisions.policies import PRECISIONS

    known = {"model": set(MODELS), "engine": set(ENGINES), "precision": set(PRECISIONS), "device": {"cpu", "cuda"}}
    table = uses()
    header, *rows = markdown_table(page_text("library-branch.md"), "The selection for each library:")
    assert header == ["your library", "the selection (pytest arguments)"]
    assert {"peft", "transformers", "accelerate"} <= {row[0] for row in rows}
    for library, selection in rows:
        argv = words(re.search(r"`([^`]*)`", selection).group(1))  # the code span, not the words after it
        named = {argv[i][2:]: set(argv[i + 1].split(",")) for i in range(0, len(argv), 2)}
        for axis, values in named.items():
            assert values <= known[axis], (library, axis, values - known[axis])
        narrowed = [axis for axis in ("model", "engine", "precision") if axis in named]
        # every named value of at least one axis uses the library (no axis named: every cell)
        assert not narrowed or any(named[axis] <= table[library].get(axis, set()) for axis in narrowed), library


# ---------------------------------------------------------------- gpu-cluster-upgrade.md


def test_gpu_page_marks_each_command_that_needs_a_gpu():
    for command in commands("gpu-cluster-upgrade.md"):
        if "--device" in words(command) and "cuda" in words(command)[words(command).index("--device") + 1]:
            assert "# needs a GPU" in command, command
        else:
            assert "needs a GPU" not in command, command


def test_gpu_page_runs_end_to_end_where_no_gpu_is_visible(tmp_path, monkeypatch):
    """Every command in order, the GPUs hidden: each run's cells skip naming CUDA, the shards
    merge and both diffs pass: the page's sequence works as given (its GPU runs themselves are
    the GPU machine's to make)."""
    from importlib.metadata import version

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for command in (c for c in commands("gpu-cluster-upgrade.md") if how_checked(c) == "run"):
        done = run_command(command, tmp_path)
        assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-3000:])
        if "--run-id" in words(command):
            run_id = words(command)[words(command).index("--run-id") + 1]
            cells = cells_of(tmp_path / "reports" / run_id)
            assert cells, command
            # every cell skips naming what it lacks: CUDA, or (a one-process engine's reduce row) more ranks
            assert all(c["outcome"] == "skipped" and c["skip_reason"].startswith("Requires: [") for c in cells.values())
            assert any(c["skip_reason"].startswith("Requires: [CUDA device]") for c in cells.values()), command
    assert (tmp_path / "keep-torch.txt").read_text().strip() == f"torch=={version('torch')}"
    merged = json.loads((tmp_path / "reports" / "after-merged" / "results.json").read_text())
    assert len(merged["cells"]) == len(cells_of(tmp_path / "reports" / "before")) and not merged["missing"]
