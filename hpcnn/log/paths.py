"""Whether a run can write a file where it is told to, found before any work: the checks of
``hpcnn train``'s checkpoint destination (:mod:`hpcnn.preflight`) and of the outputs of
``hpcnn report``, ``plan`` and ``simulate`` (:mod:`hpcnn.cli_tools`). Each caller words its own
refusal around the reason returned here."""
from __future__ import annotations

import os
import socket


def nearest_folder(path: str) -> str:
    """The nearest existing path above ``path`` (where a writer would make the rest)."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return folder


def creation_problem(path: str) -> str:
    """Why no file can be created at ``path``, in a few words naming the folder, or '' when one
    can. The folder is the nearest existing one above ``path`` (a writer makes the rest); it must
    be a directory this process may write in, and a file is created and removed there to be sure
    (``os.access`` says yes on some file systems where creating a file fails). Whether ``path``
    itself is a directory is the caller's to check."""
    folder = nearest_folder(path)
    if not os.path.isdir(folder):
        return f"{folder} is not a directory"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"no permission to write in {folder}"
    probe = os.path.join(folder, f".hpcnn-probe.{socket.gethostname()}.{os.getpid()}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        os.remove(probe)
    except OSError as e:
        return f"cannot create a file in {folder} ({e.strerror or e})"
    return ""
