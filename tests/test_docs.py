"""The docs stay honest: every relative link in README.md and docs/ resolves (to a file, and to a
heading where it names an anchor), every `nox -s NAME` they name is a session of noxfile.py,
every `python -m matrix SUB` a subcommand of matrix/__main__.py (and every `python -m matrix.X`
a module that exists), every --flag a command line in them gives is one that command takes
(`pytest` and `python -m matrix run` with the matrix's plugin, `python -m matrix SUB`, what a nox
session hands on after `--`), the README stays a landing page, and it links every page of docs/.

Standard library and pytest only: nothing here imports torch or the matrix package; noxfile.py
and matrix/__main__.py are read with `ast`, not imported, and the flags a command takes are read
from its own --help, in a subprocess.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]  # hand-written and generated alike
README_MAX_LINES = 260

FENCE = re.compile(r"^([ \t]*)(```|~~~)[^\n]*\n.*?^\1\2[ \t]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def page_id(path: Path) -> str:
    return rel(path)


def without_code(text: str) -> str:
    """The prose of a page: fenced blocks and code spans blanked (their links are not links)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return CODE_SPAN.sub(" ", text)


def code_lines(text: str) -> list[str]:
    """Every line of a fenced block, and every code span, of a page: where commands are written."""
    lines = []
    for block in FENCE.finditer(text):
        lines += block.group(0).splitlines()[1:-1]
    prose = FENCE.sub("\n", text)
    lines += [span.group(2).replace("\n", " ") for span in CODE_SPAN.finditer(prose)]
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lower-case, punctuation dropped but for
    hyphens (and underscores, which GitHub keeps), spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors GitHub gives a page's headings (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for match in HEADING.finditer(FENCE.sub("\n", path.read_text(encoding="utf-8"))):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def links(text: str) -> list[str]:
    prose = without_code(text)
    return [m.group(1) for m in INLINE_LINK.finditer(prose)] + [m.group(1) for m in REFERENCE_LINK.finditer(prose)]


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("//"):
            continue  # http:, https:, mailto: ...: not this repository's
        path_part, _, anchor = target.partition("#")
        if path_part.startswith("/"):
            problems.append(f"link {target!r}: an absolute path (write it relative to {rel(page)})")
            continue
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            problems.append(f"link {target!r}: {path_part} does not exist (resolved from {rel(page.parent) or '.'})")
            continue
        if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"link {target!r}: {rel(resolved)} has no heading with the anchor #{anchor}")
    return problems


@cache
def nox_sessions() -> frozenset[str]:
    """The session names noxfile.py defines (functions decorated with nox.session), and for a
    session parametrized over the version stacks, `name(param='X')` for every stack X."""
    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    stacks = tomllib.loads((ROOT / "matrix" / "releases" / "stacks.toml").read_text(encoding="utf-8"))["stack"]
    names = set()
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        name, params, is_session = node.name, [], False
        for decorator in node.decorator_list:
            call = decorator if isinstance(decorator, ast.Call) else None
            target = ast.unparse(call.func if call else decorator)
            if target == "nox.session":
                is_session = True
                for keyword in call.keywords if call else ():
                    if keyword.arg == "name":
                        name = ast.literal_eval(keyword.value)
            elif target == "nox.parametrize" and call:
                argument = ast.literal_eval(call.args[0])
                values_node = call.args[1]
                try:
                    values = [str(v) for v in ast.literal_eval(values_node)]
                except ValueError:
                    assert "STACKS" in ast.unparse(values_node), (
                        f"noxfile.py: session {node.name} is parametrized over {ast.unparse(values_node)}, "
                        "which this test cannot read: teach tests/test_docs.py where its values come from"
                    )
                    values = list(stacks)
                params.append((argument, values))
        if is_session:
            names.add(name)
            for argument, values in params:
                names.update(f"{name}({argument}='{value}')" for value in [*values, "..."])  # ...: a placeholder
    return frozenset(names)


def named_sessions(line: str) -> Iterator[str]:
    """The sessions a command line names: `nox -s a b c`, `nox -s "stack(name='x')"`, and nox's
    other spellings (--session, --sessions, -e); the list ends at the next option or `--`."""
    for match in re.finditer(r"\bnox\b(.*)", line):
        lexer = shlex.shlex(match.group(1), posix=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        try:
            words = list(lexer)
        except ValueError:  # an unclosed quote: a fragment of prose, not a command
            words = match.group(1).split()
        names, taking = [], False
        for word in words:
            if word in ("-s", "--session", "--sessions", "-e"):
                taking = True
            elif word.startswith("-") or word in ("&&", "||", ";", "|", "\\") or not taking:
                if taking:
                    break
            else:
                word = word.rstrip(",.;:")
                if word.count(")") > word.count("("):  # prose around it: (`nox -s tests`)
                    word = word[: word.rindex(")")]
                names.append(word)
        yield from names


@cache
def matrix_subcommands() -> frozenset[str]:
    """`python -m matrix`'s subcommands: the add_parser("name") calls of matrix/__main__.py. Its
    parser is built inside main(), which also runs the command, so it is read, not built."""
    tree = ast.parse((ROOT / "matrix" / "__main__.py").read_text(encoding="utf-8"))
    return frozenset(
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_parser"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    )


PYTHON_M_MATRIX = re.compile(r"\bpython3?(?:\s+-[A-Za-z]+)*\s+-m\s+(matrix(?:\.[\w.]+)?)\b(?:\s+([^\s`'\"]+))?")


def matrix_commands(line: str) -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in PYTHON_M_MATRIX.finditer(line)]


def module_exists(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


# --- which flags a command takes -------------------------------------------------------------

FLAG = re.compile(r"(?:^|[\s,\[(])(--[A-Za-z0-9][\w-]*)")
# sessions whose arguments after `--` go to pytest or to `python -m matrix run` (which hands them
# on to pytest), and those whose arguments go to one `python -m matrix` subcommand (noxfile.py)
PYTEST_SESSIONS = {"matrix", "tests", "liger", "real", "deepspeed", "compile", "explore", "architectures", "stack"}
SUBCOMMAND_SESSIONS = {"sweep": "sweep", "releases": "releases", "bisect": "bisect", "compare": "diff"}


@cache
def help_flags(*command: str) -> frozenset[str]:
    """The flags a command's own --help lists (pytest's includes the matrix plugin's options)."""
    done = subprocess.run(
        [sys.executable, *command, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert done.returncode == 0, f"{' '.join(command)} --help failed: {done.stderr[-2000:]}"
    return frozenset(FLAG.findall(done.stdout)) | {"--help"}


def pytest_flags() -> frozenset[str]:
    """pytest's, with the matrix's plugin: from its entry point where the package is installed,
    else (a source checkout on a GPU image) loaded by name."""
    flags = help_flags("-m", "pytest")
    return flags if "--model" in flags else help_flags("-m", "pytest", "-p", "matrix.plugin")


# subcommands that take only their own flags; every other hands what it does not know to the
# pytest run of its cells (matrix/__main__.py's parse_known_args)
OWN_FLAGS_ONLY = ("diff", "merge", "compatibility", "curves initial", "curves write")


@cache
def noxfile_flags() -> frozenset[str]:
    """Flags noxfile.py's sessions read from their own arguments before handing the rest on
    (`nox -s compile -- --all`): the "--x" string constants it names."""
    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    return frozenset(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"--[a-z][\w-]*", node.value)
    )


def flags_for(program: str) -> frozenset[str]:
    """`pytest` or a `python -m matrix` subcommand: what it accepts; `run` after a nox session's
    `--` also what the session reads itself."""
    if program == "pytest":
        return pytest_flags()
    own = help_flags("-m", "matrix", *program.split())
    if program in OWN_FLAGS_ONLY:
        return own
    return own | pytest_flags() | (noxfile_flags() if program == "run" else frozenset())


def words_of(segment: str) -> list[str]:
    lexer = shlex.shlex(segment, posix=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    try:
        return list(lexer)
    except ValueError:  # an unclosed quote: a fragment of prose, not a command
        return segment.split()


def given_flags(line: str) -> list[tuple[str, str]]:
    """(program, flag) for each --flag a command line gives a program this test knows: pytest,
    `python -m matrix SUB` (and `curves SUB`), and a nox session's arguments after `--`."""
    found = []
    for segment in re.split(r"&&|\|\||;|\|", line):
        words = words_of(segment)
        program, index = None, 0
        while index < len(words):
            word = words[index]
            if program is None:
                if word == "pytest" or (word == "-m" and words[index + 1 : index + 2] == ["pytest"]):
                    program = "pytest"
                    index += 1 if word == "-m" else 0
                elif word == "-m" and words[index + 1 : index + 2] == ["matrix"] and index + 2 < len(words):
                    sub = words[index + 2]
                    if sub in matrix_subcommands():
                        program = sub
                        if sub == "curves" and index + 3 < len(words) and not words[index + 3].startswith("-"):
                            program = f"curves {words[index + 3]}"
                            index += 1
                        index += 2
                elif word == "nox":
                    sessions = list(named_sessions(segment))
                    if "--" in words[index:]:
                        index = words.index("--", index)
                        base = {s.split("(")[0] for s in sessions}
                        if base and base <= PYTEST_SESSIONS:
                            program = "run"
                        elif len(base) == 1 and (only := base.pop()) in SUBCOMMAND_SESSIONS:
                            program = SUBCOMMAND_SESSIONS[only]
                    if program is None:
                        break
            elif word.startswith("--") and len(word) > 2 and re.fullmatch(r"--[A-Za-z0-9][\w-]*(=.*)?", word):
                found.append((program, word.split("=", 1)[0]))
            index += 1
    return found


# --- the tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_resolves(page):
    problems = broken_links(page)
    assert not problems, f"{rel(page)}: " + "; ".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_nox_session_named_exists(page):
    sessions = nox_sessions()
    unknown = sorted(
        {name for line in code_lines(page.read_text(encoding="utf-8")) for name in named_sessions(line)} - sessions
    )
    assert not unknown, (
        f"{rel(page)}: names nox sessions noxfile.py does not define: {', '.join(unknown)} "
        f"(sessions: {', '.join(sorted(s for s in sessions if '(' not in s))}, and stack(name='X') for X in "
        "matrix/releases/stacks.toml)"
    )


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_python_m_matrix_command_exists(page):
    subcommands = matrix_subcommands()
    problems = []
    for line in code_lines(page.read_text(encoding="utf-8")):
        for module, word in matrix_commands(line):
            if module != "matrix":
                if not module_exists(module):
                    problems.append(f"`python -m {module}`: no module {module.replace('.', '/')}.py")
            elif word and not word.startswith("-") and word not in subcommands and word != "...":
                problems.append(f"`python -m matrix {word}`: not a subcommand of matrix/__main__.py")
    assert not problems, (
        f"{rel(page)}: " + "; ".join(sorted(set(problems))) + f" (subcommands: {', '.join(sorted(subcommands))})"
    )


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_flag_a_command_gives_is_one_it_takes(page):
    problems = sorted(
        {
            f"`{flag}` given to {'pytest' if program == 'pytest' else 'python -m matrix ' + program}"
            for line in code_lines(page.read_text(encoding="utf-8"))
            for program, flag in given_flags(line)
            if flag not in flags_for(program)
        }
    )
    assert not problems, f"{rel(page)}: flags no such command takes: " + "; ".join(problems)


def test_readme_is_a_landing_page():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move reference material to a page in docs/"
    )


def test_readme_links_every_docs_page():
    linked = {
        (README.parent / target.partition("#")[0]).resolve() for target in links(README.read_text(encoding="utf-8"))
    }
    missing = [rel(page) for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]
    assert not missing, f"README.md links no page {', '.join(missing)}: add it to the README's list of docs"


# --- the checks above can fail -----------------------------------------------------------------


def test_a_broken_link_and_a_missing_anchor_are_found(tmp_path):
    (tmp_path / "other.md").write_text("# A heading, with `code` & more\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-heading-with-code--more) [ok](other.md#twice-1) [ok](#local)\n"
        "[bad](missing.md) [bad](other.md#nowhere) [ok](https://example.com/x.md)\n"
        "`[not a link](nowhere.md)`\n\n```\n[not a link either](nowhere.md)\n```\n\n## Local\n"
    )
    problems = broken_links(page)
    assert len(problems) == 2, problems
    assert "'missing.md'" in problems[0] and "does not exist" in problems[0], problems
    assert "#nowhere" in problems[1] and "other.md" in problems[1], problems


def test_unknown_sessions_subcommands_and_modules_are_found():
    assert list(named_sessions("nox -s tests liger -- -k x")) == ["tests", "liger"]
    assert list(named_sessions("""nox -s "stack(name='liger')"   # comment""")) == ["stack(name='liger')"]
    assert list(named_sessions("MATRIX_TORCH='torch==2.6.0' nox -s matrix --no-venv")) == ["matrix"]
    assert "stack(name='liger')" in nox_sessions() and "stack(name='no-such-stack')" not in nox_sessions()
    assert "no-such-session" not in nox_sessions()
    assert {"run", "diff", "merge", "bisect"} <= matrix_subcommands() and "frobnicate" not in matrix_subcommands()
    assert matrix_commands("python -m matrix run cases -n auto") == [("matrix", "run")]
    assert matrix_commands("python -m matrix.tools.bench --write") == [("matrix.tools.bench", "--write")]
    assert module_exists("matrix.tools.bench") and not module_exists("matrix.no_such_module")


def test_a_flag_no_command_takes_is_found():
    assert given_flags("pytest cases --model lora -k x  # --not-a-flag in a comment") == [("pytest", "--model")]
    assert given_flags("nox -s matrix -- --device cpu -n auto") == [("run", "--device")]
    assert given_flags("python -m matrix diff OLD NEW --fail-on new && pytest --lf") == [
        ("diff", "--fail-on"),
        ("pytest", "--lf"),
    ]
    assert given_flags("python -m matrix curves run --write") == [("curves run", "--write")]
    assert given_flags("nox -s sweep -- --package peft") == [("sweep", "--package")]
    assert "--model" in flags_for("pytest") and "--no-such-flag" not in flags_for("pytest")
    assert "--fail-on" in flags_for("diff") and "--model" not in flags_for("diff")
    assert "--cell-timeout" in flags_for("run") and "--lf" in flags_for("run")


def test_anchors_follow_githubs_rule():
    assert slug("The `nox` sessions: every one (v2)") == "the-nox-sessions-every-one-v2"
    assert slug("index.html") == "indexhtml"
    assert slug("A [link](x.md) in a heading") == "a-link-in-a-heading"
