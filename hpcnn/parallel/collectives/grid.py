"""The process grid: world ranks arranged as dp x tp x pp, with one sub-communicator per axis.

Rank order (tensor-parallel fastest, so tensor-parallel peers share a node)::

    world_rank = tp_rank + tp * (dp_rank + dp * pp_rank)

Worked example, 8 ranks as dp=2, tp=2, pp=2::

    world rank   0  1  2  3  4  5  6  7
    tp_rank      0  1  0  1  0  1  0  1
    dp_rank      0  0  1  1  0  0  1  1
    pp_rank      0  0  0  0  1  1  1  1

    tensor-parallel groups: [0,1] [2,3] [4,5] [6,7]
    data-parallel groups:   [0,2] [1,3] [4,6] [5,7]
    pipeline groups:        [0,4] [1,5] [2,6] [3,7]

Rank 5 is ``TP(1/2)-DP(0/2)-PP(1/2)``: its previous pipeline stage is rank 1, the next is
``MPI.PROC_NULL`` (it is the last stage). A world size that is not dp*tp*pp is rejected on every
rank, with the numbers, before any communication.

    mpiexec -n 8 python -m mpi4py -c "from mpi4py import MPI; from hpcnn.parallel.collectives.grid import \\
        ProcessGrid; print(ProcessGrid(MPI.COMM_WORLD, 2, 2, 2))"
"""
from __future__ import annotations


class GridError(ValueError):
    """The requested layout does not fit the world."""


def coords_of(rank: int, dp: int, tp: int, pp: int) -> tuple[int, int, int]:
    """World rank -> (dp_rank, tp_rank, pp_rank) under the rank order above."""
    tp_rank = rank % tp
    dp_rank = (rank // tp) % dp
    pp_rank = rank // (tp * dp)
    return dp_rank, tp_rank, pp_rank


def rank_of(dp_rank: int, tp_rank: int, pp_rank: int, dp: int, tp: int, pp: int) -> int:
    """(dp_rank, tp_rank, pp_rank) -> world rank."""
    return tp_rank + tp * (dp_rank + dp * pp_rank)


def check_layout(world_size: int, dp: int, tp: int, pp: int) -> None:
    """Raise GridError naming the values unless dp, tp, pp >= 1 and dp*tp*pp == world_size."""
    for name, v in (("dp", dp), ("tp", tp), ("pp", pp)):
        if not isinstance(v, int) or v < 1:
            raise GridError(f"{name} must be a positive integer, got {v!r}")
    if dp * tp * pp != world_size:
        raise GridError(f"world size ({world_size}) != dp*tp*pp ({dp}*{tp}*{pp} = {dp * tp * pp})")


class ProcessGrid:
    """dp x tp x pp sub-communicators of ``comm`` (built with ``Comm.Split``; call :meth:`free`).

    Attributes: ``world`` (the parent communicator), ``rank``, ``size``, ``dp``, ``tp``, ``pp``,
    ``dp_rank``, ``tp_rank``, ``pp_rank``, ``dp_comm``, ``tp_comm``, ``pp_comm``,
    ``prev_stage``/``next_stage`` (world ranks of the pipeline neighbours, or ``MPI.PROC_NULL``;
    point-to-point on ``pp_comm`` uses ``pp_prev``/``pp_next``, ranks within ``pp_comm``).
    """

    def __init__(self, comm, dp: int = 1, tp: int = 1, pp: int = 1):
        from mpi4py import MPI
        check_layout(comm.Get_size(), dp, tp, pp)       # same check, same message, every rank
        self.world = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.dp, self.tp, self.pp = dp, tp, pp
        self.dp_rank, self.tp_rank, self.pp_rank = coords_of(self.rank, dp, tp, pp)
        # colour = the coordinates that stay fixed within a group; key = position along the axis
        self.tp_comm = comm.Split(color=self.dp_rank + dp * self.pp_rank, key=self.tp_rank)
        self.dp_comm = comm.Split(color=self.tp_rank + tp * self.pp_rank, key=self.dp_rank)
        self.pp_comm = comm.Split(color=self.tp_rank + tp * self.dp_rank, key=self.pp_rank)
        null = MPI.PROC_NULL
        first, last = self.pp_rank == 0, self.pp_rank == pp - 1
        self.pp_prev = null if first else self.pp_rank - 1
        self.pp_next = null if last else self.pp_rank + 1
        self.prev_stage = null if first else rank_of(self.dp_rank, self.tp_rank, self.pp_rank - 1, dp, tp, pp)
        self.next_stage = null if last else rank_of(self.dp_rank, self.tp_rank, self.pp_rank + 1, dp, tp, pp)
        self._freed = False

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def group(self, axis: str) -> list[int]:
        """World ranks of this rank's group along ``axis`` ("dp", "tp" or "pp"), in axis order."""
        if axis not in ("dp", "tp", "pp"):
            raise ValueError(f"axis must be 'dp', 'tp' or 'pp', got {axis!r}")
        return self._group_of(axis, self.rank)

    def spanning(self, nodes: list[int]) -> dict:
        """For each axis ("tp", "pp", "dp"), how many of its groups span more than one node,
        ``nodes`` giving each world rank's node (:func:`.topology.node_map`)."""
        out = {}
        for k, axis in ((1, "tp"), (2, "pp"), (0, "dp")):      # (its place in coords_of)
            firsts = [r for r in range(self.size)                # each group once: its rank 0
                      if coords_of(r, self.dp, self.tp, self.pp)[k] == 0]
            out[axis] = sum(len({nodes[q] for q in self._group_of(axis, r)}) > 1 for r in firsts)
        return out

    def _group_of(self, axis: str, rank: int) -> list[int]:
        d, t, p = coords_of(rank, self.dp, self.tp, self.pp)
        n = {"tp": self.tp, "dp": self.dp, "pp": self.pp}[axis]
        at = {"tp": lambda i: (d, i, p), "dp": lambda i: (i, t, p), "pp": lambda i: (d, t, i)}
        return [rank_of(*at[axis](i), self.dp, self.tp, self.pp) for i in range(n)]

    def free(self) -> None:
        """Free the sub-communicators; using the grid afterwards raises an error."""
        if self._freed:
            return
        for c in (self.tp_comm, self.dp_comm, self.pp_comm):
            c.Free()
        self._freed = True

    def __getattribute__(self, name):
        if name.endswith("_comm") and object.__getattribute__(self, "_freed"):
            raise RuntimeError(f"ProcessGrid.{name} used after free()")
        return object.__getattribute__(self, name)

    def __str__(self) -> str:
        return (f"TP({self.tp_rank}/{self.tp})-DP({self.dp_rank}/{self.dp})-"
                f"PP({self.pp_rank}/{self.pp})-Rank({self.rank}/{self.size})")

    __repr__ = __str__
