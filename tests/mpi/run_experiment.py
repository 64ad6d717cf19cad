"""Run an experiment script (argv[1]) with the remaining arguments, inside this MPI job."""
import runpy
import sys

script = sys.argv[1]
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
