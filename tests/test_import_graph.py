"""The package's import graph (matrix/tools/import_graph.py): no import circles, and the results
layer reaches no torch, statically and when imported with torch blocked."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from matrix.tools import import_graph

ROOT = Path(__file__).resolve().parent.parent
RESULTS_LAYER = ("matrix.grid", "matrix.results", "matrix.shards")  # the folders that never reach torch
STACK = {
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "lightning",
    "safetensors",
    "triton",
    "numpy",
    "bitsandbytes",
    "deepspeed",
}


def test_the_package_has_no_import_circles():
    edges, _ = import_graph.graph()
    assert len(edges) > 40  # the whole package was read, not an empty directory
    assert import_graph.cycles(edges) == []


def test_the_cycle_finder_finds_a_circle_it_is_given():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_graph.cycles(edges) == [["a", "b", "c"]]
    assert import_graph.cycles({"a": {"b"}, "b": set()}) == []


def test_a_lazy_import_inside_a_function_counts(tmp_path, monkeypatch):
    package = tmp_path / "matrix"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from matrix import b\n")
    (package / "b.py").write_text("def f():\n    from matrix.a import thing\n")
    monkeypatch.setattr(import_graph, "PACKAGE", package)
    edges, _ = import_graph.graph()
    assert edges["matrix.a"] == {"matrix.b"} and edges["matrix.b"] == {"matrix.a"}
    assert import_graph.cycles(edges) == [["matrix.a", "matrix.b"]]


def test_the_results_layer_reaches_no_torch_in_its_source():
    edges, external = import_graph.graph()
    layer = [m for m in edges if any(m == p or m.startswith(p + ".") for p in RESULTS_LAYER)]
    assert "matrix.results.compare" in layer and "matrix.shards.merge" in layer
    for module in layer:
        reached = import_graph.reachable(edges, module)
        stack = {(m, package) for m in reached for package in external[m] & STACK}
        assert not stack, f"{module} reaches {sorted(stack)}"


BLOCKED_TORCH = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys, tempfile
    from pathlib import Path

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {stack}:
                raise ImportError(f"blocked: {{name}}")

    sys.meta_path.insert(0, Blocked())
    import matrix.results
    names = [f"matrix.results.{{m.name}}" for m in pkgutil.iter_modules(matrix.results.__path__)]
    for name in [*names, "matrix.grid.cell", "matrix.shards.plan", "matrix.grid.packages", "matrix.results.recording"]:
        importlib.import_module(name)

    # the layer at work: a run recorded, written, read back, diffed and merged
    from matrix.grid.cell import Cell
    from matrix.results.recording import RunRecorder
    from matrix.results import compare, files, merge, records

    root = Path(tempfile.mkdtemp())
    run = RunRecorder(root, "blocked-torch")
    header = {{"id": "blocked-torch", "command": "test", "started_at": "2026-11-23T00:00:00Z"}}
    run.start({{"m-fp32-eval-cpu-torch"}}, header, lambda: {{"packages": {{}}}}, {{}})
    run.store(records.CellRecord.of(Cell("m", "fp32", "eval", "cpu"), "passed"))
    run.finish(0)
    run.close()
    document, _ = files.load(root / "blocked-torch")
    diff = compare.diff(document, document)
    merged = merge.merge([root / "blocked-torch"], run_id="m")
    print(json.dumps({{"modules": sorted(m for m in sys.modules if m.startswith("matrix")),
                       "cells": len(document["cells"]), "gating": diff.gating(("new",)),
                       "merged": len(merged["cells"]), "torch": "torch" in sys.modules}}))
    """
)


def test_the_results_layer_imports_and_works_with_torch_blocked():
    script = BLOCKED_TORCH.format(stack=sorted(STACK))
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["torch"] is False
    assert "matrix.shards.merge" in found["modules"] and "matrix.results.recording" in found["modules"]
    assert found["cells"] == 1 and found["merged"] == 1 and not found["gating"]


def test_blocking_torch_really_blocks_it():
    """The blocker is not a no-op: importing the execution side fails under it."""
    script = BLOCKED_TORCH.split("sys.meta_path.insert(0, Blocked())")[0].format(stack=sorted(STACK))
    script += "sys.meta_path.insert(0, Blocked())\nimport matrix.precisions.policies\n"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "blocked: torch" in done.stderr


WITHOUT_PYTEST = textwrap.dedent(
    """
    import json, sys, tempfile
    from pathlib import Path

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("pytest", "_pytest", "xdist", "pytest_timeout"):
                raise ImportError(f"blocked: {name}")

    sys.meta_path.insert(0, Blocked())
    from matrix.catalogue import entries as catalogue
    from matrix.devices import fingerprint as environment
    from matrix.grid.cell import Cell
    from matrix.execute.cell_run import run_and_record
    from matrix.results.recording import RunRecorder

    root = Path(tempfile.mkdtemp())
    cell = Cell("tiny-llama", "fp16-true", "train", "cpu", "torch")
    done = run_and_record(cell, root / "work", catalogue.assemble(), environment.package_versions())
    run = RunRecorder(root, "no-pytest")
    header = {"id": "no-pytest", "command": "python -c ...", "started_at": "2026-11-23T00:00:00Z"}
    run.start({cell.id}, header, lambda: {}, {})
    run.store(done.record)
    run.finish(0)
    run.close()
    written = json.loads((root / "no-pytest" / "results.json").read_text())
    print(json.dumps({"outcome": done.outcome, "entry": done.entry.id, "cells": written["counts"],
                      "pytest": any(m.startswith(("pytest", "_pytest")) for m in sys.modules)}))
    """
)


def test_a_cell_runs_and_a_run_is_recorded_without_pytest():
    """The run logic lives in the package: pytest's plugin only feeds it."""
    done = subprocess.run([sys.executable, "-c", WITHOUT_PYTEST], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["pytest"] is False
    assert (found["outcome"], found["entry"]) == ("known", "adamw-fp16-eps-underflow")
    assert found["cells"]["known"] == 1


LIBRARIES = ("transformers", "peft", "accelerate", "lightning", "liger_kernel")
LAZY = """
import sys
import matrix.plugin
loaded_by_the_plugin = sorted(name for name in ("torch", *{libraries!r}) if name in sys.modules)
import matrix.models, matrix.engines
from matrix.execute.cell_run import run_cell
from matrix.grid.cell import Cell
loaded_first = sorted(name for name in {libraries!r} if name in sys.modules)
import tempfile, pathlib
with tempfile.TemporaryDirectory() as workdir:
    result = run_cell(Cell("tiny-transformer", "fp32", "train", "cpu", "torch"), pathlib.Path(workdir))
loaded_after_torch_cell = sorted(name for name in {libraries!r} if name in sys.modules)
with tempfile.TemporaryDirectory() as workdir:
    llama = run_cell(Cell("lora", "fp32", "eval", "cpu", "accelerate"), pathlib.Path(workdir))
loaded_last = sorted(n for n in {libraries!r} if n in sys.modules)
print(loaded_by_the_plugin, loaded_first, loaded_after_torch_cell, result.outcome, llama.outcome, loaded_last)
"""


def test_the_plugin_imports_no_torch_and_the_kinds_and_engines_no_library_until_a_cell_needs_it():
    """pytest loads the plugin in every session of an environment that has the package: importing
    it imports no torch (a project's own tests that never select a cell pay nothing). Importing
    transformers' model classes, peft and Lightning costs seconds of CPU; a process that
    collects, refuses its input or runs only torch-engine cells of torch's own models pays none
    of it. A cell that needs a library still gets it."""
    script = LAZY.format(libraries=LIBRARIES)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("[] [] [] passed passed ['accelerate', 'peft', 'transformers']"), line


PLUGIN_WITHOUT_THE_STACK = textwrap.dedent(
    """
    import json, os, sys

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {stack}:
                raise ImportError(f"blocked: {{name}}")

    sys.meta_path.insert(0, Blocked())
    environ = dict(os.environ)
    import matrix.plugin

    added = []

    class Group:
        def addoption(self, flag, **kwargs):
            added.append(flag)

    class Parser:
        def getgroup(self, name, description=""):
            return Group()

    matrix.plugin.pytest_addoption(Parser())
    print(json.dumps({{"options": added, "environ_untouched": dict(os.environ) == environ}}))
    """
)


def test_the_plugin_imports_and_adds_its_options_with_the_stack_blocked():
    """What pytest does with the plugin in any session, before a matrix test is collected."""
    from matrix.run import options

    script = PLUGIN_WITHOUT_THE_STACK.format(stack=sorted(STACK))
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["options"] == [option.flag for option in options.OPTIONS] and "--cell-timeout" in found["options"]
    assert found["environ_untouched"] is True


def test_every_import_points_down_the_layers():
    """The folders are layers (matrix/tools/import_graph.py LAYERS): no module imports a folder above
    its own, and every module but matrix/__init__.py and __main__.py is in a folder."""
    edges, _ = import_graph.graph()
    assert {import_graph.layer_of(m) for m in edges} >= set(import_graph.LAYERS)  # every layer was read
    assert import_graph.upward_imports(edges) == []


def test_the_layer_check_fails_on_an_upward_import(tmp_path, monkeypatch):
    """A module of the bottom layer importing one of the top (lazily, inside a function), and a module
    left outside the folders, are each reported, and the command exits 1."""
    package = tmp_path / "matrix"
    for folder in ("grid", "tools"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text('"""map"""\n')
    (package / "__init__.py").write_text('"""map"""\n')
    (package / "grid" / "cell.py").write_text("def f():\n    from matrix.tools import bench\n")
    (package / "grid" / "registry.py").write_text("from matrix.grid import cell\n")  # its own folder: fine
    (package / "tools" / "bench.py").write_text("from matrix.grid import registry\n")  # downward: fine
    (package / "stray.py").write_text("")
    monkeypatch.setattr(import_graph, "PACKAGE", package)
    edges, _ = import_graph.graph()
    assert import_graph.upward_imports(edges) == [
        ("matrix.grid.cell", "matrix.tools.bench"),
        ("matrix.stray", "<no layer>"),
    ]
    assert import_graph.main([]) == 1


def test_the_real_graph_with_one_upward_import_added_fails():
    edges, _ = import_graph.graph()
    edges["matrix.results.records"] = {*edges["matrix.results.records"], "matrix.harness.pipeline"}
    assert import_graph.upward_imports(edges) == [("matrix.results.records", "matrix.harness.pipeline")]
