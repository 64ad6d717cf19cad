"""hpcnn: MPI-native parallel training of neural networks on MPI and NumPy (CuPy on GPUs)."""

__version__ = "0.1.0"


def to_stderr(line: str) -> None:
    """Print ``line`` to stderr in one write (text and newline together), flushed: under mpiexec
    the ranks' lines then never interleave, even with unbuffered streams (``python -u``,
    ``PYTHONUNBUFFERED``), where ``print`` writes the newline apart."""
    import sys
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()


def exit_interrupted(code: int = 130):
    """Leave the process at once with ``code``, its streams flushed: after a Ctrl-C caught at
    start-up, before anything has run that needs finalizing. Not ``sys.exit``: CPython ends a
    process by SIGINT once its interpreter exits (status -2, not ``code``) whenever the
    KeyboardInterrupt was raised inside an ``exec`` of a string, caught or not, and
    dataclasses and namedtuple build their methods that way while modules import."""
    import os
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
