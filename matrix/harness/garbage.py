"""The garbage-collection policy between cells: what a cell left is collected before the next one
starts, and every FULL_COLLECTION_EVERY cells the collector's frozen generation is unfrozen and
collected too, so a long run's memory stays flat without paying a full collection per cell."""

from __future__ import annotations

import gc

FULL_COLLECTION_EVERY = 16  # cells: settle_garbage() unfreezes and collects everything this often
_settled = 0  # cells settled so far in this process


def settle_garbage() -> None:
    """Before a cell, before anything of the cell exists: collect what the cells before left, and
    freeze what survives (the imported stack, caches), so that a library's own gc.collect()
    inside the cell (the Trainer's, accelerate's free_memory, twice per train()) scans the
    cell's own objects, not the whole process's (0.2 s a call with the stack imported, more as
    a run goes on). A frozen object is never collected: what is frozen must outlive the cell,
    or it stays in memory in a reference cycle (a cell's state frozen with its models: every
    cell's models to the end of the run). What a later cell lets go (a cache's evicted model)
    is collected at the next full collection, every FULL_COLLECTION_EVERY cells."""
    global _settled
    if _settled % FULL_COLLECTION_EVERY == 0:
        gc.unfreeze()
    _settled += 1
    gc.collect()
    gc.freeze()
