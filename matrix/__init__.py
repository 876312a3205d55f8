"""Mixed-precision regression matrix for the PyTorch LLM stack.

Where things live (one home each):
  registry.py      - the registry every axis and the catalogue use: register(), lookup, order
  cell.py          - a cell = model x precision x mode x device x engine, and its id
  precisions.py    - the precision table: one row per precision; engines derive their settings
  modes.py         - train / eval
  devices/         - one file per device (cpu.py, cuda.py): probe, skip reason, placement,
                     process-poisoning errors, environment capture
  models/          - one file per model kind, built from configs in code (nothing is downloaded);
                     hf_architecture.py makes hf:<model_type> / hf:<path> kinds on demand, from
                     tiny configs that hf_shrink.py builds by the rules in hf_shrink_rules.toml
  engines/         - one file per engine (torch, accelerate, hf-trainer, lightning, ddp, fsdp2,
                     accelerate-fsdp2, deepspeed-zero0..3, hf-trainer-zero2/3): what its library
                     does to a cell, and the settings it derives from a precision; base.py says
                     what an engine supplies, distributed.py runs a cell in the ranks
  libraries/       - support for a library two engines share (accelerate, the Trainer, DeepSpeed)
  selection.py     - axis values from the registries, --model a,b selection, enumeration
  shards.py        - --shard K/N
  variants.py      - the settings the grid holds constant (batch, sizes, cache, loop)
  tolerances.py    - numeric tolerances as data
  checks.py        - the assertions a cell makes, each failing with a stable message
  declared_dtypes.py - the dtypes weights must have, with what an architecture keeps in fp32
  observation.py   - what the harness observes on a model kind: traits, loss items, frozen and
                     gradless parameters
  learning_rate.py - the learning rate a kind trains at: searched in fp32, cached on disk
  pipeline.py      - a cell's pipeline, owned by the harness: every phase and every check, for
                     every engine (one edit here adds a check to all of them)
  cell_state.py    - what the harness knows of a running cell, typed
  measurements.py  - how the harness measures: evaluations, fp32 references, seeded losses, a step
  kind_traits.py   - what is established once per kind: traits, learning rate, the fp32 twin's fall
  schedule.py      - the steps every training cell runs, and the seeds of its random numbers
  group.py         - the processes a cell runs in: one, or the ranks of a process group
  rank_pool.py, rank_worker.py - the run's group of ranks the distributed engines use
  resume.py        - a resumed step must equal the run it interrupted
  execute.py       - running a cell and classifying its record (no pytest)
  signatures.py    - failure signature: phase, exception type, normalized message, origin
  catalogue.py     - the known-failure catalogue (known_failures.toml, plus users' files)
  packages.py      - the packages the matrix knows by name, and their versions
  environment.py   - versions and devices recorded in every report
  results/         - records, results.json, summary.md, junit.xml, index.html, the journal,
                     diff and merge: standard library only
  recording.py     - a run's recording: directory, journal, report (no pytest)
  options.py       - every command-line option, for the plugin and python -m matrix run
  cell_environment.py - the environment variables the cells run under, set only while they run
  plugin.py        - the pytest plugin (entry point pytest11: matrix): hooks and fixtures; no
                     torch until the matrix is used
  pytest_cases.py  - the matrix's two tests, test_cell and test_explore
  runner.py        - python -m matrix run: the crash- and hang-surviving supervisor
  strategies.py, explore.py - hypothesis exploration of the variants the grid does not run
  repro.py, bisect.py, stacks.py - standalone scripts, bisection, pinned version stacks
  sweep.py         - one selection over several releases of a package (releases.toml: the
                     published table's sweeps); results/sweep_table.py renders it
  release_bisect.py - the nightly diff's bisection of new failures over the changed packages
  quantization.py  - bitsandbytes quantized bases: schemes, storage checks, the install requirement
  import_graph.py  - the package's import graph (python -m matrix.import_graph)
"""
