"""Support for one training library that more than one engine uses, one module each:

  accelerate.py    - accelerate's process-wide state, forgotten after a cell, and a run resumed
                     from save_state (the accelerate, accelerate-fsdp2 and Trainer engines)
  trainer.py       - the transformers Trainer's harness side: the batch as a dataset, the recording
                     Trainer, the TrainingArguments, the kinds it can train (hf-trainer,
                     hf-trainer-zero2/3)
  deepspeed.py     - DeepSpeed: its import and accelerator's refusals, what it made of the config,
                     views of its engine in the harness's terms (deepspeed-zero0..3,
                     hf-trainer-zero2/3)
  extension_builds.py - ops a library compiles on first use (DeepSpeed's CPU op): built once before
                     its engine's first cell, in a directory the run owns; a killed build's lock

The engines import them; importing this package imports none of them, nor any library.
"""
