"""TCP ports for the process groups the tests start, kept apart between pytest-xdist workers.

Every gloo process group binds its store on ``MASTER_PORT``. A port the OS hands out for
``bind(0)`` is free only until the socket closes, and it comes from the range that gloo's own
connections draw from too: under ``pytest -n 2`` a worker could probe a port that the other
worker's group, or one of its connections, takes before the store binds it. So each worker
draws from a block of its own, below the OS's ephemeral range, and never hands out a port
twice: its groups cannot meet another worker's, nor a connection's.
"""

from __future__ import annotations

import itertools
import os
import socket

FIRST, BLOCK = 20000, 1000  # worker gwN: ports FIRST + N*BLOCK to FIRST + (N+1)*BLOCK - 1
_drawn = itertools.count()


def worker_index() -> int:
    """This pytest-xdist worker's number (``gw3`` is 3); 0 outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0


def ephemeral_start() -> int:
    """The first port of the OS's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """The next port of this worker's block that binds on 127.0.0.1 now."""
    start = FIRST + worker_index() * BLOCK
    if start + BLOCK > ephemeral_start():
        raise RuntimeError(
            f"pytest-xdist worker {worker_index()} would draw ports from the OS's ephemeral "
            f"range ({ephemeral_start()} on): run fewer workers (-n)"
        )
    for _ in range(BLOCK):
        port = start + next(_drawn) % BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # held, or lingering after an earlier group
                continue
        return port
    raise RuntimeError(f"no free port in {start}-{start + BLOCK - 1}")
