"""Several nodes on one Linux machine, joined by a throttled network: an emulated cluster.

Each node is a network namespace (and a UTS namespace: its own host name) with one interface,
the end of a veth pair whose other end is on a bridge in the root namespace; each node's egress
is throttled by a token bucket (``tc qdisc ... tbf rate R``), so every byte between two nodes
crosses two throttled interfaces' worth of queueing at rate R per direction. mpiexec (MPICH's
hydra) starts each node's ranks inside its namespace through a launcher that stands where ssh
would, so MPI sees N hosts: its shared memory inside a node, TCP between nodes (UCX with
``UCX_TLS=tcp``) through the throttle. The latency between nodes is what the veth pair and TCP
give (tens of microseconds here; measured, not set: this kernel has no ``netem``).

It is an emulation: every node's ranks share this machine's cores and memory bandwidth with the
other nodes'. Commands run under it get ``HPCNN_EMULATED_LINK`` (e.g. ``tbf 500mbit, netns``),
which the run header and log record.

    sudo .venv/bin/python benchmarks/netns_cluster.py --nodes=2 --per-node=2 --rate=500mbit \\
        -- .venv/bin/python -m mpi4py -m hpcnn train --model=mlp --dp=4 --allreduce=hier

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2 with the ``tbf`` qdisc, util-linux's
``unshare``, and MPICH's hydra with UCX (the ``mpich`` wheel). :func:`cluster` removes the
namespaces, the bridge and the files it wrote on the way out, also on an error or Ctrl-C.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile

SUBNET = "10.213.7"          # node i is SUBNET.(i + 1), the bridge SUBNET.254
# The throttle's queue, in milliseconds at its rate: short, as a switch's buffers are; a long
# one delays the acknowledgements and rendezvous requests going the other way behind the data
# (measured: a 16 MiB exchange both ways at once ran at 30 of 60 MB/s with 200 ms, 39 with 5 ms).
QUEUE_MS = 5

LAUNCHER = """#!/bin/bash
# hydra calls "launcher -x HOST COMMAND" as it would call ssh: run COMMAND in HOST's namespaces.
[ "$1" = "-x" ] && shift
host=$1; shift
exec ip netns exec "$host" unshare --uts bash -c 'hostname "$0" && exec bash -c "$1"' "$host" "$*"
"""


def usable() -> str | None:
    """None where this machine can build the cluster, else why not (one line)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs {tool!r} on PATH"
    name = f"hpcnnprobe{os.getpid() % 100000}"
    if _run(["ip", "netns", "add", name], check=False).returncode:
        return "cannot create a network namespace (CAP_SYS_ADMIN, CAP_NET_ADMIN)"
    try:
        _run(["ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        if _run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "p0", "root", "tbf",
                 "rate", "1gbit", "burst", "256kb", "latency", "100ms"], check=False).returncode:
            return "the kernel has no tbf qdisc"
    finally:
        _run(["ip", "netns", "del", name], check=False)
    return None


def _run(cmd, check=True):
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip() or out.returncode}")
    return out


@contextlib.contextmanager
def cluster(nodes: int, rate: str):
    """Build ``nodes`` namespaces throttled at ``rate`` (tc's syntax: ``500mbit``, ``1gbit``);
    yield ``(names, launcher)``: the nodes' host names and the path of the hydra launcher."""
    if not 2 <= nodes <= 200:
        raise ValueError(f"nodes = {nodes}: expected 2..200")
    tag = f"{os.getpid() % 100000}"
    bridge, names = f"hpbr{tag}", [f"hpn{tag}x{i}" for i in range(nodes)]
    tmp = tempfile.mkdtemp(prefix="hpcnn-netns-")
    made = []
    try:
        _run(["ip", "link", "add", bridge, "type", "bridge"])
        made.append(("link", bridge))
        _run(["ip", "addr", "add", f"{SUBNET}.254/24", "dev", bridge])
        _run(["ip", "link", "set", bridge, "up"])
        hosts = [f"127.0.0.1 localhost", f"{SUBNET}.254 {socket.gethostname()}"]
        hosts += [f"{SUBNET}.{i + 1} {n}" for i, n in enumerate(names)]
        for i, n in enumerate(names):
            _node(i, n, bridge, rate, hosts, made)
        launcher = os.path.join(tmp, "launch")
        with open(launcher, "w") as f:
            f.write(LAUNCHER)
        os.chmod(launcher, 0o755)
        yield names, launcher
    finally:
        for kind, name in reversed(made):
            if kind == "netns":
                _run(["ip", "netns", "del", name], check=False)
                shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
            else:
                _run(["ip", "link", "del", name], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def _node(i: int, name: str, bridge: str, rate: str, hosts: list, made: list) -> None:
    """Node ``i``: its namespace, its veth pair to the bridge, its address, its throttle, and
    the hosts file ``ip netns exec`` shows it (the other nodes and mpiexec's host by name)."""
    _run(["ip", "netns", "add", name])
    made.append(("netns", name))
    os.makedirs(f"/etc/netns/{name}", exist_ok=True)
    with open(f"/etc/netns/{name}/hosts", "w") as f:
        f.write("\n".join(hosts) + "\n")
    veth = f"{bridge}v{i}"
    _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name])
    made.append(("link", veth))
    _run(["ip", "link", "set", veth, "master", bridge])
    _run(["ip", "link", "set", veth, "up"])
    _run(["ip", "-n", name, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0"])
    for dev in ("eth0", "lo"):
        _run(["ip", "-n", name, "link", "set", dev, "up"])
    _run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
          "rate", rate, "burst", "256kb", "latency", f"{QUEUE_MS}ms"])


def mpiexec_line(names, launcher: str, per_node: int, rate: str, env: dict | None = None) -> list:
    """The mpiexec command line (to which the program is appended) that starts ``per_node``
    ranks on each node, consecutive ranks on a node, TCP between nodes. UCX's rendezvous is
    off (``UCX_RNDV_THRESH=inf``: messages go eagerly, in fragments): over this TCP link its
    requests queue behind the data going the other way (measured: the library's ring allreduce
    of 64 MiB on 2 x 2 nodes at 500 Mbit/s took 2.39 s with it, 1.89 s without; the link's
    bound is 1.61 s)."""
    from hpcnn import scripts
    mpiexec = scripts.mpiexec()
    genv = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", "UCX_RNDV_THRESH": "inf",
            "OMP_NUM_THREADS": "1",
            "HPCNN_EMULATED_LINK": f"tbf {rate}, netns", **(env or {})}
    line = [mpiexec, "-launcher", "ssh", "-launcher-exec", launcher,
            "-hosts", ",".join(f"{n}:{per_node}" for n in names), "-n", str(per_node * len(names))]
    for k, v in genv.items():
        line += ["-genv", k, v]
    return line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--rate", default="500mbit", help="each node's link, per direction (tc)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the program and its arguments")
    a = ap.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    why = usable()
    if why or not command or a.per_node < 1:
        print(f"netns_cluster: {why or 'give a command after --, and --per-node >= 1'}",
              file=sys.stderr)
        return 2
    with cluster(a.nodes, a.rate) as (names, launcher):
        line = mpiexec_line(names, launcher, a.per_node, a.rate,
                            {"PYTHONPATH": os.environ.get("PYTHONPATH", os.getcwd())})
        print("netns_cluster:", shlex.join(line + command), flush=True)
        return subprocess.run(line + command).returncode


if __name__ == "__main__":
    sys.exit(main())
