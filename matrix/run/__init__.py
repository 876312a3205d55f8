"""python -m matrix run: pytest in a process the supervisor can outlive, and the option table it
shares with the pytest plugin (matrix/plugin/). Nothing here imports pytest: the supervisor runs it.

  supervisor.py    - the crash- and hang-surviving supervisor: a killed or hung pytest is recorded and
                     the run resumed in a new process
  options.py       - the matrix's command-line options, one table for the plugin and python -m matrix run
  internal_errors.py - the pytest plugin the supervisor loads into pytest: an internal error's
                     traceback kept

It sits below plugin/, which reads the options from here.
"""
