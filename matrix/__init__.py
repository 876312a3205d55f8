"""Mixed-precision regression matrix for the PyTorch LLM stack.

Where things live:
  precisions.py  - the precision table (weights dtype, autocast dtype, grad scaler)
  modes.py       - train / eval
  devices.py     - cpu / cuda, capability probes and skip reasons
  models/        - one tiny model factory per model kind, built from configs in code
                   (liger_llama.py: seed 002, needs triton + liger-kernel: nox -s liger)
  cells.py       - a cell = model x precision x mode x device; enumeration and selection
  tolerances.py  - numeric tolerances as data
  checks.py      - the assertions a cell makes, each failing with a stable message
  phases.py      - what a cell runs (train steps, evaluation, checkpoint round trip)
  signatures.py  - failure signature: phase, exception type, normalized message, origin
  environment.py - versions and devices recorded in every report
  report.py      - results.json, summary.md, junit.xml
  crash_dump.py  - what a crash or timeout record keeps of a dead process's stacks
  catalogue.py   - the known-failure catalogue (known_failures.toml) and outcome classification
  engines/       - torch, accelerate, hf-trainer, lightning: what drives a cell's phases
  variants.py    - the settings the grid holds constant (batch, sizes, cache, loop)
  strategies.py  - hypothesis strategies over valid variants, per model kind and engine
  explore.py     - property-based exploration: shrink a failing variant, say what it needs
"""

SCHEMA_VERSION = 4  # 2: outcomes known/fixed, known_failure per cell, known_failures; 3: explorations;
# 4: per-cell cuda_index, device_name and rerun; run.shard, run.cuda_device, run.merged_from;
# environment.driver_version and driver_cuda_version
