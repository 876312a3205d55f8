"""This checkout's pytest configuration. The matrix's plugin (matrix/plugin/hooks.py) is loaded by
its `pytest11` entry point once the package is installed (`pip install -e .`, or nox); from a
checkout without that, `pytest -p matrix.plugin` loads it by hand."""
