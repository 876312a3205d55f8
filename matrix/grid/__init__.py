"""What a cell is: the bottom layer, imported by every other folder. Standard library only.

  cell.py          - a cell = model x precision x mode x device x engine, and its id
  modes.py         - train / eval
  registry.py      - the one registry shape the axes use (models, precisions, engines, devices):
                     register(), lookup, order, names made on demand (hf:<model_type>)
  variants.py      - the settings the grid holds constant (batch, sizes, cache, loop)
  schedule.py      - the steps every training cell runs, and the seeds of its random numbers
  packages.py      - the packages the matrix knows by name: their versions, whether one is
                     installed, and the one line (how to install it) a value without it skips with

Nothing here imports torch: the results layer reads cells and packages through it.
"""
