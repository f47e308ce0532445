"""Which node a rank runs on, by one name every rank of a run agrees on.

A launcher that places ranks on the nodes of a cluster (executor/launch_ray.py: the Ray node id) names the
node in ``NODE_ENV``; local processes fall back to the host name. The names only need to be equal for ranks
that share a node and different otherwise: the calibration's collectives group ranks by them
(executor/microbench/collectives.py), and a simulated cluster of several Ray nodes on one host
(ray.cluster_utils.Cluster, the tests) has one host name but distinct node ids.
"""

from __future__ import annotations

import os
import socket

NODE_ENV = "FOLDTUNE_NODE_ID"


def node_name() -> str:
    """This process's node: ``$FOLDTUNE_NODE_ID`` when its launcher set it, else the host name."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS reports one, else the machine's count):
    what CPU ranks on this node share."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
