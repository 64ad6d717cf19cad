"""hpcnn: MPI-native parallel training of neural networks on MPI and NumPy (CuPy on GPUs)."""

__version__ = "0.1.0"

_start_up_sigint = False     # set by _noted_interrupt: a Ctrl-C came during start-up


def to_stderr(line: str) -> None:
    """Print ``line`` to stderr in one write (text and newline together), flushed: under mpiexec
    the ranks' lines then never interleave, even with unbuffered streams (``python -u``,
    ``PYTHONUNBUFFERED``), where ``print`` writes the newline apart."""
    import sys
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()


def note_start_up_interrupts() -> None:
    """Make SIGINT note that it came (:func:`start_up_interrupted`) before it raises
    ``KeyboardInterrupt`` as Python's own handler does: what ``python -m hpcnn`` does first, so
    that a Ctrl-C during start-up is known for one even where its ``KeyboardInterrupt`` is lost.
    An import in C that it hits can turn it into another error (NumPy's ``ImportError:
    PyCapsule_Import could not import module "datetime"``), which an ``except ImportError``
    around an optional import may swallow, and Python drops it where it lands in a callback
    that cannot raise ("Exception ignored in", importlib's module-lock callback among them).
    The run's own handlers (:mod:`hpcnn.signals`) replace this one while they are in place and
    restore it after. Nothing changes where SIGINT is not Python's default (ignored: a
    background job of a shell without job control). A ``KeyboardInterrupt`` dropped in a
    callback once SIGINT was noted is not printed (``sys.unraisablehook``): ``hpcnn train``
    honours the note before its run starts (:func:`hpcnn.cli.cmd_train`)."""
    import signal
    import sys
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    signal.signal(signal.SIGINT, _noted_interrupt)
    shown = sys.unraisablehook

    def unraisable(what):
        if not (_start_up_sigint and issubclass(what.exc_type, KeyboardInterrupt)):
            shown(what)
    sys.unraisablehook = unraisable


def _noted_interrupt(signum, frame):
    """The start-up handler of SIGINT: noted, then raised as Python's own handler raises it."""
    global _start_up_sigint
    _start_up_sigint = True
    raise KeyboardInterrupt


def start_up_interrupted() -> bool:
    """True once SIGINT came while :func:`note_start_up_interrupts`'s handler was in place."""
    return _start_up_sigint


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
