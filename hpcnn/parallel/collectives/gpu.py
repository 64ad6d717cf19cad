"""GPUs at start-up: CUDA-aware MPI detected, ``--gpu_comm`` chosen, each rank bound to a device.

Called by the run's context (:class:`hpcnn.engine.context.ParallelContext`) before it builds
the grid, on every rank, before anything is allocated on a device:

1. :func:`bind`: a rank's device is its node-local rank modulo the devices it sees
   (``cupy.cuda.Device(local_rank % n).use()``; the node's ranks from
   :func:`.topology.split_node`); where ``CUDA_VISIBLE_DEVICES`` leaves one device (Slurm's
   ``--gpus-per-task=1``, ``jobs/gpu_bind.sh``) that one. Ranks of a node that would share a
   device (same PCI bus id) are refused unless ``--share_gpus=true``.
2. :func:`choose`: ``--gpu_comm`` resolved (auto: nccl where CuPy has NCCL, else mpi where MPI is
   CUDA-aware, else staged), or refused when the path asked for is unavailable.
3. :func:`attach`: the dp and tp Communicators given their path (:mod:`.device_paths`); MPI told
   whether it reads device buffers (:func:`.mpi_base.set_cuda_aware`).

Every refusal is agreed over the world (each rank's verdict gathered) and raised on every rank
alike as one ConfigError line naming the ranks concerned, before any collective of training.

CUDA-aware MPI (:func:`cuda_aware`): ``HPCNN_CUDA_AWARE=0|1`` if set; else mpi4py's
``MPI.Query_cuda_support`` where it has one; else the library's ``MPIX_Query_cuda_support``
(Open MPI's CUDA extension, MPICH 4 and later) found in the loaded library; else, for Open MPI,
``ompi_info --parsable --all``'s ``mpi_built_with_cuda_support`` line; else not CUDA-aware.

The same code runs under the strict backend, whose ``xp.cuda`` (:data:`hpcnn.strict.cuda`)
answers the device calls (``HPCNN_STRICT_DEVICES`` devices a node, default 1). On CuPy it has
not run here: there is no GPU on the machines it was written on.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

from hpcnn import backend
from hpcnn.parallel.collectives import mpi_base
from hpcnn.parallel.collectives.device_paths import MpiPath, NcclPath, StagedPath

GPU_COMMS = ("auto", "nccl", "mpi", "staged")


class DeviceRefusal(ValueError):
    """A device binding or a ``--gpu_comm`` this machine cannot give (one line)."""


def cuda() -> object | None:
    """``cupy.cuda`` on CuPy, :data:`hpcnn.strict.cuda` under strict, None on NumPy."""
    return getattr(backend.xp, "cuda", None) if backend.device != "cpu" else None


def nccl_module(device: str | None = None):
    """``cupy.cuda.nccl`` where CuPy was built with NCCL (``nccl.available``), the strict
    backend's ``cuda.nccl`` (None unless a test installs a double), else None; for
    ``device`` (default: the backend's)."""
    device = device or backend.device
    if device == "cpu":
        return None
    if device == "strict":
        from hpcnn import strict
        return strict.cuda.nccl
    try:                                                 # pragma: no cover - CuPy
        from cupy.cuda import nccl
    except ImportError:                                  # pragma: no cover
        return None
    return nccl if getattr(nccl, "available", False) else None    # pragma: no cover


def cuda_aware() -> tuple[bool, str]:
    """(whether MPI reads device buffers, how that is known); see the module docstring."""
    env = mpi_base.env_cuda_aware()
    if env is not None:
        return env, f"HPCNN_CUDA_AWARE={os.environ['HPCNN_CUDA_AWARE']}"
    MPI = mpi_base._mpi()
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:                                # pragma: no cover - newer mpi4py
        return bool(query()), "mpi4py's MPI.Query_cuda_support()"
    try:
        fn = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
        fn.restype = ctypes.c_int
        return bool(fn()), "the library's MPIX_Query_cuda_support()"
    except (OSError, AttributeError):
        pass
    if "Open MPI" in MPI.Get_library_version():          # pragma: no cover - Open MPI
        return _ompi_info()
    return False, "not reported by the MPI library (set HPCNN_CUDA_AWARE=1 if it is)"


def _ompi_info() -> tuple[bool, str]:                    # pragma: no cover - Open MPI
    """Open MPI's build report: ``mpi_built_with_cuda_support:value:true``."""
    exe = shutil.which("ompi_info")
    if exe is None:
        return False, "Open MPI without MPIX_Query_cuda_support and no ompi_info on PATH"
    out = subprocess.run([exe, "--parsable", "--all"], capture_output=True, text=True,
                         timeout=60).stdout
    for line in out.splitlines():
        if "mpi_built_with_cuda_support:value:" in line:
            return line.rsplit(":", 1)[1].strip() == "true", "ompi_info's " + line.strip()
    return False, "ompi_info reports no mpi_built_with_cuda_support"


def choose(asked: str, device: str, aware: tuple[bool, str]) -> str:
    """The path ``--gpu_comm=asked`` takes on ``device``; raises :class:`DeviceRefusal` when it
    is unavailable. NumPy: ``staged`` stands for "no device path" (auto)."""
    if asked not in GPU_COMMS:
        raise DeviceRefusal(f"gpu_comm={asked!r}: expected one of {', '.join(GPU_COMMS)}")
    if device == "cpu":
        if asked != "auto":
            raise DeviceRefusal(f"gpu_comm={asked!r} with device='cpu': the arrays are in host "
                                f"memory; --gpu_comm is for --device=gpu (or strict)")
        return "staged"
    has_nccl = nccl_module() is not None
    if asked == "auto":
        return "nccl" if has_nccl else "mpi" if aware[0] else "staged"
    if asked == "nccl" and not has_nccl:
        raise DeviceRefusal("gpu_comm='nccl': this CuPy has no NCCL (cupy.cuda.nccl not "
                            "available); use --gpu_comm=mpi (CUDA-aware MPI) or staged")
    if asked == "mpi" and not aware[0]:
        raise DeviceRefusal(f"gpu_comm='mpi': this MPI is not CUDA-aware ({aware[1]}); use "
                            f"--gpu_comm=staged, or HPCNN_CUDA_AWARE=1 if it is")
    return asked


def _node_of(world):
    """(this rank's node-local rank, the node's world ranks, the node communicator or None)."""
    if world is None or world.Get_size() == 1:
        return 0, [0 if world is None else world.Get_rank()], None
    from hpcnn.parallel.collectives.topology import split_node
    node = split_node(world, key=world.Get_rank())
    return node.Get_rank(), node.allgather(world.Get_rank()), node


def _visible(dev) -> int:
    try:
        return int(dev.runtime.getDeviceCount())
    except Exception:                                    # pragma: no cover - CUDA errors
        return 0                                         # (no driver, no device)


def _binding(world, share: bool) -> tuple[dict, str]:
    """(this rank's device binding, '' or why it is refused). Collective on ``world``'s node."""
    dev = cuda()
    local, ranks, node = _node_of(world)
    n = _visible(dev)
    index = local % n if n else None
    ident = dev.Device(index).pci_bus_id if n else None
    idents = node.allgather(ident) if node is not None else [ident]
    if node is not None:
        node.Free()
    binding = {"local_rank": local, "node_ranks": len(ranks), "visible": n, "device": index,
               "devices_used": len(set(idents)), "shared": len(set(idents)) < len(idents)}
    if n == 0:
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        return binding, ("no GPU visible" + (f" (CUDA_VISIBLE_DEVICES={seen!r})"
                                             if seen is not None else ""))
    if binding["shared"] and not share:
        return binding, (f"{len(ranks)} ranks of a node ({', '.join(map(str, ranks))}) on "
                         f"{len(set(idents))} GPU(s) it lets them see: give each rank its own "
                         f"(fewer ranks a node, Slurm's --gpus-per-task=1 or jobs/gpu_bind.sh) "
                         f"or pass --share_gpus=true")
    return binding, ""


def _agreed(world, message: str) -> None:
    """Raise :class:`DeviceRefusal` on every rank if any rank of ``world`` has a message: each
    distinct one once, with the ranks it concerns unless it concerns them all."""
    messages = world.allgather(message) if world is not None else [message]
    if not any(messages):
        return
    out = []
    for text in dict.fromkeys(m for m in messages if m):
        ranks = [r for r, m in enumerate(messages) if m == text]
        out.append(text if len(ranks) == len(messages) else
                   f"{text} (on rank{'s' if len(ranks) > 1 else ''} "
                   f"{', '.join(map(str, ranks))} of {len(messages)})")
    raise DeviceRefusal("; ".join(out))


def start(device: str, gpu_comm: str, share: bool, world=None) -> dict | None:
    """Bind this rank to its device and resolve ``--gpu_comm`` (see the module docstring);
    returns the binding with ``"gpu_comm"`` (the path) and ``"cuda_aware"`` ((flag, source)),
    or None on NumPy. Collective over ``world`` (an ``mpi4py`` communicator, or None: serial);
    raises :class:`DeviceRefusal` on every rank alike."""
    if device == "cpu":
        choose(gpu_comm, "cpu", (False, ""))
        return None
    binding, why = _binding(world, share)
    aware = cuda_aware() if world is not None else (False, "one process: no MPI")
    try:
        mode = choose(gpu_comm, device, aware)
    except DeviceRefusal as e:
        why = f"{why}; {e}" if why else str(e)
    _agreed(world, why)
    cuda().Device(binding["device"]).use()
    return dict(binding, gpu_comm=mode, cuda_aware=aware)


def attach(setup: dict | None, comms) -> None:
    """Give each Communicator of ``comms`` (of more than one rank) the run's device path, and
    tell MPI whether it reads device buffers (mpi: yes; staged: no; nccl: as detected, for the
    collectives NCCL does not take). Collective (NCCL's unique id)."""
    if setup is None:
        return
    mode = setup["gpu_comm"]
    mpi_base.set_cuda_aware(mode == "mpi" or (mode == "nccl" and setup["cuda_aware"][0]))
    for comm in comms:
        if comm.size > 1:
            comm.device_path = (NcclPath(comm, nccl_module(), cuda()) if mode == "nccl" else
                                MpiPath() if mode == "mpi" else StagedPath())


def detach(setup: dict | None, comms) -> None:
    """Free the paths :func:`attach` made (NCCL communicators) and forget the declaration."""
    if setup is None:
        return
    for comm in comms:
        if comm.device_path is not None:
            comm.device_path.free()
            comm.device_path = None
    mpi_base.set_cuda_aware(None)


def info_lines() -> list[str]:
    """What ``hpcnn info`` says of GPUs: each device (name, memory), the driver and runtime,
    NCCL, and whether MPI is CUDA-aware (and how that is known)."""
    dev = cuda()
    if dev is None:
        try:
            import cupy                                  # pragma: no cover - CuPy
            dev = cupy.cuda                              # pragma: no cover
        except ImportError:
            dev = None
    aware = cuda_aware()
    tail = [f"CUDA-aware MPI: {'yes' if aware[0] else 'no'} ({aware[1]})"]
    if dev is None:
        return ["GPUs: no CuPy (pip install 'hpcnn[gpu]'): NumPy only", "NCCL: no CuPy"] + tail
    n = _visible(dev)
    lines = [f"GPUs: {n} visible" + (" (strict stand-ins, HPCNN_STRICT_DEVICES)"
                                     if backend.device == "strict" else "")
             + ("" if n else ": no GPU")]
    for i in range(n):
        p = dev.runtime.getDeviceProperties(i)
        name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
        lines.append(f"  GPU {i}: {name}, {p['totalGlobalMem'] / 2**30:.1f} GiB, "
                     f"compute capability {p['major']}.{p['minor']}")
    lines.append(f"CUDA driver {_version(dev.runtime.driverGetVersion())}, runtime "
                 f"{_version(dev.runtime.runtimeGetVersion())}")
    nccl = nccl_module("strict" if backend.device == "strict" else "gpu")
    version = getattr(nccl, "get_version", None)
    lines.append("NCCL: " + ("not available" if nccl is None else
                             f"{version()}" if version is not None else "available"))
    return lines + tail


def _version(v: int) -> str:
    """CUDA's integer version (12040) as 12.4."""
    return f"{v // 1000}.{v % 1000 // 10}" if v else "none"
