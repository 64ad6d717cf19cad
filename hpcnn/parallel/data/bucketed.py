"""Data parallelism: one chain per replica, gradients summed over the dp ranks in buckets.

Each rank runs the forward and backward of its own share of the global batch; the gradients, kept
in one flat buffer per dtype and cut into byte-range *buckets*, are summed with an allreduce. With
``overlap`` a bucket's allreduce starts during the backward, as soon as every block it touches is
done (the chain calls ``on_block_done(i)`` after block ``i``), so communication of the last layers
runs while the first layers still compute (Li et al., PyTorch Distributed, VLDB 2020).

Combining the replicas (Moreno-Álvarez, Paoletti, Rico-Gallego, Haut, J. Supercomputing 2022).
Rank i holds b_i of the B samples of the global batch; its loss is the local mean, its gradient
g_i. The caller scales the backward by ``dloss = c_i``, so the allreduce SUM gives
G = Σ_i c_i g_i: ``weighted`` c_i = b_i/B (exactly the serial run's gradient of the mean over the
global batch, whatever the shares); ``uniform`` c_i = 1/P (a sample on a replica with a small
share counts more); ``equal`` all b_i = B/P, where the two coincide. With gradient accumulation
a micro-batch of m samples gets c = m/B or m/(P b_i): :func:`dloss_for` returns these factors.

Finiteness check, one pass: before a bucket is sent its Σ g² is computed, and the sum over a flat
buffer's buckets rides in one extra *sentinel* element at its end, so after the allreduce it holds
Σ_ranks Σ g² on every rank: non-finite if any rank's gradient was or a finite sum overflowed; only
then are the reduced buffers tested element by element.

    mpiexec -n 2 python -m mpi4py -c "import numpy as np; \\
        from hpcnn.nn import models; from hpcnn.parallel.collectives import world; \\
        from hpcnn.parallel.data.bucketed import DataParallel; m = models.mlp(8, (16,), 4); \\
        dp = DataParallel(m, world()); x = np.ones((4, 8), np.float32); \\
        loss, c = m.forward(x, np.zeros(4, int)); dp.backward(0.5, c); print(dp.finish(0))"
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import numpy

from hpcnn import backend

MODES = ("weighted", "uniform", "equal")
ALGORITHMS = ("mpi", "ring", "rd", "shm", "cma", "hier", "auto")   # blocking (overlap=False)
NONBLOCKING = ("mpi", "ring", "shm", "hier", "auto")   # Communicator.iallreduce (overlap=True)


# -- pure helpers ----------------------------------------------------------------------------------
def check_shares(shares, total: int | None = None) -> list[int]:
    """``shares`` as ints, each >= 1, summing to ``total`` (if given); else ValueError."""
    s = [int(v) for v in shares]
    if not s or any(v < 1 for v in s) or any(v != w for v, w in zip(s, shares)):
        raise ValueError(f"shares must be integers >= 1, got {list(shares)}")
    if total is not None and sum(s) != total:
        raise ValueError(f"shares {s} sum to {sum(s)}, not the global batch {total}")
    return s


def dloss_for(mode: str, share: int, shares, local: int | None = None) -> float:
    """The factor c by which a backward of ``share`` samples is scaled (see the module docstring).

    Parameters: ``mode`` weighted | uniform | equal; ``share`` the samples of this backward (m, a
    micro-batch, or b_i, the rank's whole share); ``shares`` every rank's b_j (Σ b_j = B);
    ``local`` this rank's b_i when ``share`` is a micro-batch of it (default: ``share``).
    Returns m/B (weighted, equal) or m/(P b_i) (uniform).
    """
    if mode not in MODES:
        raise ValueError(f"dloss mode must be one of {MODES}, got {mode!r}")
    s = check_shares(shares)
    b_i = share if local is None else local
    if b_i not in s:
        raise ValueError(f"local share {b_i} is not one of the shares {s}")
    if not 1 <= share <= b_i:
        raise ValueError(f"micro-batch of {share} samples must lie in [1, {b_i}] (the local share)")
    if mode == "equal" and len(set(s)) != 1:
        raise ValueError(f"mode 'equal' needs equal shares, got {s}")
    if mode == "uniform":
        return share / (len(s) * b_i)
    return share / sum(s)


def shard(global_indices, shares, rank: int):
    """This rank's contiguous slice of the global batch: offsets are the cumulative shares."""
    s = check_shares(shares, len(global_indices))
    if not 0 <= rank < len(s):
        raise ValueError(f"rank {rank} out of range for {len(s)} shares {s}")
    lo = sum(s[:rank])
    return global_indices[lo:lo + s[rank]]


def narrow_allreduce(comm, buf, dtype) -> None:
    """Sum the float32 ``buf`` over the ranks of ``comm`` in place, every message in the 16-bit
    ``dtype`` (``--grad_reduce_dtype=param``): a ring, reduce-scatter then all-gather, through
    ``comm.sendrecv`` of the messages' bits (MPI has no bfloat16). Each reduce-scatter hop adds
    the received chunk in float32 and sends its partial sum rounded to ``dtype``; the owner of a
    finished chunk rounds it once and the all-gather passes it on unchanged, so every rank ends
    with the same values. Per rank 2 (P-1)/P of the 16-bit bytes: half a float32 ring's."""
    p, r = comm.size, comm.rank
    if p == 1:
        return
    xp, bits = backend.xp, numpy.uint16
    cuts = [len(buf) * c // p for c in range(p + 1)]

    def chunk(c):
        return buf[cuts[c % p]:cuts[c % p + 1]]

    def hop(send, c_recv):                   # send right, receive chunk c_recv from the left
        recv = xp.empty(chunk(c_recv).shape, dtype)
        comm.sendrecv(send.astype(dtype).view(bits), (r + 1) % p, recv.view(bits), (r - 1) % p)
        return recv

    for s in range(p - 1):                   # reduce-scatter: rank r completes chunk r + 1
        chunk(r - s - 1)[...] += hop(chunk(r - s), r - s - 1)
    chunk(r + 1)[...] = chunk(r + 1).astype(dtype)
    for s in range(p - 1):                   # all-gather of the rounded chunks
        chunk(r - s)[...] = hop(chunk(r + 1 - s), r - s)


def non_finite(step: int, local_bad) -> FloatingPointError:
    """The error of a reduced gradient that is not finite at ``step``, naming the ranks whose
    own gradient was not (``local_bad``: one flag per rank)."""
    ranks = ", ".join(str(int(r)) for r in numpy.flatnonzero(local_bad))
    return FloatingPointError(f"non-finite gradient at step {step} on rank(s) "
                              f"{ranks or 'none (the sum overflowed)'}")


@dataclass
class Bucket:
    """Elements [lo, hi) of flat buffer ``flat``; final after block ``ready``'s backward.
    The ``last`` bucket of a flat buffer also carries its sentinel element (its last)."""

    flat: int
    lo: int
    hi: int
    ready: int
    params: list
    view: object = None
    last: bool = False
    counts: list = None          # ZeRO-2 (hpcnn.parallel.data.sharded): its elements per rank's
    at: int = 0                  # part, where they start in this rank's part, the storage's
    source: object = None        # binder


class DataParallel:
    """Bucketed gradient allreduce for ``model`` replicated on every rank of ``comm``.

    Parameters: ``bucket_mb`` bucket size in MiB (a bucket may cut a parameter); ``algorithm``
    mpi | ring | auto, or also rd without overlap (:mod:`hpcnn.parallel.collectives.algorithms`;
    ring requests advance when tested, which the backward does after every block); ``overlap`` start buckets
    during the backward; ``check_finite`` raise FloatingPointError in :meth:`finish` if the sum
    is not finite. The flat buffers hold the gradients in their own dtype (float32 for 16-bit
    parameters); :meth:`numerics` changes the check and the dtype of the messages.

    One step: ``model.zero_grad()``; per micro-batch ``loss, caches = model.forward(x, y)`` and
    ``dp.backward(dloss, caches, sync=last)``; then ``dp.finish(step)`` and the optimizer step.
    Plain twin: :class:`hpcnn.parallel.data.naive.NaiveDataParallel`.
    """

    def __init__(self, model, comm, *, bucket_mb: float = 25.0, algorithm: str = "mpi",
                 overlap: bool = True, check_finite: bool = True):
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb={bucket_mb}: must be > 0")
        allowed = NONBLOCKING if overlap else ALGORITHMS
        if algorithm not in allowed:
            raise ValueError(f"algorithm must be one of {allowed} with overlap={bool(overlap)}, "
                             f"got {algorithm!r}")
        self.model, self.comm = model, comm
        self.bucket_mb, self.algorithm = float(bucket_mb), algorithm
        self.overlap, self.check_finite = bool(overlap), bool(check_finite)
        self.reduce_dtype = None                       # None: messages in the gradients' dtype
        # owner = first block holding the parameter: its gradient is final after that backward
        owner = {}
        for i, blk in enumerate(model.blocks):
            for p in blk.params:
                owner.setdefault(id(p), i)
        unique = list({id(p): p for p in model.params}.values())
        self.params = unique[::-1]                     # the order the backward produces them
        self.flats, self.buckets = [], []
        for dtype in dict.fromkeys(p.grad_dtype for p in self.params):
            self._layout([p for p in self.params if p.grad_dtype == dtype], owner)
        # launch order: identical on every rank (derived from the model alone)
        self.order = sorted(self.buckets, key=lambda b: (-b.ready, b.flat, b.lo))
        for k in range(len(self.flats)):               # the sentinel's bucket goes last
            assert [b for b in self.order if b.flat == k][-1].last
        self.nbytes = sum(f.nbytes for f in self.flats)  # bytes reduced per step
        self._reset()

    def _layout(self, params, owner) -> None:
        """One flat buffer for ``params`` (gradients rebound as views) and a sentinel element,
        cut into byte ranges."""
        xp, k = backend.xp, len(self.flats)
        dtype = params[0].grad_dtype
        offs = numpy.cumsum([0] + [p.size for p in params])
        n = int(offs[-1])
        # (n gradients, 1 sentinel); in a shared-memory window when the ranks share a node, so
        # that the shm allreduce sums the peers' buffers in place without copying them in
        flat = (self.comm.shared_zeros(n + 1, dtype) if self.comm.size > 1
                else xp.zeros(n + 1, dtype=dtype))
        for p, o in zip(params, offs):
            p.bind_grad(flat[o:o + p.size].reshape(p.shape))
        self.flats.append(flat)
        step = max(1, int(self.bucket_mb * 2 ** 20) // dtype.itemsize)
        j = 0                                          # first parameter not ending before lo
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            while offs[j + 1] <= lo:
                j += 1
            ps = [params[q] for q in range(j, len(params)) if offs[q] < hi]
            hi += hi == n                              # the last bucket carries the sentinel
            self.buckets.append(Bucket(k, lo, hi, min(owner[id(p)] for p in ps), ps, flat[lo:hi],
                                       last=hi == n + 1))

    def _reset(self) -> None:
        # (position in launch order, block whose backward completed it; -1: finish) per bucket
        self.last_launched, self.launched = getattr(self, "launched", []), []
        self._next, self._reqs, self._local_bad, self._reduce_s = 0, [], False, 0.0
        self.waited_s = 0.0            # blocked in the step on dp collectives (ZeRO-2 and 3's)
        self._sq = [0.0] * len(self.flats)

    @property
    def n_buckets(self) -> int:
        return len(self.buckets)

    def auto_sizes(self) -> list[int]:
        """The bucket sizes (bytes) whose algorithm ``auto`` takes from the communicator's
        calibrated table, i.e. what a start-up calibration must time
        (:func:`hpcnn.parallel.collectives.autotune.for_run`): the buckets of a blocking ``auto``
        (:func:`hpcnn.parallel.collectives.algorithms.table_sizes`); none with ``overlap``, whose
        non-blocking ``auto`` goes by fixed thresholds, or with another algorithm."""
        if self.algorithm != "auto" or self.overlap:
            return []
        from hpcnn.parallel.collectives.algorithms import table_sizes
        return table_sizes(self.comm, [b.view for b in self.buckets])

    def zero_grad(self) -> None:
        self.model.zero_grad()

    def numerics(self, check_finite: bool = True, reduce_dtype=None) -> None:
        """Mixed precision (:func:`hpcnn.nn.precision.attach`): ``check_finite=False`` leaves
        a non-finite gradient to the loss scaler (no error); ``reduce_dtype`` (a 16-bit dtype)
        sends every bucket in it, blocking (:func:`narrow_allreduce`), instead of float32."""
        self.check_finite, self.reduce_dtype = bool(check_finite), reduce_dtype

    # -- the step ---------------------------------------------------------------------------------
    def backward(self, dloss, caches, sync: bool = True) -> None:
        """Backward of one (micro-)batch from the loss-gradient factor ``dloss``, accumulating
        into the gradients (the standalone use; the training loop's step engine runs the
        backward itself with :attr:`hook`).

        ``sync=True`` marks the last micro-batch of a step: its buckets are reduced (started
        during the backward with ``overlap``, else reduced after it, blocking). ``sync=False``
        only accumulates; nothing is communicated.
        """
        self.model.backward(dloss, caches, need_dx=False,
                            on_block_done=self.hook if sync else None)
        if sync and not self.overlap:
            self._launch_ready(-1)

    @property
    def hook(self):
        """The ``on_block_done(i)`` callback for the backward of a step's last micro-batch: it
        starts every bucket final after block i (None without overlap: :meth:`finish` reduces)."""
        return self._on_block_done if self.overlap else None

    def hook_for(self, mb: int, last: int):
        """The ``on_block_done`` callback for micro-batch ``mb``'s backward, ``last`` the step's
        last micro-batch: :attr:`hook` for the last, None before it (only accumulates)."""
        return self.hook if mb == last else None

    reduces = True             # a step waits for it (the loop times that wait)
    shards_gradients = False   # each rank holds the whole reduced gradient (ZeRO-2 does not)
    shards_parameters = False  # each rank holds the whole parameters (ZeRO-3 does not)

    def whole(self, gather: bool = True, write_back: bool = False):
        """A context in which every parameter is whole: they always are (ZeRO-3 gathers)."""
        return contextlib.nullcontext()

    def _on_block_done(self, i: int) -> None:
        self._launch_ready(i)

    def _launch_ready(self, i: int) -> None:
        """Start every bucket final after block ``i``, in order; poke the ones in flight."""
        while self._next < len(self.order) and self.order[self._next].ready >= i:
            self._launch(self.order[self._next])
            self.launched.append((self._next, i))
            self._next += 1
        for r in self._reqs:
            if not r.done:
                r.test()                               # progress for progress-driven algorithms

    def _launch(self, b: Bucket) -> None:
        for p in b.params:
            if p._zero:
                p.grad                                 # untouched this step: write the zeros now
        if self.check_finite:
            g = b.view[:-1] if b.last else b.view
            sq = backend.square_sum(g)
            if not self._local_bad:
                self._local_bad = not backend.finite(g, sq)
            self._sq[b.flat] += sq
            if b.last:
                b.view[-1] = self._sq[b.flat]          # summed over ranks with the gradients
        if self.reduce_dtype is not None:
            t = time.perf_counter()
            narrow_allreduce(self.comm, b.view, self.reduce_dtype)
            self._reduce_s += time.perf_counter() - t
        elif self.overlap:
            self._reqs.append(self.comm.iallreduce(b.view, algorithm=self.algorithm))
        else:
            t = time.perf_counter()
            self.comm.allreduce(b.view, self.algorithm)
            self._reduce_s += time.perf_counter() - t

    def finish(self, step: int) -> dict:
        """Wait for every bucket (reducing any not yet started) and check the sum is finite.

        Returns ``{"wait_s": seconds blocked waiting for started buckets, "reduce_s": seconds in
        blocking reductions, "bytes": bytes reduced (with the sentinels), "buckets": n}``. Raises
        FloatingPointError("non-finite gradient at step S on rank(s) R") on every rank when the
        reduced gradient is not finite, R the ranks whose local gradient was not.
        """
        try:
            self._launch_ready(-1)
            t = time.perf_counter()
            for r in self._reqs:
                r.wait()
            info = {"wait_s": time.perf_counter() - t, "reduce_s": self._reduce_s,
                    "bytes": self.nbytes, "buckets": len(self.order)}
            self._reduced()
            if self.check_finite:
                self._check(step)
            return info
        finally:
            self._reset()

    def _reduced(self) -> None:
        """Every bucket of the step is reduced (a subclass frees what it no longer needs)."""

    def _check(self, step: int) -> None:
        # sentinels and reduced buffers are the same on every rank: all take the same branches
        xp = backend.xp                  # the sentinels read at once: one transfer on a device
        sentinels = backend.to_host(xp.stack([f[-1] for f in self.flats])) if self.flats else ()
        if all(math.isfinite(float(v)) for v in sentinels):
            return
        if all(bool(backend.to_host(xp.isfinite(f[:-1]).all())) for f in self.flats):
            return                                     # only a sum of squares overflowed
        flags = self.comm.allgather_scalars([1.0 if self._local_bad else 0.0])
        raise non_finite(step, flags[:, 0])

    # -- replicas ---------------------------------------------------------------------------------
    def release(self) -> None:
        """Move the gradients back to private memory and free the shared windows (call before
        the communicator is freed; the parameters keep their gradients)."""
        for p in self.params:
            p.bind_grad(backend.xp.zeros(p.shape, dtype=p.grad_dtype))
        self.flats, self.buckets, self.order, self._reqs = [], [], [], []   # no window views stay
        if self.comm.size > 1:
            from hpcnn.parallel.collectives import algorithms
            algorithms.free(self.comm)

    def broadcast_parameters(self, root: int = 0) -> None:
        """Copy ``root``'s parameters to every rank (one broadcast per dtype); optimizer state,
        if any, is the caller's to restore identically."""
        if not 0 <= root < self.comm.size:
            raise ValueError(f"root {root} out of range for {self.comm.size} ranks")
        xp = backend.xp
        for dtype in dict.fromkeys(p.data.dtype for p in self.params):
            ps = [p for p in self.params if p.data.dtype == dtype]
            buf = xp.concatenate([p.data.reshape(-1) for p in ps])
            self.comm.bcast(backend.bits(buf), root)      # (16 bits: as uint16)
            o = 0
            for p in ps:
                p.data[...] = buf[o:o + p.size].reshape(p.shape)
                o += p.size

    def check_replicas_equal(self) -> bool:
        """True on every rank iff all replicas' checksums (sum, sum of squares, strided sum of
        each parameter) are bitwise equal: two small allreduces (max and min)."""
        xp = backend.xp
        vals = []
        for p in self.params:
            d = p.data.reshape(-1)
            vals += [float(d.sum()), float(xp.vdot(d, d)), float(d[::7].sum())]
        v = numpy.nan_to_num(numpy.asarray(vals), nan=1e300, posinf=1e301, neginf=-1e301)
        hi = self.comm.allreduce_scalars(v, "max")
        lo = self.comm.allreduce_scalars(v, "min")
        return bool(numpy.array_equal(hi, lo))

    def __repr__(self) -> str:
        return (f"DataParallel({self.model.name}, {self.comm.size} ranks, {self.n_buckets} buckets"
                f" of <= {self.bucket_mb:g} MiB, {self.nbytes / 2**20:.1f} MiB, "
                f"algorithm={self.algorithm}, overlap={self.overlap})")


class LocalGradients:
    """The data-parallel engine of a run with one replica and no MPI (a serial run's context):
    the same interface as :class:`DataParallel`, with nothing to reduce."""

    hook = None
    hook_for = DataParallel.hook_for
    waited_s = 0.0
    reduces = False
    overlap = False
    shards_gradients = shards_parameters = False
    last_launched: list = []
    whole = DataParallel.whole

    def __init__(self, model):
        self.model = model

    def finish(self, step: int) -> dict:
        return {}

    def numerics(self, check_finite: bool = True, reduce_dtype=None) -> None:
        """Nothing is reduced or checked here (the loss scaler checks the gradients itself)."""

    def auto_sizes(self) -> list[int]:
        return []

    def broadcast_parameters(self, root: int = 0) -> None:
        return None

    def release(self) -> None:
        return None
