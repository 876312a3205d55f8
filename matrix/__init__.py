"""Mixed-precision regression matrix for the PyTorch LLM stack.

Where things live (one home each):
  __main__.py      - python -m matrix: run, fold, bisect, sweep, releases, repro, triage, replay, diff, merge, curves,
                     compatibility
  registry.py      - the registry of every axis but the modes (models, precisions, engines, devices):
                     register(), lookup, order, names made on demand (hf:<model_type>)
  cell.py          - a cell = model x precision x mode x device x engine, and its id
  precisions.py    - the precision table: one row per precision; engines derive their settings
  float8.py        - float8 training (torchao): a float8 precision's recipe, the conversion users
                     run, the layers it converts and leaves out, SQNR
  compiling.py     - torch.compile: the engines' compiled twins, what Dynamo compiled per phase and
                     step, graph breaks, recompilations
  modes.py         - train / eval
  devices/         - one file per device (cpu.py, cuda.py): probe, skip reason, placement,
                     process-poisoning errors, environment capture
  models/          - one file per model kind, built from configs in code or from installed files
                     (nothing is downloaded);
                     hf_architecture.py makes hf:<model_type> / hf:<path> kinds on demand, from
                     tiny configs that hf_shrink.py builds by the rules in hf_shrink_rules.toml
  engines/         - one file per engine (torch, accelerate, hf-trainer, lightning, ddp, fsdp2,
                     accelerate-fsdp2, deepspeed-zero0..3, hf-trainer-zero2/3): what its library
                     does to a cell, and the settings it derives from a precision; base.py says
                     what an engine supplies, distributed.py runs a cell in the ranks
  libraries/       - support for a library several engines share (accelerate, the Trainer, DeepSpeed)
  selection.py     - axis values from the registries, --model a,b selection, enumeration, the cell
                     a test id names
  shards.py        - --shard K/N
  variants.py      - the settings the grid holds constant (batch, sizes, cache, loop)
  tolerances.py    - numeric tolerances as data; the loss-curve rows derived from curve_spread.json
  curve_spread.py  - python -m matrix.curve_spread: the largest deviation of right engines' loss curves
                     per reference, engine family and dtype, from runs' results.json, written to
                     curve_spread.json
  curve_spread.json - data: the one place the curve rows' measurement lives, and the kinds it measured
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
  kind_setup.py    - a kind's one-time work before its first cell (observation, learning rate, the
                     bf16 check), under its own budget, --kind-setup-timeout
  extension_builds.py - ops a library compiles on first use (DeepSpeed's CPU op): built once before
                     its engine's first cell, in a directory the run owns; a killed build's lock
  schedule.py      - the steps every training cell runs, and the seeds of its random numbers
  group.py         - the processes a cell runs in: one, or the ranks of a process group
  rank_pool.py, rank_worker.py - the run's group of ranks the distributed engines use
  resume.py        - a resumed step must equal the run it interrupted
  curves.py        - loss curves: a training cell's curve against its references step by step, golden
                     curves per stack (matrix/golden/), standard library only
  initial_weights.py - the saved initial weights and batch a run's models start from (--initial-weights)
  golden/          - the golden curves of each stack (curves-<stack>.json) and the initial weights they
                     start from (initial/<kind>.safetensors): data, written by nox -s curves
  execute.py       - running a cell and classifying its record (no pytest)
  signatures.py    - failure signature: phase, exception type, normalized message, origin
  catalogue.py     - the known-failure catalogue: loading, selectors, classification (known, failed,
                     fixed, inapplicable)
  conditions.py    - the named conditions a catalogue entry is in force under (`when`): the hardware
                     (what decides a kernel), the run's settings, what the cell observed
  known_failures.toml - the built-in catalogue's entries (users' files add to them)
  packages.py      - the packages the matrix knows by name: their versions, whether one is
                     installed, and the one line (how to install it) a kind, engine or precision
                     without it skips with
  environment.py   - versions and devices recorded in every report
  results/         - records and metrics, results.json, summary.md, junit.xml, index.html,
                     compatibility.md, the journal, diff and merge, sweep tables: standard
                     library only
  recording.py     - a run's recording: directory, journal, report (no pytest)
  options.py       - the matrix's command-line options, one table for the plugin and
                     python -m matrix run
  cell_environment.py - the environment variables the cells run under, set only while they run
  global_state.py  - the process-global state a cell can change (fp32 matmul precisions, TF32, default
                     dtype, environment, ...): read before each cell and after each phase, put back
                     after it, and named as the cell's leaked_state
  plugin.py        - the pytest plugin (entry point pytest11: matrix): hooks and fixtures; no
                     torch until the matrix is used
  pytest_cases.py  - the matrix's two tests, test_cell and test_explore
  runner.py        - python -m matrix run: the crash- and hang-surviving supervisor
  internal_errors.py - the pytest plugin runner.py loads into pytest: an internal error's traceback kept
  strategies.py, explore.py - hypothesis exploration of the variants the grid does not run
  repro/           - python -m matrix repro: one cell as a standalone script (the engine's library
                     calls, the references and the checks with their allowances; upstream imports only)
  triage.py        - python -m matrix triage: each new signature's smallest cell as a standalone
                     script in a fresh process: reproduces, does not reproduce, another failure
  bisect.py        - python -m matrix bisect: the release of a package that changed one cell
  stacks.py, stacks.toml - pinned version stacks: the stacks, and their reader (noxfile.py
                     imports it: standard library and packaging only)
  sweep.py         - python -m matrix sweep / releases: one selection over several releases of a
                     package; results/sweep_table.py renders it
  releases.toml    - the published compatibility table's sweeps (python -m matrix releases)
  release_bisect.py - the nightly diff's bisection of new failures over the changed packages
  quantization.py  - bitsandbytes quantized bases: schemes, storage checks, the install requirement
  import_graph.py  - the package's import graph (python -m matrix.import_graph)
  bench.py         - python -m matrix.bench: the matrix's wall time against its floor (imports plus
                     the cells' compute) and against one process per cell; BENCHMARKS.md
  bench_probe.py   - the pytest plugin the bench loads into its timed runs: what each imported
"""
