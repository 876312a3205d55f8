"""The known-failure catalogue: every failure the matrix knows, established by running it.

  entries.py       - loading entries (the built-in file and users'), selectors, classification
                     (known, failed, fixed, inapplicable)
  conditions.py    - the named conditions an entry is in force under (`when`): the hardware, the
                     run's settings, what the cell observed
  known_failures.toml - the built-in catalogue's entries (users' files add to them)

An entry's fields are documented at the top of known_failures.toml.
"""

from matrix.results.module_moves import forwarded


def __getattr__(name: str):  # the flat module matrix.catalogue's names, for one release (docs/extending.md)
    return forwarded("matrix.catalogue", name, __path__)
