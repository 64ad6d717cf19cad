"""hpcnn: MPI-native parallel training of neural networks on MPI and NumPy (CuPy on GPUs)."""

__version__ = "0.1.0"


def to_stderr(line: str) -> None:
    """Print ``line`` to stderr in one write (text and newline together), flushed: under mpiexec
    the ranks' lines then never interleave, even with unbuffered streams (``python -u``,
    ``PYTHONUNBUFFERED``), where ``print`` writes the newline apart."""
    import sys
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()
