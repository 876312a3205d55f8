"""Tools about the matrix itself, at the top: nothing in the package imports them.

  bench.py         - python -m matrix.tools.bench: the matrix's wall time against its floor (imports
                     plus the cells' compute) and against one process per cell; BENCHMARKS.md
  bench_probe.py   - the pytest plugin the bench loads into its timed runs: what each imported
  import_graph.py  - python -m matrix.tools.import_graph: the package's imports, its layers (LAYERS)
                     and any import circle or upward import
  curve_spread.py  - python -m matrix.tools.curve_spread: the measured spread of right engines' loss
                     curves, written to matrix/checks/curve_spread.json

They measure the matrix; nothing they find changes a verdict.
"""
