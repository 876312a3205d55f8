"""A run split across machines (--shard K/N), and the merge of the shards' reports. Standard library
only.

  plan.py          - --shard K/N: the plan every shard writes (shard-plan.json), balanced by
                     --shard-costs
  merge.py         - python -m matrix merge: the shards' reports as one run
"""

from matrix.results.module_moves import forwarded


def __getattr__(name: str):  # the flat module matrix.shards's names, for one release (docs/extending.md)
    return forwarded("matrix.shards", name, __path__)
