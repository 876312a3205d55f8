"""The engine axis: what one training library does to a cell (the harness's pipeline,
matrix/harness/pipeline.py, does the rest). `torch` is a hand-written loop; the others run the real
library. The files, and the engines each registers, in the axis' order:

  base.py          - what an engine supplies (Engine; Loop, LibraryLoop: who owns the loop), the
                     ENGINES registry, and the check that the harness can see into an engine's runs
  traits.py        - ENGINE_TRAITS: what an engine's library does that catalogue entries select by
  torch_loop.py    - `torch`: torch.autocast and GradScaler around a hand-written loop; its
                     checkpoint format, which ddp shares; `torch-compile`, its compiled twin
  accelerate_loop.py - `accelerate`: Accelerator(mixed_precision=...), prepare, save_state /
                     load_state; `accelerate-compile`
  hf_trainer.py    - `hf-trainer`: the transformers Trainer's own loop, resume_from_checkpoint;
                     `hf-trainer-compile`
  lightning_loop.py - `lightning`: a Lightning Trainer(precision=...)'s fit(), ckpt_path resume;
                     `lightning-compile`
  library_loop.py  - LibraryLoop: a loop the library owns (the Trainer's, Lightning's), replayed to
                     the harness as if it paused after step k
  distributed.py   - what the distributed engines share: DistributedEngine, the launcher variables,
                     sharded weights gathered (matrix/execute/ranks.py runs their cells on the ranks)
  ddp.py           - `ddp`: DistributedDataParallel, with compress hooks for half-precision reduction;
                     `ddp-compile`
  fsdp2.py         - `fsdp2`: fully_shard with a MixedPrecisionPolicy, DCP checkpoints; `fsdp2-compile`
  accelerate_fsdp2.py - `accelerate-fsdp2`: accelerate's FSDP2 plugin (selected by hand on a CPU);
                     `accelerate-fsdp2-compile`
  deepspeed_zero.py - `deepspeed-zero0`, `deepspeed-zero1`, `deepspeed-zero2`, `deepspeed-zero3`:
                     DeepSpeed's own engine, one per ZeRO stage; `deepspeed-zero0-compile`,
                     `deepspeed-zero1-compile`, `deepspeed-zero2-compile`, `deepspeed-zero3-compile`
  hf_trainer_deepspeed.py - `hf-trainer-zero2`, `hf-trainer-zero3`: the Trainer with a DeepSpeed
                     config of that ZeRO stage; `hf-trainer-zero2-compile`, `hf-trainer-zero3-compile`
  libraries/       - support for a library several engines share (accelerate, the Trainer,
                     DeepSpeed), and the ops a library compiles on first use

Every engine registers a compiled twin beside it (base.py register_with_compiled_twin,
matrix/harness/compiling.py), which runs only where a selection names it.

A new engine is one file here (an Engine subclass and a register() call) plus its library in
pyproject.toml; a user's engine registers from their plugin.
"""

from __future__ import annotations

from matrix.engines.base import (
    ENGINES,
    Engine,
    EngineIncomplete,
    EngineSettings,
    Loop,
    LoopRun,
    Steps,
    Unsupported,
    register,
)
from matrix.engines.library_loop import LibraryLoop, LoopProgress
from matrix.grid.registry import load_modules

load_modules(__name__)

__all__ = [
    "ENGINES",
    "Engine",
    "EngineIncomplete",
    "EngineSettings",
    "LibraryLoop",
    "Loop",
    "LoopProgress",
    "LoopRun",
    "Steps",
    "Unsupported",
    "register",
]
