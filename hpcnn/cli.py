"""The ``hpcnn`` command: train, info, report, simulate, calibrate, plan (:data:`SUBCOMMANDS`).

::

    hpcnn train --model=mlp --epochs=20            # serial
    mpiexec -n 1 python -m mpi4py -m hpcnn train   # under MPI (an exception aborts every rank)
    hpcnn info                                     # versions, MPI library, backend, BLAS threads
    hpcnn report runs/mlp-digits-s0.h5             # curves and step times as PNG
    hpcnn simulate --schedule=zb_h1 --ranks=4      # a pipeline schedule's predicted timeline
    mpiexec -n 2 python -m mpi4py -m hpcnn calibrate   # what --allreduce=auto picks here
"""
from __future__ import annotations

import os
import platform
import sys
from hpcnn import exit_interrupted, start_up_interrupted, to_stderr

SUBCOMMANDS = (   # (name, arguments, one line): what ``hpcnn --help`` lists, in this order
    ("train", "[--key=value ...]", "train a model (hpcnn train --help lists the options)"),
    ("info", "", "versions, MPI library, backend, BLAS threads, GPUs"),
    ("report", "RUN.h5 [OUT.png]", "plot a run log's curves and step times (--trace OUT.json: "
                                   "Perfetto)"),
    ("simulate", "[--key=value ...]", "a pipeline schedule's predicted makespan, bubble and chart"),
    ("calibrate", "[--key=value ...]", "(under mpiexec) time the allreduce algorithms, print "
                                       "auto's table; --write=FILE: a machine file"),
    ("plan", "[--key=value ...]", "rank a GPT's dp x tp x pp layouts on this machine (or "
                                  "--machine=FILE) by predicted step time"),
)
USAGE = ("usage: hpcnn <command> [options]     (hpcnn <command> --help: its options; "
         "hpcnn --version)\n\ncommands:\n"
         + "".join(f"  {f'{name} {args}':<31}{line}\n" for name, args, line in SUBCOMMANDS))


# The interpreter's arguments that run a module or script under mpi4py's launcher, with which an
# uncaught exception on one rank aborts the whole job: python -m mpi4py [-m] ...
LAUNCHER = ("-m", "mpi4py")


def mpi_loaded() -> bool:
    """True when MPI has been loaded in this process (mpi4py's MPI module imported)."""
    return "mpi4py.MPI" in sys.modules


def mpi_ranks() -> int:
    """The ranks of this process's MPI job: 1 unless MPI is loaded and running with more."""
    if not mpi_loaded():
        return 1
    from mpi4py import MPI
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return 1
    return MPI.COMM_WORLD.Get_size()


def _under_mpi() -> bool:
    """True when launched by an MPI starter (or mpi4py is already loaded)."""
    if mpi_loaded():
        return True
    keys = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
    return any(k in os.environ for k in keys)


def launched_by_mpi4py() -> bool:
    """True when this process runs under ``python -m mpi4py`` (:data:`LAUNCHER`), which aborts
    the whole job on an uncaught exception."""
    return "mpi4py.run" in sys.modules


def abort_on_uncaught(world) -> None:
    """Make an uncaught exception on this rank print its traceback and abort every rank of
    ``world`` (an MPI communicator of more than one rank), as ``python -m mpi4py`` does, instead
    of leaving the others waiting in a collective until ``--hang_timeout``."""
    import time

    def hook(kind, value, tb):
        sys.__excepthook__(kind, value, tb)
        if issubclass(kind, KeyboardInterrupt):
            return
        to_stderr(f"hpcnn: rank {world.Get_rank()} of {world.Get_size()} failed "
                  f"({kind.__name__}): aborting the job")
        time.sleep(0.5)      # let the launcher forward these lines before the abort kills it
        world.Abort(1)
    sys.excepthook = hook


START_UP = "hpcnn: interrupted during start-up"
INTERRUPT_AGREE_SECONDS = 5.0   # how long an interrupted rank waits for the others to be too


def interrupted_at_start():
    """A SIGINT before the run's own handlers (:mod:`hpcnn.signals`) were in place: one line,
    no traceback, exit status 130 (:func:`hpcnn.exit_interrupted`; never returns). Under MPI,
    every rank normally got it (``mpiexec`` forwards it): MPI is finalized once all have (so
    that ``python -m mpi4py`` does not make an abort of the non-zero exit), else, after
    :data:`INTERRUPT_AGREE_SECONDS`, the job is aborted."""
    to_stderr(START_UP)
    if mpi_ranks() > 1:
        from mpi4py import MPI
        exit_interrupted(leave_refused(MPI.COMM_WORLD, 130, INTERRUPT_AGREE_SECONDS))
    if mpi_loaded():
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    exit_interrupted(130)


def cmd_train(args) -> int:
    """``hpcnn train``: a Ctrl-C before the run's handlers are in place ends it by
    :func:`interrupted_at_start`, and so does any error after one under ``python -m hpcnn``
    (:func:`hpcnn.start_up_interrupted`: an import in C may have turned the
    ``KeyboardInterrupt`` into an ``ImportError``)."""
    try:
        return _train(args)
    except KeyboardInterrupt:
        interrupted_at_start()
    except Exception:
        if not start_up_interrupted():
            raise
        interrupted_at_start()


def _train(args) -> int:
    from hpcnn import preflight
    from hpcnn.config import ConfigError, TrainConfig, describe, flags_note, parse_overrides
    if any(a in ("-h", "--help") for a in args):
        print("usage: hpcnn train [--key=value ...]\n\noptions (default, meaning):\n"
              + describe(TrainConfig) + "\n\n" + flags_note("progress"))
        return 0
    from hpcnn.memory_check import MemoryRefusal
    mpi = _under_mpi()
    try:                  # every check that needs no MPI, before MPI starts: a refused run
        cfg = parse_overrides(args).resolved()        # prints one line and starts nothing
        data = preflight.check(cfg, preflight.world_size_from_env() if mpi else 1)
    except MemoryRefusal as e:
        return _refused_for_memory(str(e), mpi)
    except ConfigError as e:
        if preflight.rank_from_env() == 0:
            to_stderr(f"hpcnn train: {e}")
        return 2
    from hpcnn.checkpoint import CheckpointError
    from hpcnn.train import train
    if start_up_interrupted():      # a Ctrl-C that an import swallowed: still honoured
        raise KeyboardInterrupt
    comm = agree = None
    if mpi:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        if comm.Get_size() > 1 and not launched_by_mpi4py():
            abort_on_uncaught(comm)
        agree = comm.Dup()        # used only to find out whether every rank stopped
    try:
        result = train(cfg, comm=comm, command_line="hpcnn train " + " ".join(args), data=data)
    except (ConfigError, CheckpointError, FloatingPointError) as e:
        if comm is None or comm.Get_size() == 1:    # (MPI stays usable for an in-process caller)
            to_stderr(f"hpcnn train: {e}")
            if agree is not None:
                agree.Free()
            return 2
        return _stop_every_rank(str(e), agree)
    if agree is not None:
        agree.Free()
    if comm is None or comm.Get_rank() == 0:
        keys = [k for k in ("loss", "test_acc", "test_loss", "val_loss", "unigram_entropy") if k in result]
        done = result.get("steps_done", result["steps"])    # a run stopped early: of the plan
        steps = done if done == result["steps"] else f"{done} of {result['steps']}"
        print("result: " + ", ".join(f"{k}={result[k]:.4f}" for k in keys)
              + f", steps={steps}, wall={result['wall_s']:.1f}s, log={result['log']}"
              + ("" if result["status"] == "finished" else f", {result['status']}")
              + (f", {result['divergence']}" if result.get("divergence") else "")
              + (f", skipped={result['skipped_steps']} (fp16 loss scale)"
                 if "skipped_steps" in result else ""))
    if result["exit_code"] and comm is not None:    # interrupted: 128 + signal, without the
        from mpi4py import MPI                      # MPI_Abort mpi4py makes of a non-zero exit
        MPI.Finalize()
    return result["exit_code"]


def _refused_for_memory(message: str, mpi: bool) -> int:
    """A rank that does not fit in its node's memory (:mod:`hpcnn.memory_check`): each node
    decides for itself, so every rank that refuses prints its line (with its rank under MPI).
    Under MPI with several ranks it then leaves by :func:`leave_refused`, which starts MPI: the
    job ends with exit code 2 once every rank has refused, and a rank whose node had the memory,
    waiting in MPI's start or first collective for this one, is aborted rather than left
    waiting."""
    from hpcnn import preflight
    size = (preflight.world_size_from_env() or 1) if mpi else 1
    where = f"rank {preflight.rank_from_env()} of {size}: " if size > 1 else ""
    to_stderr(f"hpcnn train: {where}{message}")
    if size <= 1:                # one process: MPI (if loaded) stays usable for its caller
        return 2
    from mpi4py import MPI
    return leave_refused(MPI.COMM_WORLD, 2)


def merge_messages(messages: list[str]) -> list[str]:
    """Each distinct message of ``messages`` (rank r's at index r) once, followed by the ranks
    it concerns unless it concerns them all."""
    out = []
    for text in dict.fromkeys(messages):
        ranks = [r for r, m in enumerate(messages) if m == text]
        out.append(text if len(ranks) == len(messages) else
                   f"{text} (on rank{'s' if len(ranks) > 1 else ''} "
                   f"{', '.join(map(str, ranks))} of {len(messages)})")
    return out


AGREE_SECONDS = 60.0      # how long a rank that stopped waits for the others to stop too


def _stop_every_rank(message: str, agree) -> int:
    """A rank's run stopped with ``message`` (a refusal or a non-finite loss): print it once.

    The refusals are raised on every rank alike, so normally every rank arrives here. A
    non-blocking barrier on ``agree`` (a communicator nobody else uses) tells when all have:
    rank 0 then prints each distinct message once, with the ranks it concerns unless it is all
    of them, and every rank finalizes MPI and exits with 2, without MPI_Abort's noise. If some
    rank does not arrive within :data:`AGREE_SECONDS` (it runs on, or waits in a collective),
    this rank prints its message with its rank and aborts the job: never a hang.
    """
    from mpi4py import MPI
    rank, size = agree.Get_rank(), agree.Get_size()
    if not _every_rank_arrived(agree):
        to_stderr(f"hpcnn train: rank {rank} of {size}: {message}")
        agree.Abort(2)
    messages = agree.gather(message, root=0)
    if rank == 0:
        for line in merge_messages(messages):
            to_stderr(f"hpcnn train: {line}")
    agree.Free()
    MPI.Finalize()
    return 2


def _every_rank_arrived(comm, seconds: float | None = None) -> bool:
    """A non-blocking barrier on ``comm``, polled: whether every rank entered it within
    ``seconds`` (None: :data:`AGREE_SECONDS` as it is at the call)."""
    import time
    seconds = AGREE_SECONDS if seconds is None else seconds
    req, t0 = comm.Ibarrier(), time.monotonic()
    while not req.Test():
        if time.monotonic() - t0 > seconds:
            return False
        time.sleep(0.005)
    return True


def leave_refused(comm, code: int = 2, seconds: float | None = None) -> int:
    """End a script run under mpiexec whose ranks each refused its input, alike and before any
    collective, and printed why: flush, wait until every rank has (``seconds`` at most, None:
    :data:`AGREE_SECONDS`, else abort the job: never a hang), finalize MPI and return ``code``
    for ``sys.exit``.
    A non-zero exit straight away would become the MPI_Abort of ``python -m mpi4py``, which can
    kill a rank before its message is out."""
    from mpi4py import MPI
    sys.stdout.flush()
    sys.stderr.flush()
    if not _every_rank_arrived(comm, seconds):
        comm.Abort(code)
    MPI.Finalize()
    return code


def refuse(message: str, code: int = 2):
    """A script's refusal of its input, alike on every rank and before any collective: print
    ``message`` on this rank and exit with ``code`` by :func:`leave_refused` (under mpiexec,
    once every rank has printed). For scripts that have started MPI; never returns."""
    from mpi4py import MPI
    to_stderr(message)
    sys.exit(leave_refused(MPI.COMM_WORLD, code))


def info_lines() -> list[str]:
    import importlib.metadata

    import numpy
    import hpcnn
    from hpcnn import backend
    lines = [f"hpcnn {hpcnn.__version__}", f"python {platform.python_version()} ({sys.executable})",
             f"numpy {numpy.__version__}"]
    # the installed distributions' versions, read without importing them (scikit-learn's
    # import alone took 2 s); CuPy's by import, as its distribution's name names the CUDA
    for mod, dist in (("scipy", "scipy"), ("h5py", "h5py"), ("matplotlib", "matplotlib"),
                      ("mpi4py", "mpi4py"), ("sklearn", "scikit-learn")):
        try:
            lines.append(f"{mod} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            lines.append(f"{mod} not installed")
    try:
        import cupy
        lines.append(f"cupy {cupy.__version__}")
    except ImportError:
        lines.append("cupy not installed")
    try:
        from mpi4py import MPI
        lines.append("MPI library: " + MPI.Get_library_version().splitlines()[0].strip())
        lines.append(f"MPI standard {'.'.join(map(str, MPI.Get_version()))}, "
                     f"world size {MPI.COMM_WORLD.Get_size()}")
    except ImportError:
        lines.append("MPI library: none (mpi4py not importable)")
    lines.append(f"backend: {backend.device} ({backend.xp.__name__}), "
                 f"default dtype {numpy.dtype(backend.DEFAULT_DTYPE)}")
    lines += _allreduce_lines()
    from hpcnn.parallel.collectives import gpu
    lines += gpu.info_lines()
    lines += _thread_pool_lines()
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                      "HPCNN_DEVICE") if k in os.environ}
    lines.append(f"environment: {env or 'no thread or device variables set'}")
    return lines


def _thread_pool_lines() -> list[str]:
    """One line per native thread pool loaded in this process (threadpoolctl's view): the BLAS
    libraries (NumPy's and SciPy's each bundle an OpenBLAS) and OpenMP runtimes (scikit-learn's),
    each named by the package that ships it, with its thread count."""
    try:
        import scipy.linalg  # noqa: F401 - load SciPy's BLAS too, so that its threads are shown
        from threadpoolctl import threadpool_info
    except ImportError:
        return ["BLAS threads: unknown (pip install threadpoolctl)"]
    out = []
    for p in threadpool_info():
        where = os.path.basename(os.path.dirname(p.get("filepath") or "")).removesuffix(".libs")
        what = ("BLAS" if p.get("user_api") == "blas" else "OpenMP") + f" in {where or '?'}: "
        if p.get("user_api") == "blas":
            detail = ", ".join(str(v) for v in (p.get("architecture"), p.get("threading_layer"))
                               if v)
            what += f"{p.get('internal_api')} {p.get('version') or ''}".rstrip()
            what += f" ({detail})" if detail else ""
        else:
            what += p.get("prefix") or p.get("internal_api") or "openmp"
        out.append(f"{what}, {p.get('num_threads')} threads")
    return out or ["BLAS: none found by threadpoolctl"]


def _allreduce_lines() -> list[str]:
    """What the allreduce fast paths will find: the C module, and the kernel's ptrace policy
    that decides whether 'cma' (process_vm_readv/writev between ranks) can work."""
    import importlib.util
    from hpcnn.parallel.collectives import lean_build
    built = os.path.exists(lean_build.target()) and importlib.util.find_spec(
        "hpcnn.parallel.collectives._lean") is not None
    out = ["allreduce C fast path: " + (
        "built" if built else "not built (python -m hpcnn.parallel.collectives.lean_build)")]
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = f.read().strip()
        meaning = {"0": "ranks of one user may read each other: cma possible",
                   "1": "descendants only (or CAP_SYS_PTRACE): cma usually refused between "
                        "MPI ranks (probed at run time)"}
        out.append(f"kernel.yama.ptrace_scope = {scope}: "
                   + meaning.get(scope, "no cross-process reads: cma refused"))
    except OSError:
        out.append("kernel.yama.ptrace_scope: not present (cma probed at run time)")
    return out


def cmd_info(args) -> int:
    if args:
        help_asked = args[0] in ("-h", "--help")
        print("usage: hpcnn info     versions, MPI library, backend, BLAS threads, GPUs (no "
              "options)",
              file=sys.stdout if help_asked else sys.stderr)
        return 0 if help_asked else 2
    lines = info_lines() + _node_lines()
    if _world_rank() == 0:                  # (under mpiexec: rank 0 speaks for the job)
        print("\n".join(lines))
    return 0


def _world_rank() -> int:
    if mpi_ranks() <= 1:
        return 0
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank()


def _node_lines() -> list[str]:
    """Under mpiexec (collective): the job's nodes and every rank's node and host
    (:mod:`hpcnn.parallel.collectives.topology`; HPCNN_NODES: emulated)."""
    if mpi_ranks() <= 1:
        return []
    import socket
    from mpi4py import MPI
    from hpcnn.parallel.collectives import topology
    world = MPI.COMM_WORLD
    nodes = topology.node_map(world)
    hosts = world.allgather(socket.gethostname())
    lines = [f"nodes: {topology.describe(nodes)}",
             "rank -> node: " + ", ".join(f"{r}: {n} ({h})"
                                          for r, (n, h) in enumerate(zip(nodes, hosts)))]
    for label, kind in topology.HW_KINDS:           # inside a node (MPI_COMM_TYPE_HW_GUIDED)
        groups = topology.hw_map(world, kind)
        lines.append(f"rank -> {label}: " + (", ".join(f"{r}: {g}" for r, g in enumerate(groups))
                     if groups else f"not offered by the MPI library ({kind})"))
    if topology.emulated_link():
        lines.append(f"link between nodes: emulated ({topology.emulated_link()})")
    return lines


def cmd_report(args) -> int:
    if not args or args[0] in ("-h", "--help"):
        print("usage: hpcnn report RUN.h5 [OUT.png]     figure, headline and summary of one run\n"
              "       hpcnn report CHECKPOINT.h5          its step, saved layout, model options\n"
              "       hpcnn report --headline RUN.h5 ...  one line of figures per run\n"
              "       hpcnn report RUN.h5 --trace OUT.json  the timeline as a Chrome trace (Perfetto)\n"
              "       hpcnn report MEASURED.h5 --predicted=PRED.h5 --gantt=OUT.png [--step=-1]\n"
              "           predicted (hpcnn simulate --model=... --log) and measured step side by side")
        return 0 if args else 2
    if "--trace" in args:
        return _report_trace(args)
    if any(a.startswith(("--predicted", "--gantt")) for a in args):
        return _report_gantt(args)
    from hpcnn.checkpoint import describe
    from hpcnn.log.report import headline, make_report, summary
    if args[0] == "--headline":
        kinds = _report_inputs(args[1:], [], "hpcnn report --headline", checkpoints=True)
        if kinds is None or len(args) == 1:
            if len(args) == 1:
                to_stderr("hpcnn report --headline: no run log given")
            return 2
        for p in args[1:]:
            print(headline(p) if kinds[p] == "run log" else _checkpoint_headline(p))
        return 0
    path = args[0]
    png = args[1] if len(args) > 1 else os.path.splitext(path)[0] + ".png"
    kinds = _report_inputs([path], [png], "hpcnn report", checkpoints=True)
    if kinds is None:
        return 2
    if kinds[path] == "checkpoint":
        print(describe(path))
        return 0
    png = make_report(path, png)
    print(headline(path))
    print(summary(path))
    print(f"wrote {png}")
    return 0


def _report_inputs(paths, outputs, command: str, checkpoints: bool = False) -> dict | None:
    """{path: "run log" | "checkpoint"} of the files ``hpcnn report`` reads (checkpoints only
    where ``checkpoints``), once every one reads and every path of ``outputs`` can be written;
    else None, the first problem printed in one line naming its path."""
    from hpcnn.cli_tools import output_problem
    from hpcnn.log.report import log_kind
    kinds = {}
    try:
        for p in paths:
            kinds[p] = log_kind(p)
            if kinds[p] == "checkpoint" and not checkpoints:
                raise ValueError(f"{p}: a checkpoint, not a run log (hpcnn report {p} "
                                 f"describes it)")
    except ValueError as e:
        to_stderr(f"{command}: {e}")
        return None
    for out in outputs:
        bad = output_problem(out, "output")
        if bad:
            to_stderr(f"{command}: {bad}")
            return None
    return kinds


def _checkpoint_headline(path: str) -> str:
    """``hpcnn report --headline`` of a checkpoint: its description on one line."""
    from hpcnn.checkpoint import describe
    return f"{os.path.basename(path)}: checkpoint; " + "; ".join(
        " ".join(line.split()) for line in describe(path).splitlines()[1:4])


def _report_trace(args) -> int:
    """``hpcnn report RUN.h5 --trace OUT.json``: the run's timeline for Perfetto."""
    from hpcnn.log.chrome import write_trace
    k = args.index("--trace")
    rest = args[:k] + args[k + 2:]
    if k + 1 >= len(args) or len(rest) != 1:
        to_stderr("hpcnn report: --trace needs one run log and one output path: "
                  "hpcnn report RUN.h5 --trace OUT.json")
        return 2
    if _report_inputs(rest, [args[k + 1]], "hpcnn report") is None:
        return 2
    try:
        n = write_trace(rest[0], args[k + 1])
    except ValueError as e:
        to_stderr(f"hpcnn report: {e}")
        return 2
    print(f"wrote {args[k + 1]} ({n} events; open it in https://ui.perfetto.dev)")
    return 0


def _report_gantt(args) -> int:
    """``hpcnn report MEASURED.h5 --predicted=PRED.h5 --gantt=OUT.png [--step=K]``: the two
    Gantt charts side by side (:func:`hpcnn.log.report.gantt_report`)."""
    from hpcnn.log.report import gantt_report
    opts, files = {}, []
    for a in args:
        key, eq, value = a[2:].partition("=") if a.startswith("--") else ("", "", "")
        if key in ("predicted", "gantt", "step") and eq:
            opts[key] = value
        elif a.startswith("--"):
            to_stderr(f"hpcnn report: unknown option {a!r} with --gantt (--predicted=, --gantt=, "
                      f"--step=)")
            return 2
        else:
            files.append(a)
    usage = "hpcnn report MEASURED.h5 --predicted=PRED.h5 --gantt=OUT.png [--step=-1]"
    if len(files) != 1 or not opts.get("predicted") or not opts.get("gantt"):
        to_stderr(f"hpcnn report: {usage}")
        return 2
    if _report_inputs([files[0], opts["predicted"]], [opts["gantt"]], "hpcnn report") is None:
        return 2
    try:
        drawn = gantt_report(files[0], opts["predicted"], opts["gantt"],
                             int(opts.get("step", -1)))
    except ValueError as e:
        to_stderr(f"hpcnn report: {e}")
        return 2
    print(", ".join(f"{t} {s * 1e3:.4g} ms" for t, s in zip(drawn["titles"], drawn["span_s"])))
    print(f"wrote {drawn['path']}")
    return 0


def cmd_simulate(args) -> int:
    from hpcnn.cli_tools import cmd_simulate as run
    return run(args)


def cmd_plan(args) -> int:
    from hpcnn.cli_tools import cmd_plan as run
    return run(args)


def cmd_calibrate(args) -> int:
    from hpcnn.cli_tools import cmd_calibrate as run
    return run(args)


COMMANDS = {"train": cmd_train, "info": cmd_info, "report": cmd_report, "plan": cmd_plan,
            "simulate": cmd_simulate, "calibrate": cmd_calibrate}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        import hpcnn
        print(f"hpcnn {hpcnn.__version__}")
        return 0
    cmd = COMMANDS.get(argv[0])
    if cmd is None:
        to_stderr(f"hpcnn: unknown command {argv[0]!r}\n\n{USAGE}")
        return 2
    try:
        return cmd(argv[1:])
    except BrokenPipeError:          # output piped into a reader that stopped (| head)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
