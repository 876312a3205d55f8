"""The package's module maps are true: each package's __init__.py docstring names every module,
subpackage and data file in its folder, and nothing that is not there; the engine axis' map names
every engine the engine files register; every module has a docstring.

Read from the source only (ast and text): nothing of the matrix package is imported, so no torch.

A map is the block of lines in a package docstring of the form

  name.py          - what it is
  a.py, b.toml     - what they are, together
  sub/             - a subpackage (or a folder of data)
                     a continuation line, indented further
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "matrix"
ENGINES = PACKAGE / "engines"

_KEY = r"(?:[A-Za-z_][\w.-]*\.(?:py|toml|json)|[A-Za-z_][\w-]*/)"
_ENTRY = re.compile(rf"^(?P<indent> {{2,}})(?P<keys>{_KEY}(?:, {_KEY})*)\s+- (?P<text>.*)$")


def rel(path: Path) -> str:
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return path.as_posix()


def module_docstring(path: Path) -> str | None:
    """The module's docstring as written (not dedented: a map's indentation is what marks it)."""
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), clean=False)


def ignored(path: Path) -> bool:
    return path.name.startswith(".") or path.name == "__pycache__" or path.suffix in (".pyc", ".pyo")


def packages() -> list[Path]:
    """matrix/ and every folder under it that is a package (has an __init__.py)."""
    return sorted(
        init.parent
        for init in PACKAGE.rglob("__init__.py")
        if not any(part.startswith(".") or part == "__pycache__" for part in init.relative_to(PACKAGE).parts)
    )


def map_entries(docstring: str) -> dict[str, str]:
    """key -> its entry's text (its line and its continuation lines), for every key of the map."""
    entries: dict[str, str] = {}
    current: tuple[list[str], int] | None = None
    for line in docstring.splitlines():
        found = _ENTRY.match(line)
        if found:
            keys = found.group("keys").split(", ")
            current = (keys, len(found.group("indent")))
            for key in keys:
                entries[key] = found.group("text")
        elif current and line.strip() and len(line) - len(line.lstrip(" ")) > current[1]:
            for key in current[0]:
                entries[key] += " " + line.strip()
        else:
            current = None
    return entries


def expected_entries(package: Path) -> set[str]:
    """What a package's map must name: every file beside its __init__.py (modules, __main__.py,
    data files) and every folder (subpackage or data), as `name/`."""
    found = set()
    for path in package.iterdir():
        if ignored(path) or path.name == "__init__.py":
            continue
        found.add(f"{path.name}/" if path.is_dir() else path.name)
    return found


def map_problems(package: Path) -> list[str]:
    """What is wrong with `package`'s map, one line each, naming the file and the entry."""
    init = package / "__init__.py"
    docstring = module_docstring(init)
    if not docstring:
        return [f"{rel(init)}: no docstring, so no map of {rel(package)}/"]
    named = set(map_entries(docstring))
    expected = expected_entries(package)
    problems = [
        f"{rel(init)}: the map has no entry for {name} (add a line `{name} - what it is` to the docstring)"
        for name in sorted(expected - named)
    ]
    problems += [
        f"{rel(init)}: the map names {name}, which is not in {rel(package)}/ (remove or rename its entry)"
        for name in sorted(named - expected)
    ]
    return problems


# ---------------------------------------------------------------- engine names, read from the source


def _literal(node: ast.AST, constants: dict[str, object]):
    """The value of a literal, a module-level constant's name, or range(...) of literals."""
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range" and not node.keywords:
        return range(*(_literal(arg, constants) for arg in node.args))
    return ast.literal_eval(node)


def _module_constants(tree: ast.Module) -> dict[str, object]:
    constants = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                constants[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return constants


class _Template:
    """How an engine class names its instances: a class attribute `name = "..."`, or
    `self.name = <a string or an f-string of __init__'s parameters>` in __init__."""

    def __init__(self, node: ast.expr, parameters: list[str]) -> None:
        self.node, self.parameters = node, parameters

    def name(self, call: ast.Call, constants: dict[str, object], values: dict[str, object]) -> str:
        bound = dict(zip(self.parameters, call.args, strict=False))
        bound.update({k.arg: k.value for k in call.keywords if k.arg})
        scope = {
            p: values[a.id] if isinstance(a, ast.Name) and a.id in values else _literal(a, constants)
            for p, a in bound.items()
        }
        if isinstance(self.node, ast.Constant) and isinstance(self.node.value, str):
            return self.node.value
        if isinstance(self.node, ast.JoinedStr):
            parts = []
            for part in self.node.values:
                if isinstance(part, ast.Constant):
                    parts.append(str(part.value))
                elif isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name):
                    parts.append(format(scope[part.value.id]))
                else:
                    raise ValueError(ast.unparse(part))
            return "".join(parts)
        raise ValueError(ast.unparse(self.node))


def _template(cls: ast.ClassDef) -> _Template | None:
    for node in cls.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "name" for t in node.targets)) or (
            isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "name"
        ):
            if node.value is not None:
                return _Template(node.value, [])
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            parameters = [a.arg for a in node.args.args[1:]]
            for inner in ast.walk(node):
                if isinstance(inner, ast.Assign) and any(
                    isinstance(t, ast.Attribute)
                    and t.attr == "name"
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "self"
                    for t in inner.targets
                ):
                    return _Template(inner.value, parameters)
    return None


def _bindings(node: ast.AST, parents: dict[ast.AST, ast.AST], constants: dict[str, object]):
    """Every binding of the loop variables around `node` (for loops and comprehensions whose
    iterable is a literal or a module constant), as dicts name -> value."""
    loops = []
    child, parent = node, parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.For) and child is not parent.iter and isinstance(parent.target, ast.Name):
            loops.append((parent.target.id, parent.iter))
        if isinstance(parent, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            loops += [(g.target.id, g.iter) for g in parent.generators if isinstance(g.target, ast.Name)]
        child, parent = parent, parents.get(parent)
    bindings = [{}]
    for variable, iterable in loops:
        bindings = [{**b, variable: value} for b in bindings for value in _literal(iterable, constants)]
    return bindings


def registered_engines() -> dict[str, str]:
    """Engine name -> the file under matrix/engines/ that registers it: every instance of an engine
    class (a class whose bases lead to Engine) made at a module's top level, its name read from
    the class (its own or a base's) and the arguments it is made with."""
    trees = {path: ast.parse(path.read_text(encoding="utf-8"), filename=str(path)) for path in ENGINES.glob("*.py")}
    classes: dict[str, tuple[ast.ClassDef, Path]] = {}
    for path, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (node, path)

    def bases(name: str) -> list[str]:
        return [b.id for b in classes[name][0].bases if isinstance(b, ast.Name)] if name in classes else []

    def is_engine(name: str, seen=()) -> bool:
        return name == "Engine" or any(b not in seen and is_engine(b, (*seen, name)) for b in bases(name))

    def template(name: str) -> _Template | None:
        if name not in classes:
            return None
        return _template(classes[name][0]) or next(filter(None, (template(b) for b in bases(name))), None)

    found: dict[str, str] = {}
    for path, tree in sorted(trees.items()):
        constants = _module_constants(tree)
        parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        for statement in tree.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for node in ast.walk(statement):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                    continue
                cls = node.func.id
                if cls not in classes or not is_engine(cls):
                    continue
                named = template(cls)
                if named is None:
                    raise AssertionError(f"{rel(path)}, line {node.lineno}: {cls} is made here but has no `name`")
                try:
                    for values in _bindings(node, parents, constants):
                        found[named.name(node, constants, values)] = path.name
                        # register_with_compiled_twin(Engine()) registers `<name>-compile` beside it
                        outer = parents.get(node)
                        if (
                            isinstance(outer, ast.Call)
                            and getattr(outer.func, "id", None) == "register_with_compiled_twin"
                        ):
                            found[named.name(node, constants, values) + "-compile"] = path.name
                except (ValueError, KeyError, TypeError) as error:
                    raise AssertionError(
                        f"{rel(path)}, line {node.lineno}: cannot read the name of the engine {cls} makes here "
                        f'({error}); tests/test_module_maps.py reads `name = "..."` or `self.name = f"..."` '
                        "of literal arguments"
                    ) from None
    return found


# ---------------------------------------------------------------- the tests


def test_every_module_has_a_docstring():
    missing = [rel(path) for path in sorted(PACKAGE.rglob("*.py")) if not ignored(path) and not module_docstring(path)]
    assert not missing, "modules without a module docstring: " + ", ".join(missing)


@pytest.mark.parametrize("package", packages(), ids=lambda p: rel(p))
def test_package_map_names_every_entry(package):
    problems = map_problems(package)
    assert not problems, "\n".join(problems)


def layers() -> tuple[str, ...]:
    """matrix/tools/import_graph.py LAYERS, read from its source."""
    tree = ast.parse((PACKAGE / "tools" / "import_graph.py").read_text(encoding="utf-8"))
    found = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "LAYERS")
    return ast.literal_eval(found.value)


def test_the_packages_have_maps():
    """The maps checked above are the packages there are: matrix/, one folder per layer, and the two
    subpackages (an engine library's support, the repro scripts' parts' generator)."""
    names = {rel(p) for p in packages()}
    assert len(layers()) > 10
    assert names == {
        "matrix",
        *(f"matrix/{layer}" for layer in layers()),
        "matrix/engines/libraries",
        "matrix/releases/repro",
    }


def test_the_top_level_holds_only_the_package_map_and_the_command():
    """Every module lives in a layer's folder: at the top only __init__.py (the map) and __main__.py."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "__main__.py"], top


def test_every_engine_file_registers_engines_that_are_read():
    """The engine names come from the source: every file that calls register() gives at least one."""
    engines = registered_engines()
    by_file = set(engines.values())
    silent = [
        rel(path)
        for path in sorted(ENGINES.glob("*.py"))
        if path.name not in ("__init__.py", "base.py")
        and re.search(r"^\s*(?:for .*:\s*)?register\(", path.read_text(encoding="utf-8"), re.MULTILINE)
        and path.name not in by_file
    ]
    assert not silent, f"these files register engines whose names tests/test_module_maps.py cannot read: {silent}"
    assert "torch" in engines


def test_engine_map_names_every_registered_engine():
    init = ENGINES / "__init__.py"
    docstring = module_docstring(init) or ""
    entries = map_entries(docstring)
    problems = []
    for engine, filename in sorted(registered_engines().items()):
        if f"`{engine}`" not in entries.get(filename, ""):
            problems.append(
                f"{rel(init)}: engine `{engine}` (registered in {rel(ENGINES / filename)}) is not named, as "
                f"`{engine}`, in the map's {filename} entry"
            )
    problems += [
        f"{rel(init)}: the docstring names `{name}`, which no file in {rel(ENGINES)}/ registers"
        for name in sorted(set(re.findall(r"`([^`\s]+)`", docstring)) - set(registered_engines()))
    ]
    assert not problems, "\n".join(problems)


def test_a_module_missing_from_a_map_is_named(tmp_path):
    """The check itself: a module added without an entry, and an entry without a module, are named."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "sub" / "__init__.py").write_text('"""sub."""\n')
    (package / "__init__.py").write_text(
        '"""A package.\n\n'
        "  one.py           - the first module\n"
        "                     over two lines\n"
        "  gone.py, data.toml - a module no longer there, and data\n"
        "  sub/             - a subpackage\n"
        '"""\n'
    )
    for name in ("one.py", "two.py", "data.toml"):
        (package / name).write_text('"""A module."""\n')
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "one.cpython-311.pyc").write_bytes(b"")
    problems = map_problems(package)
    assert len(problems) == 2, problems
    assert "pkg/__init__.py" in problems[0] and "no entry for two.py" in problems[0]
    assert "pkg/__init__.py" in problems[1] and "names gone.py" in problems[1]
    assert map_entries(module_docstring(package / "__init__.py"))["one.py"] == "the first module over two lines"


def test_the_layout_page_names_every_folder_in_layer_order():
    """docs/layout.md's table of layers is the tree's: every folder, bottom to top, and every module
    path it names exists."""
    page = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    named = re.findall(r"^\| `matrix/(\w+)/` \|", page, re.MULTILINE)
    assert named == list(layers())
    for path in re.findall(r"`(matrix/[\w/]+(?:\.py|\.toml|\.json|/))`", page):
        assert (ROOT / path).exists(), f"docs/layout.md names {path}, which is not in the tree"
    for folder, module in re.findall(r"^\| `matrix/(\w+)/` \|(.*)$", page, re.MULTILINE):
        for name in re.findall(r"`(\w+\.(?:py|toml|json))`", module):
            assert (PACKAGE / folder / name).exists() or (PACKAGE / folder / "libraries" / name).exists(), (
                f"docs/layout.md's row for {folder}/ names {name}, which is not there"
            )
