"""The results layer: cell records and their metrics, results.json, summary.md, junit.xml,
index.html, compatibility.md, the run's journal and directory, reading runs back (diff, merge) and
the tables of release sweeps. Standard library only: reading, comparing and merging reports never
imports torch or the stack that produced them (tests/test_import_graph.py imports every module
here with torch blocked). SCHEMA_VERSION, below, is results.json's.

  records.py       - one typed record per cell, and the records of cells that never reached run_cell
  metrics.py       - a cell's metrics, typed (CellMetrics): written by its phases, read back by
                     diff and summary.md
  results.schema.json - results.json's JSON Schema (its `metrics`: metrics.py's metrics_schema())
  document.py      - results.json's document: counts, signature and catalogue indexes
  markdown.py      - summary.md
  reach.py         - what the reports show as grids, and the cells they sum up as "not run here"
  exercised.py     - whether a cell exercised its precision (the autocast its forward ran under)
  tracebacks.py    - a failed cell's traceback as shown: the user's and the libraries' frames,
                     the harness's folded
  run_them.py      - the command that runs the cells of each "not run here" line
  phase_costs.py   - where a run's cell time went: engines and phases
  compatibility.py - compatibility.md: the architecture table of a run's hf: cells
  junit.py         - junit.xml
  html.py          - index.html
  run_directory.py - reports/<run-id>/: created exclusively, written at once, `latest`; a killed
                     run's journal folded into its report
  journal.py       - reports/<run-id>/cells.jsonl, written as cells run
  files.py         - reading a results.json back, checked field by field
  compare.py       - python -m matrix diff
  curves.py        - loss curves: a training cell's curve against its references step by step (the
                     rows' arithmetic), golden curves per stack (matrix/golden/)
  signatures.py    - a failure's signature: phase, exception type, normalized message, origin
  module_moves.py  - where each module of the flat package lives now: the names signatures are
                     written with, and the old import paths (deprecated)
  recording.py     - a run's recording: directory, journal, report (no pytest)
  crash_dump.py    - what a record keeps of a traceback, or of a dead process's stacks
  sweep_table.py   - a release sweep's tables (sweep.md, sweep.html) and docs/RELEASES.md
  gpu_findings.py  - docs/gpu-findings.md, from the GPU runs kept in docs/gpu-runs/
"""

SCHEMA_VERSION = 5  # 2: outcomes known/fixed, known_failure per cell, known_failures; 3: explorations;
# 4: per-cell cuda_index, device_name and rerun; run.shard, run.cuda_device, run.merged_from;
# environment.driver_version and driver_cuda_version; 5: per-cell traceback (and, optional, per-cell
# phase_seconds: runs before it simply have none)
