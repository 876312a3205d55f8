"""The harness: what runs a cell's phases and every check, for every engine (engines/ supply only their
libraries' calls).

  pipeline.py      - a cell's phases, in the one order they run (PHASES), and the training contract
                     each train_steps checks
  against_references.py - a cell's numbers against its references: the fp32 copy, the torch engine,
                     the loss curves step by step
  round_trips.py   - the reload: the export and the engine's own resume path give back what the run
                     held; a quantized base's two other saves
  compiled_checks.py - a compiled twin's phases recorded and its evaluation against its eager
                     twin's; a float8 run's layers converted
  consensus.py     - work written once for a process group, on whose outcome every rank agrees
  cell_state.py    - what the harness knows of a running cell, typed; CellState.begin, the one way
                     it is made
  library_clock.py - the time inside the engine's library calls (a cell's floor), stood in front of
                     the engine by CellState.begin
  measurements.py  - how the harness measures: evaluations, fp32 references, the models it makes,
                     seeded losses
  torch_step.py    - one optimizer step as the torch loop takes it, and a run of steps
  reference_curves.py - the torch loop's curve at the cell's precision and the fp32 twin's, computed
                     once per process
  fp32_training.py - fp32 training in the torch engine, as the harness measures a kind (the
                     learning-rate search's yardstick)
  garbage.py       - the garbage-collection policy between cells
  resume.py        - a resumed step must equal the run it interrupted
  compiling.py     - torch.compile: the engines' compiled twins, what Dynamo compiled per phase and
                     step, graph breaks, recompilations
  kind_traits.py   - what is established once per kind: traits, learning rate, the fp32 twin's fall
  kind_setup.py    - a kind's one-time work before its first cell (observation, learning rate, the
                     bf16 check), under its own budget, --kind-setup-timeout
  learning_rate.py - the learning rate a kind trains at: searched in fp32, cached on disk
  global_state.py  - the process-global state a cell can change (fp32 matmul precisions, TF32,
                     default dtype, environment, ...): read before each cell and after each phase,
                     put back after it
  group.py         - the processes a cell runs in: one, or the ranks of a process group
"""
