"""The results layer: cell records, results.json, summary.md, junit.xml, index.html, the run's
journal and directory, and reading runs back (diff, merge). Standard library only: reading,
comparing and merging reports never imports torch or the stack that produced them
(tests/test_import_graph.py imports every module here with torch blocked).

  records.py       - one typed record per cell, and the records of cells that never reached run_cell
  document.py      - results.json's document: counts, signature and catalogue indexes
  markdown.py      - summary.md
  phase_costs.py   - where a run's cell time went: engines and phases
  compatibility.py - compatibility.md: the architecture table of a run's hf: cells
  junit.py         - junit.xml
  html.py          - index.html
  run_directory.py - reports/<run-id>/: created exclusively, written at once, `latest`
  journal.py       - reports/<run-id>/cells.jsonl, written as cells run
  files.py         - reading a results.json back, checked field by field
  compare.py       - python -m matrix diff
  merge.py         - python -m matrix merge
  crash_dump.py    - what a record keeps of a traceback, or of a dead process's stacks
"""

SCHEMA_VERSION = 5  # 2: outcomes known/fixed, known_failure per cell, known_failures; 3: explorations;
# 4: per-cell cuda_index, device_name and rerun; run.shard, run.cuda_device, run.merged_from;
# environment.driver_version and driver_cuda_version; 5: per-cell traceback (and, optional, per-cell
# phase_seconds: runs before it simply have none)
