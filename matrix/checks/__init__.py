"""What a cell asserts, and within which tolerances (above grid/ and results/).

  assertions.py    - the assertions a cell makes, each failing with a stable message (CheckFailure
                     and its kinds)
  tolerances.py    - numeric tolerances as data: the precisions' rows, and the loss-curve rows
                     derived from curve_spread.json
  curve_spread.json - data: the largest deviation of right engines' loss curves per reference,
                     engine family and dtype (written by matrix/tools/curve_spread.py)

Every failure message starts with its signature; the rows are data, not code.
"""

from matrix.results.module_moves import forwarded


def __getattr__(name: str):  # the flat module matrix.checks's names, for one release (docs/extending.md)
    return forwarded("matrix.checks", name, __path__)
