"""Releases: pinned stacks, sweeps over a package's releases, bisection, and the standalone scripts
that show a cell without the harness.

  stacks.py, stacks.toml - pinned version stacks: their reader (noxfile.py imports it: standard
                     library and packaging only) and the stacks
  sweep.py         - python -m matrix sweep / releases: one selection over several releases of a
                     package
  releases.toml    - the published compatibility table's sweeps (python -m matrix releases)
  bisection.py     - python -m matrix bisect: the release of a package that changed one cell; the
                     scratch environments
  new_failures.py  - the nightly diff's bisection of new failures over the changed packages
  repro/           - python -m matrix repro: one cell as a standalone script (the engine's library
                     calls, the references and the checks with their allowances; upstream imports
                     only)
  entry_releases.py - python -m matrix entry-releases: each catalogued bug's script on the releases its
                     entry names and its fixed release (docs/entry-releases.md)
  triage.py        - python -m matrix triage: each new signature's smallest cell as a standalone
                     script in a fresh process: reproduces, does not reproduce, another failure
  rejudge.py       - python -m matrix rejudge: a run's cells classified again against the catalogue
                     as it is now, with the run's versions and machine, without running a cell
"""
