"""Launch one trial's ranks through Ray: one placement group, one actor per rank, torch.distributed inside.

``launch(fn, world_size, args, ...)`` has the contract of :func:`executor.launch_local.launch`: every
rank runs ``fn(rank, world_size, *args)`` after ``torch.distributed`` is initialised (gloo on CPU, NCCL on
GPU) and the result is a :class:`~executor.launch_local.LaunchResult` with the same failure reasons (out
of memory -> 'out of memory on rank N: ...', a crashed or killed rank -> 'rank N died ...', a hung rank ->
'timeout after ...'). In addition it streams rank 0's per-step times to ``on_step(step, seconds)`` while
the ranks run (see :mod:`executor.progress`); ``on_step`` returning True stops every rank after the same
step, and the run returns normally with what it measured so far.

Placement follows the planner's idea of nodes (:func:`spec.rank_groups.node_of_rank`): with
``ranks_per_node`` G, ranks 0..G-1 share a node, ranks G..2G-1 the next one, and so on, so the groups that
Megatron's ``tp-cp-ep-dp-pp`` order keeps inside a node are inside one Ray node. Per trial the launcher
reserves one placement group, ``STRICT_SPREAD``, with one bundle per node of the trial holding that
node's G ranks ({'CPU': G, 'GPU': G}; for gloo ranks {'CPU': G}, or G units of ``FOLDTUNE_RAY_RANK_RESOURCE``
beside the CPUs); rank r's actor reserves one unit of it in bundle ``node_of_rank(r, G)``. One group per
trial keeps the reservation atomic: two trials waiting side by side never hold half a cluster each.
Strict spreading puts each bundle on its own Ray node, so a trial never shares a device with another
trial and a trial of G ranks or fewer sits on one node. It waits for the group (trials queue when the
cluster is full, so several trials run at once exactly when there is room), starts the rank actors,
rendezvous through rank 0 (its node's IP and the port of a store that rank 0's actor has already bound on
its own host: no port is picked free and bound later, so a process beside it cannot take it between), and always
tears everything down through Ray: actors killed, placement group removed, and the actors confirmed dead
on every node (on this node the launcher also waits until the rank processes are gone).

Kept ranks: :class:`RayRankPool` (one at a time) and :class:`RayRankPools` (trials side by side) have
``launch``'s contract but keep the placement group and rank actors after a run, for the next run of the same
shape; the default process group is made once, each run starts from a fresh process's state and its own
groups are destroyed after it (:mod:`executor.rank_pool`, which also says when a failure ends them).

Across nodes: the interface and transport settings of NCCL and Gloo (``NCCL_SOCKET_IFNAME``,
``GLOO_SOCKET_IFNAME``, ``NCCL_IB_HCA``, ... see ``FORWARDED_ENV``) are forwarded from the driver to every
rank, plus the names listed in ``FOLDTUNE_RANK_ENV`` (comma-separated). A trial whose node goes away
mid-run fails with ``FailureKind.NODE_LOST`` and the reason 'node lost: ...'.

Ray is imported only here: the front ends import this module where they launch or size a Ray cluster,
never on a light command. ``ray.init`` uses ``FOLDTUNE_RAY_ADDRESS`` (e.g. ``ray://head:10001`` or
``head:6379``) when set, else starts a local Ray without the dashboard and with ``FOLDTUNE_RAY_NUM_CPUS``
CPUs (default max(cores, 8): CPU ranks of a tuning job oversubscribe a small machine on purpose). Either
way with Ray's token authentication on (:mod:`executor.ray_auth`: the cluster's token file, generated on
first use) unless ``RAY_AUTH_MODE=disabled`` is set explicitly.
"""

from __future__ import annotations

import datetime
import logging
import os
import resource
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from executor import ray_auth

# Before the first `import ray` of the process: Ray reads RAY_AUTH_MODE (and where the token is) once, when
# it is imported (measured on Ray 2.60: setting the environment afterwards leaves the mode disabled).
_AUTH_MODE = ray_auth.configure()

import ray  # noqa: E402
from ray._raylet import AuthenticationMode, get_authentication_mode  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from executor import progress, rank_pool  # noqa: E402
from executor.failure import is_out_of_memory
from executor.launch_local import OOM_PREFIX, SAFE_ENV, LaunchResult
from executor.node import NODE_ENV
from spec.errors import SpecError
from spec.failure import FailureKind
from spec.rank_groups import node_of_rank

RAY_ADDRESS_ENV = "FOLDTUNE_RAY_ADDRESS"
RAY_NUM_CPUS_ENV = "FOLDTUNE_RAY_NUM_CPUS"
RANK_RESOURCE_ENV = "FOLDTUNE_RAY_RANK_RESOURCE"
RANK_ENV_ENV = "FOLDTUNE_RANK_ENV"
POLL_S = 0.1
# A rank left behind its peers (they finished a timed step it has not) for this long fails the trial as hung
# before its timeout: ranks meet in every step's collectives, so healthy ones are never a step apart for more than
# a step's tail. The limit is the larger of STALL_MIN_S and STALL_STEPS of the slowest step rank 0 reported
# (seconds); progress is asked for every STALL_POLL_S.
STALL_MIN_S = 15.0
STALL_STEPS = 10
STALL_POLL_S = 2.0
TEARDOWN_WAIT_S = 15.0
# How long rank 0's rendezvous store waits for the other ranks until a run sets its own timeout (seconds).
STORE_TIMEOUT_S = 600.0
# How long a failed run waits for Ray to declare the node of a rank that stopped answering dead (seconds):
# Ray's health check marks a vanished node dead after tens of seconds with its defaults.
NODE_LOSS_WAIT_S = 60.0
# Environment a rank inherits from the driver (the Ray workers were started by the raylet, not by us):
# fault injection, and the settings that choose NCCL's and Gloo's network interface and transport.
FORWARDED_ENV = (progress.FAULT_ENV, "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_SOCKET_IFNAME", "NCCL_SOCKET_FAMILY",
                 "NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_IB_GID_INDEX", "NCCL_NET", "NCCL_CROSS_NIC",
                 "NCCL_P2P_DISABLE", "NCCL_NET_GDR_LEVEL", "GLOO_SOCKET_IFNAME", "GLOO_DEVICE_TRANSPORT")

_init_lock = threading.Lock()

# The local Ray this process starts. Ray runs its workers at niceness 15 by default (worker_niceness), below the
# calibration's local rank processes (the caller's niceness, 0 from a shell): on cores shared with other work
# the trials' ranks then got less CPU than the calibration that priced them, and the measured steps drifted from
# the predictions by the load (docs/time-model.md, "Calibration and trials under the same scheduling"). With 0
# the raylet leaves its workers at its own niceness, the driver's.
LOCAL_SYSTEM_CONFIG: dict[str, Any] = {"prestart_worker_first_driver": False, "enable_worker_prestart": False,
                                       "worker_niceness": 0}


def _connect(address: str | None = None) -> None:
    """Connect to Ray once per process: ``address`` or FOLDTUNE_RAY_ADDRESS, else a local instance."""
    with _init_lock:
        if ray.is_initialized():
            return
        address = address or os.environ.get(RAY_ADDRESS_ENV) or None
        _check_ray_auth_mode()
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                  "logging_level": logging.WARNING, "configure_logging": True}
        if address is None:
            kwargs["num_cpus"] = int(os.environ.get(RAY_NUM_CPUS_ENV) or max(os.cpu_count() or 1, 8))
            # Rank actors get fresh processes anyway; idle pre-started workers only compete for the cores.
            kwargs["_system_config"] = LOCAL_SYSTEM_CONFIG
        else:
            kwargs.pop("include_dashboard")
        # 'local' starts a new Ray: with None, Ray would join any Ray it finds on this machine (another
        # user's, found by scanning for gcs_server processes), with its resources and its token.
        ray.init(address=address or "local", **kwargs)


def _check_ray_auth_mode() -> None:
    """Raise unless the imported Ray runs in the mode :mod:`executor.ray_auth` configured: a ``ray`` imported
    before this module read the environment too early, stays disabled, and could not join a cluster with
    a token (or would start one without)."""
    actual = "token" if get_authentication_mode() == AuthenticationMode.TOKEN else "disabled"
    if actual != _AUTH_MODE:
        raise SpecError(f"Ray runs with RAY_AUTH_MODE={actual}, foldtune configured {_AUTH_MODE}: ray was imported "
                        f"before executor.launch_ray; import that first")


def forwarded_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The driver's variables every rank gets: ``FORWARDED_ENV`` and the names in FOLDTUNE_RANK_ENV."""
    env = os.environ if environ is None else environ
    extra = tuple(n.strip() for n in env.get(RANK_ENV_ENV, "").split(",") if n.strip())
    return {k: env[k] for k in FORWARDED_ENV + extra if k in env}


def rank_resource(backend: str) -> str:
    """The Ray resource one rank reserves a unit of: 'GPU' for NCCL ranks; for gloo ranks
    FOLDTUNE_RAY_RANK_RESOURCE when set (a custom resource standing for a device slot, e.g. in the simulated
    multi-node tests), else 'CPU'."""
    if backend == "nccl":
        return "GPU"
    return os.environ.get(RANK_RESOURCE_ENV) or "CPU"


@dataclass(frozen=True)
class RayNode:
    """One live Ray node: its id, IP and how many whole units of the rank resource it has."""

    node_id: str
    ip: str
    slots: int


@dataclass(frozen=True)
class ClusterShape:
    """The Ray cluster as the planner needs it: the nodes that have the rank ``resource``, and their slots."""

    resource: str
    nodes: tuple[RayNode, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def slots_per_node(self) -> int:
        """Slots of the smallest node (0 without nodes): what every node can hold in a homogeneous cluster."""
        return min((n.slots for n in self.nodes), default=0)

    @property
    def total_slots(self) -> int:
        return sum(n.slots for n in self.nodes)

    @property
    def exclusive_nodes(self) -> bool:
        """CPU ranks share their node's cores: a trial takes its nodes whole (two on one would slow each other)."""
        return self.resource == "CPU"

    def concurrent_trials(self, world_size: int, ranks_per_node: int) -> int:
        """How many trials of ``world_size`` ranks, ``ranks_per_node`` on each of their nodes, fit side by side."""
        bundles = node_bundles(world_size, ranks_per_node)
        per_node = [(1 if n.slots >= bundles[0] else 0) if self.exclusive_nodes else n.slots // bundles[0]
                    for n in self.nodes]
        trials = 0
        while True:  # greedily give each next trial the len(bundles) nodes with the most room left
            order = sorted(range(len(per_node)), key=lambda i: -per_node[i])[:len(bundles)]
            if len(order) < len(bundles) or any(per_node[i] < 1 for i in order):
                return trials
            for i in order:
                per_node[i] -= 1
            trials += 1


def cluster_shape(resource: str) -> ClusterShape:
    """The live Ray nodes that have at least one unit of ``resource`` (call after :func:`attach_ray`)."""
    nodes = [RayNode(n["NodeID"], n.get("NodeManagerAddress", ""), int(n.get("Resources", {}).get(resource, 0)))
             for n in ray.nodes() if n.get("Alive")]
    return ClusterShape(resource, tuple(sorted((n for n in nodes if n.slots >= 1), key=lambda n: n.node_id)))


def node_bundles(world_size: int, ranks_per_node: int) -> list[int]:
    """Ranks in each node's bundle: ``ranks_per_node`` (capped at the world) per node, in rank order."""
    per = max(1, min(ranks_per_node, world_size))
    return [per] * (world_size // per) + ([world_size % per] if world_size % per else [])


def _alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


class RankActor:
    """One rank of one trial (wrapped with ``ray.remote`` at launch, ``max_concurrency=2`` so that the
    driver's ``poll`` runs while ``run`` does)."""

    def __init__(self, rank: int, world_size: int, env: dict[str, str], threads: int) -> None:
        os.environ.update(env)
        os.environ.update(SAFE_ENV)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        # the rank's node as the calibration groups ranks by (executor/node.py): Ray's node id, distinct for
        # the nodes of a simulated cluster that share one host
        os.environ[NODE_ENV] = ray.get_runtime_context().get_node_id()
        self.rank, self.world_size, self.threads = rank, world_size, threads
        self._lock = threading.Lock()
        self._steps: list[tuple[int, float]] = []
        self._stop = False
        self._initial_seed = torch.initial_seed()  # a fresh process's RNG seed: each kept run starts from it
        self._store: dist.TCPStore | None = None  # rank 0's rendezvous store, bound by address()

    def address(self) -> tuple[str, int, int, str, list[str]]:
        """(node IP, the rendezvous port or 0, this process's pid, the Ray node id, the GPU ids Ray gave it).
        Rank 0 binds the rendezvous store here, on a port the system picks, and answers its port; the other
        ranks answer 0. Binding before answering leaves no moment in which another process can take the port."""
        ip = ray.util.get_node_ip_address()
        port = 0
        if self.rank == 0:
            if self._store is None:
                self._store = dist.TCPStore(ip, 0, self.world_size, is_master=True, wait_for_workers=False,
                                            timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
            port = self._store.port
        return (ip, port, os.getpid(), ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()])

    def _rendezvous(self, master: tuple[str, int], dist_timeout_s: float) -> dist.TCPStore:
        """This rank's handle on rank 0's store at ``master`` (rank 0's own, bound by :meth:`address`)."""
        timeout = datetime.timedelta(seconds=dist_timeout_s)
        if self.rank == 0:
            if self._store is None:
                raise RuntimeError("rank 0 has no rendezvous store: address() was not called before the run")
            self._store.set_timeout(timeout)
            return self._store
        return dist.TCPStore(master[0], master[1], self.world_size, is_master=False, timeout=timeout)

    def _record(self, step: int, seconds: float) -> bool:
        with self._lock:
            self._steps.append((step, seconds))
            return self._stop

    def poll(self, stop: bool = False) -> list[tuple[int, float]]:
        """Steps reported since the last poll; ``stop`` asks the run to stop after its next step."""
        with self._lock:
            self._stop = self._stop or stop
            steps, self._steps = self._steps, []
        return steps

    def last_step(self) -> int:
        """The last timed step this rank finished (-1: none yet)."""
        return progress.last_step_done()

    def run_kept(self, master: tuple[str, int], backend: str, fn: Callable, args: tuple, dist_timeout_s: float,
                 memory_limit_bytes: int | None, env: dict[str, str]) -> tuple[str, Any]:
        """Run ``fn`` as this rank of a kept pool (:class:`RayRankPool`): the process group is made by the
        first run and kept; each run gets :func:`executor.rank_pool.run_trial`'s fresh state and ``env``."""
        torch.set_num_threads(self.threads)
        with self._lock:
            self._steps, self._stop = [], False
        limits = resource.getrlimit(resource.RLIMIT_AS)
        if memory_limit_bytes:
            _limit_address_space(memory_limit_bytes)
        try:
            if not dist.is_initialized():
                try:
                    self._init_group(master, backend, dist_timeout_s)
                except BaseException as exc:  # noqa: BLE001
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    return "error", f"{type(exc).__name__} on rank {self.rank}: {first}", traceback.format_exc()
            return rank_pool.run_trial(fn, self.rank, self.world_size, args, env, self._initial_seed,
                                       sink=self._record if self.rank == 0 else None)
        finally:
            resource.setrlimit(resource.RLIMIT_AS, limits)  # the limit is this run's: the next one sets its own

    def health(self) -> bool:
        """A barrier over the kept pool (after a failed run): True when it completed."""
        return rank_pool.health_check()

    def leftover_bytes(self) -> int:
        """Device bytes this kept rank still holds after its last run (0 without CUDA)."""
        return rank_pool.leftover_bytes()

    def _init_group(self, master: tuple[str, int], backend: str, dist_timeout_s: float) -> None:
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray made this rank's GPU the only visible one
        dist.init_process_group(backend, store=self._rendezvous(master, dist_timeout_s), rank=self.rank,
                                world_size=self.world_size, timeout=datetime.timedelta(seconds=dist_timeout_s),
                                **({"device_id": torch.device("cuda", 0)} if backend == "nccl" else {}))

    def run(self, master: tuple[str, int], backend: str, fn: Callable, args: tuple, dist_timeout_s: float,
            memory_limit_bytes: int | None) -> tuple[str, Any]:
        """Run ``fn`` as this rank: ('ok', result) or ('oom' | 'error', one-line reason, traceback)."""
        torch.set_num_threads(self.threads)
        if memory_limit_bytes:
            _limit_address_space(memory_limit_bytes)
        if self.rank == 0:
            progress.install(self._record)
        try:
            self._init_group(master, backend, dist_timeout_s)
            result = fn(self.rank, self.world_size, *args)
            dist.destroy_process_group()
            return "ok", result
        except BaseException as exc:  # every failure goes back to the driver as a reason
            oom = is_out_of_memory(exc)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            kind = OOM_PREFIX if oom else type(exc).__name__
            return ("oom" if oom else "error"), f"{kind} on rank {self.rank}: {first}", traceback.format_exc()
        finally:
            progress.install(None)


def _limit_address_space(extra_bytes: int) -> None:
    """Let this process map at most ``extra_bytes`` more address space than it has now (a CPU rank's
    'device memory': beyond it allocations fail like a GPU's do)."""
    with open("/proc/self/status") as f:
        vm_size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm_size + int(extra_bytes)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _cluster_total(resource_name: str) -> float:
    return ray.cluster_resources().get(resource_name, 0.0)


@dataclass(frozen=True)
class RayCapacity:
    """What the Ray cluster has in all: CPUs and GPUs (whole or fractional units)."""

    cpus: float
    gpus: float


def attach_ray(address: str | None = None) -> RayCapacity:
    """Start or attach to Ray once per process (``address``, else FOLDTUNE_RAY_ADDRESS, else a local
    instance), and size the cluster. The one place Ray is started; call it from the main thread before any
    other: Ray installs its signal handlers only there."""
    _connect(address)
    return RayCapacity(cpus=_cluster_total("CPU"), gpus=_cluster_total("GPU"))


def ping_ray() -> None:
    """Raise unless this process is connected to Ray and the cluster's GCS answers (a health check)."""
    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialised in this process")
    if not ray.cluster_resources():
        raise RuntimeError("the Ray cluster reports no resources")


def launch(fn: Callable, world_size: int, args: tuple = (), backend: str | None = None, timeout_s: float = 600.0,
           threads_per_rank: int = 1, *, on_step: Callable[[int, float], bool] | None = None,
           memory_limit_bytes: int | None = None, env: dict[str, str] | None = None,
           placement_timeout_s: float | None = None, address: str | None = None, ranks_per_node: int | None = None,
           cancel: threading.Event | None = None, name: str = "launch") -> LaunchResult:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` Ray actors; see the module docstring.

    ``backend`` defaults to 'nccl' when the Ray cluster has ``world_size`` GPUs, else 'gloo'.
    ``timeout_s`` (seconds) bounds the run from the moment the placement group is ready;
    ``placement_timeout_s`` (default ``timeout_s``) bounds the wait for it. ``memory_limit_bytes`` caps
    each CPU rank's additional address space (ignored for NCCL: CUDA maps huge address ranges).
    ``env`` adds environment variables to every rank (FOLDTUNE_FAULT etc. are forwarded from this process).
    ``cancel`` set (the job was cancelled, the runner shuts down) abandons the run at once, wherever it is
    (waiting for its bundles, starting its actors, between steps or in a hung step): the ranks are killed
    and the result is a failure of kind ``cancelled`` (a stop through ``on_step`` waits for the next step).
    ``name`` names the run in Ray's dashboard and ``ray list``: the placement group is ``foldtune-<name>-<6 hex>``
    and rank r's actor ``<that>-rank<r>`` (the hex keeps a retried run's names apart from lingering ones).
    ``ranks_per_node`` is the planner's GPUs per node (rank r on node r // it); None: the whole world on one
    node when a node has room for it, else as many ranks per node as the smallest node holds.
    The result's ``placement`` says where each rank ran (Ray node id, IP, GPU ids).
    """
    attach_ray(address)  # connects only where no front end attached first (a bare launch, tests)
    start = time.monotonic()
    ranks = _reserve(world_size, backend, timeout_s, threads_per_rank, env, placement_timeout_s, ranks_per_node,
                     cancel, name, start)
    if isinstance(ranks, LaunchResult):
        return ranks
    try:
        limit = memory_limit_bytes if ranks.backend == "gloo" else None
        began = time.time()
        runs = [a.run.remote(ranks.master, ranks.backend, fn, args, timeout_s, limit) for a in ranks.actors]
        failure, results = _supervise(ranks.actors, runs, on_step, ranks.started, timeout_s, world_size,
                                      ranks.placement, cancel)
        return _result(failure, results, start, ranks.placement, [began, time.time()])
    finally:
        _teardown(ranks.actors, ranks.pg, ranks.pids)


def _result(failure: tuple[FailureKind, str] | None, results: list, start: float, placement: list[dict],
            window: list[float], reused: bool = False) -> LaunchResult:
    if failure:
        failure_kind, reason = failure
        return LaunchResult(False, reason, wall_s=time.monotonic() - start, failure_kind=failure_kind,
                            placement=placement, run_window=window, reused=reused)
    return LaunchResult(True, None, results, time.monotonic() - start, placement=placement, run_window=window,
                        reused=reused)


@dataclass
class _Ranks:
    """A run's reserved ranks: its placement group, the rank actors (running), where they run (``placement``,
    this node's rank ``pids``), rank 0's rendezvous address, the backend, the monotonic time the actors
    were started at, and the ``key`` of what they fit (world size, backend, ranks per node, threads)."""

    pg: Any
    actors: list[Any]
    pids: list[int]
    placement: list[dict[str, Any]]
    master: tuple[str, int]
    backend: str
    started: float
    key: tuple


def _reserve(world_size: int, backend: str | None, timeout_s: float, threads_per_rank: int,
             env: dict[str, str] | None, placement_timeout_s: float | None, ranks_per_node: int | None,
             cancel: threading.Event | None, name: str, start: float) -> _Ranks | LaunchResult:
    """Reserve the placement group and start the rank actors (see :func:`launch`), or the failed result."""
    if backend is None:
        backend = "nccl" if _cluster_total("GPU") >= world_size else "gloo"
    unit = rank_resource(backend)
    shape = cluster_shape(unit)

    def refused(reason: str, kind: FailureKind = FailureKind.ERROR) -> LaunchResult:
        return LaunchResult(False, reason, wall_s=time.monotonic() - start, failure_kind=kind)

    if shape.total_slots < world_size:
        return refused(f"layout needs {world_size} {unit} bundles, the Ray cluster has "
                       f"{_cluster_total(unit):g} {unit}s")
    if ranks_per_node is None:
        biggest = max(n.slots for n in shape.nodes)
        ranks_per_node = world_size if biggest >= world_size else shape.slots_per_node
    sizes = node_bundles(world_size, ranks_per_node)
    roomy = sum(1 for n in shape.nodes if n.slots >= sizes[0])
    if roomy < len(sizes):
        return refused(f"layout puts {sizes[0]} ranks on each of {len(sizes)} nodes, the Ray cluster has "
                       f"{roomy} node(s) with {sizes[0]} {unit}s (nodes: "
                       f"{', '.join(str(n.slots) for n in shape.nodes)})")
    per_rank = sizes[0]
    bundles = [{"CPU": n} if unit == "CPU" else {"CPU": n, unit: n} for n in sizes]
    rank_env = forwarded_env()
    rank_env.update(env or {})
    run_name = f"foldtune-{name}-{uuid.uuid4().hex[:6]}"
    pg = placement_group(bundles, strategy="STRICT_SPREAD", name=run_name)
    actors: list[Any] = []
    pids: list[int] = []
    kept = False
    try:
        wait_s = timeout_s if placement_timeout_s is None else placement_timeout_s
        ready = _wait_ready([pg.ready()], wait_s, cancel)
        if ready is None:
            return _cancelled(start)
        if not ready:
            return refused(f"timeout after {wait_s:.0f} s waiting for {world_size} free {unit} bundles "
                           f"({len(sizes)} node(s) of {per_rank})", FailureKind.TIMEOUT)
        remote_cls = ray.remote(RankActor)
        actors = [remote_cls.options(
            name=f"{run_name}-rank{r}", num_cpus=1, num_gpus=1 if unit == "GPU" else 0,
            resources={unit: 1} if unit not in ("CPU", "GPU") else None,
            max_concurrency=2, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=node_of_rank(r, per_rank)),
        ).remote(r, world_size, rank_env, threads_per_rank) for r in range(world_size)]
        run_start = time.monotonic()
        try:
            refs = [a.address.remote() for a in actors]
            if _wait_ready(refs, timeout_s, cancel) is None:
                return _cancelled(start)
            addresses = ray.get(refs, timeout=max(1.0, timeout_s - (time.monotonic() - run_start)))
        except Exception as exc:
            return refused(*_startup_failure(exc, timeout_s, pg))
        placement = [{"node": node, "ip": ip, "gpus": gpus} for ip, _, _, node, gpus in addresses]
        pids = [pid for ip, _, pid, node, _ in addresses if node == _this_node()]
        kept = True
        return _Ranks(pg, actors, pids, placement, addresses[0][:2], backend, run_start,
                      (world_size, backend, per_rank, threads_per_rank))
    finally:
        if not kept:
            _teardown(actors, pg, pids)


class RayRankPool:
    """Rank actors kept between runs of the same world size, backend, ranks per node and threads: the
    Ray side of :mod:`executor.rank_pool` (its per-trial hygiene and its rules for when a pool is kept).

    :meth:`launch` has :func:`launch`'s signature and contract. The first run (and the first after a change
    of shape or a failure that ended the ranks) reserves a placement group and starts the actors as
    :func:`launch` does, named after that run; later runs go to the same actors, whose default process group
    was made by the first. ``env`` applies to each run alone; the driver's forwarded variables
    (``FORWARDED_ENV``) are read when the actors start. Runs go one at a time per pool (a lock); a caller with
    trials side by side keeps one pool per running trial (:class:`RayRankPools`). :meth:`close` tears the
    actors and their placement group down.
    """

    def __init__(self) -> None:
        self._ranks: _Ranks | None = None
        self._lock = threading.Lock()
        self.starts = 0  # how many times rank actors were started

    @property
    def key(self) -> tuple | None:
        return self._ranks.key if self._ranks is not None else None

    @property
    def pids(self) -> list[int]:
        """This node's rank processes (empty when none are kept)."""
        return list(self._ranks.pids) if self._ranks is not None else []

    def close(self) -> None:
        if self._ranks is not None:
            ranks, self._ranks = self._ranks, None
            _teardown(ranks.actors, ranks.pg, ranks.pids)

    def launch(self, fn: Callable, world_size: int, args: tuple = (), backend: str | None = None,
               timeout_s: float = 600.0, threads_per_rank: int = 1, *,
               on_step: Callable[[int, float], bool] | None = None, memory_limit_bytes: int | None = None,
               env: dict[str, str] | None = None, placement_timeout_s: float | None = None,
               address: str | None = None, ranks_per_node: int | None = None,
               cancel: threading.Event | None = None, name: str = "launch") -> LaunchResult:
        """Run ``fn`` on the kept actors (see the class docstring); ``reused`` says whether they were kept."""
        attach_ray(address)
        with self._lock:
            start = time.monotonic()
            if backend is None:
                backend = "nccl" if _cluster_total("GPU") >= world_size else "gloo"
            ranks = self._ranks
            reused = ranks is not None and _fits(ranks.key, world_size, backend, ranks_per_node, threads_per_rank)
            if not reused:
                self.close()
                got = _reserve(world_size, backend, timeout_s, threads_per_rank, None, placement_timeout_s,
                               ranks_per_node, cancel, name, start)
                if isinstance(got, LaunchResult):
                    return got
                self._ranks = ranks = got
                self.starts += 1
            limit = memory_limit_bytes if backend == "gloo" else None
            began = time.time()
            run_start = ranks.started if not reused else time.monotonic()
            runs = [a.run_kept.remote(ranks.master, backend, fn, args, timeout_s, limit, dict(env or {}))
                    for a in ranks.actors]
            failure, results = _supervise(ranks.actors, runs, on_step, run_start, timeout_s, world_size,
                                          ranks.placement, cancel)
            if failure is not None and not self._keepable(failure[0], runs):
                self.close()
            elif failure is None and not self._clean():
                self.close()
            return _result(failure, results, start, ranks.placement, [began, time.time()], reused)

    def _clean(self) -> bool:
        """Whether every kept actor is back to (about) no device memory after its run: a trial that left
        something alive would make the next one measure, and perhaps run out of, less memory."""
        try:
            left = ray.get([a.leftover_bytes.remote() for a in self._ranks.actors], timeout=rank_pool.HEALTH_TIMEOUT_S)
        except Exception:
            return False
        return max(left) <= rank_pool.LEFTOVER_LIMIT_BYTES

    def _keepable(self, kind: FailureKind, runs: list) -> bool:
        """After a failed run: whether every rank finished it (raised, not died) within the grace period and
        a barrier over all of them then completes (see :mod:`executor.rank_pool`)."""
        if kind not in (FailureKind.OOM, FailureKind.ERROR) or self._ranks is None:
            return False
        done, _ = ray.wait(runs, num_returns=len(runs), timeout=rank_pool.FAILURE_GRACE_S)
        if len(done) < len(runs):
            return False
        try:
            ray.get(runs)  # raises when an actor died
            checks = [a.health.remote() for a in self._ranks.actors]
            return all(ray.get(checks, timeout=rank_pool.HEALTH_TIMEOUT_S))
        except Exception:
            return False


def _fits(key: tuple, world_size: int, backend: str | None, ranks_per_node: int | None, threads: int) -> bool:
    """Whether kept ranks of ``key`` (world size, backend, ranks per node, threads) serve a run asking for these."""
    per_node = None if ranks_per_node is None else max(1, min(ranks_per_node, world_size))
    return key[0] == world_size and backend in (None, key[1]) and per_node in (None, key[2]) and key[3] == threads


class RayRankPools:
    """Rank pools for trials side by side (one job's): each run borrows an idle pool of its shape, else
    ends the idle pools (their reservations could be what the new shape waits for) and starts a new one.
    ``launch`` has :func:`launch`'s signature; :meth:`close` ends every pool (call it when the job ends)."""

    def __init__(self) -> None:
        self._idle: list[RayRankPool] = []
        self._busy: list[RayRankPool] = []
        self._lock = threading.Lock()

    def _borrow(self, world_size: int, backend: str | None, ranks_per_node: int | None,
                threads: int) -> RayRankPool:
        with self._lock:
            for pool in self._idle:
                if pool.key is not None and _fits(pool.key, world_size, backend, ranks_per_node, threads):
                    self._idle.remove(pool)
                    self._busy.append(pool)
                    return pool
            idle, self._idle = self._idle, []
            pool = RayRankPool()
            self._busy.append(pool)
        for old in idle:
            old.close()
        return pool

    def launch(self, fn: Callable, world_size: int, args: tuple = (), backend: str | None = None,
               timeout_s: float = 600.0, threads_per_rank: int = 1, **kwargs: Any) -> LaunchResult:
        pool = self._borrow(world_size, backend, kwargs.get("ranks_per_node"), threads_per_rank)
        try:
            return pool.launch(fn, world_size, args, backend, timeout_s, threads_per_rank, **kwargs)
        finally:
            with self._lock:
                self._busy.remove(pool)
                # a pool still reserving may wait for exactly these devices: give them back rather than idle
                keep = pool.key is not None and not any(p.key is None for p in self._busy)
                if keep:
                    self._idle.append(pool)
            if not keep:
                pool.close()

    def close(self) -> None:
        with self._lock:
            pools, self._idle = self._idle, []
        for pool in pools:
            pool.close()


CANCELLED_REASON = rank_pool.CANCELLED_REASON


def _cancelled(start: float) -> LaunchResult:
    return LaunchResult(False, CANCELLED_REASON, wall_s=time.monotonic() - start, failure_kind=FailureKind.CANCELLED)


def _wait_ready(refs: list, timeout_s: float, cancel: threading.Event | None) -> list | None:
    """``ray.wait`` for all of ``refs`` up to ``timeout_s``, in short slices so that ``cancel`` is seen at
    once: the ready refs (all of them, or fewer on a timeout), or None when cancelled."""
    deadline = time.monotonic() + timeout_s
    while True:
        if cancel is not None and cancel.is_set():
            return None
        left = deadline - time.monotonic()
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, min(POLL_S, left)))
        if len(ready) == len(refs) or left <= 0:
            return ready if len(ready) == len(refs) else []


def _supervise(actors: list, runs: list, on_step: Callable[[int, float], bool] | None, run_start: float,
               timeout_s: float, world_size: int, placement: list[dict],
               cancel: threading.Event | None = None) -> tuple[tuple[FailureKind, str] | None, list[Any]]:
    """Wait for every rank, relaying rank 0's steps to ``on_step``; ((kind, reason) of a failure or None,
    results). ``placement[r]['node']`` is rank r's Ray node, for telling a lost node from a crash."""
    pending = {ref: rank for rank, ref in enumerate(runs)}
    outcomes: dict[int, tuple] = {}
    stop_sent = False
    poll_ref = None
    first_failure_at: float | None = None
    stalls = _StallWatch(actors)
    slowest_step = 0.0

    def relay(step: int, seconds: float) -> bool:
        nonlocal slowest_step
        slowest_step = max(slowest_step, seconds)
        return on_step(step, seconds)

    while pending:
        if cancel is not None and cancel.is_set():
            return (FailureKind.CANCELLED, CANCELLED_REASON), []
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=POLL_S)
        for ref in done:
            rank = pending.pop(ref)
            try:
                outcomes[rank] = ray.get(ref)
            except Exception as exc:  # the actor's process died (killed, segfault, OOM-killer), or its node
                outcomes[rank] = _death_outcome(exc, rank, placement)
            if outcomes[rank][0] != "ok" and first_failure_at is None:
                first_failure_at = time.monotonic()
        if on_step is not None and 0 not in outcomes:
            if poll_ref is not None:
                ready, _ = ray.wait([poll_ref], timeout=0)
                if ready:
                    try:
                        for step, seconds in ray.get(poll_ref):
                            if relay(step, seconds) and not stop_sent:
                                stop_sent = True
                    except Exception:
                        pass  # rank 0 is gone; its run outcome says why
                    poll_ref = None
            if poll_ref is None:
                poll_ref = actors[0].poll.remote(stop_sent)
        if first_failure_at is not None:
            # Let the other ranks report for a moment: the root cause (an OOM, a dead rank) is often
            # reported after the peers' 'connection closed' errors it causes.
            if not pending or time.monotonic() - first_failure_at > 1.0:
                lost = _lost_node(actors, sorted(pending.values()), outcomes, placement)
                return lost or _failure_reason(outcomes), []
        elif pending and (stalled := stalls.check(sorted(pending.values()),
                                                  max(STALL_MIN_S, STALL_STEPS * slowest_step))):
            lost = _lost_node(actors, sorted(pending.values()), outcomes, placement)
            return lost or (FailureKind.TIMEOUT, f"{stalled} (the trial's limit is {timeout_s:.0f} s)"), []
        elif pending and time.monotonic() - run_start > timeout_s:
            running = sorted(pending.values())
            lost = _lost_node(actors, running, outcomes, placement)
            if lost:
                return lost, []
            return (FailureKind.TIMEOUT,
                    f"timeout after {timeout_s:.0f} s ({len(running)} of {world_size} ranks still running: "
                    f"rank {', '.join(str(r) for r in running)}{_laggards(actors, running)})"), []
    if on_step is not None:  # steps rank 0 reported just before it returned (its actor is still alive)
        refs = ([poll_ref] if poll_ref is not None else []) + [actors[0].poll.remote(stop_sent)]
        try:
            for steps in ray.get(refs, timeout=10):
                for step, seconds in steps:
                    on_step(step, seconds)
        except Exception:
            pass
    return None, [outcomes[r][1] for r in range(world_size)]


class _StallWatch:
    """Tells a hung rank from a slow run: the running ranks' last timed steps, asked for every STALL_POLL_S; a
    rank that stays behind the furthest one at the same step for ``limit_s`` is stalled."""

    def __init__(self, actors: list) -> None:
        self.actors = actors
        self.asked_at = time.monotonic()
        self.behind_since: dict[int, tuple[int, float]] = {}  # rank -> (its last step, since when it lags)

    def check(self, running: list[int], limit_s: float) -> str | None:
        """'hung: rank 1 stuck ... for 15 s' once a rank has lagged ``limit_s`` seconds, else None."""
        now = time.monotonic()
        if now - self.asked_at < STALL_POLL_S or len(running) < 2:
            return None
        self.asked_at = now
        try:
            steps = dict(zip(running, ray.get([self.actors[r].last_step.remote() for r in running], timeout=5)))
        except Exception:  # a rank too wedged to answer: the trial's timeout still ends it
            return None
        ahead = max(steps.values())
        lagging = {r: s for r, s in steps.items() if s < ahead}
        self.behind_since = {r: (s, self.behind_since[r][1] if self.behind_since.get(r, (None,))[0] == s else now)
                             for r, s in lagging.items()}
        stuck = sorted(r for r, (_, since) in self.behind_since.items() if now - since >= limit_s)
        if not stuck:
            return None
        last = min(steps[r] for r in stuck)
        where = f"after step {last}" if last >= 0 else "before its first timed step"
        return (f"hung: rank {', '.join(map(str, stuck))} stuck {where} while others finished step {ahead}, "
                f"for {limit_s:.0f} s")


def _laggards(actors: list, running: list[int]) -> str:
    """'; rank 1 stuck after step 0 while others finished step 1' when some running ranks lag behind."""
    try:
        steps = dict(zip(running, ray.get([actors[r].last_step.remote() for r in running], timeout=5)))
    except Exception:  # a rank too wedged to answer: the plain reason must do
        return ""
    ahead = max(steps.values())
    behind = sorted(r for r, s in steps.items() if s < ahead)
    if not behind:
        return ""
    last = min(steps[r] for r in behind)
    where = f"after step {last}" if last >= 0 else "before its first timed step"
    return f"; rank {', '.join(map(str, behind))} stuck {where} while others finished step {ahead}"


# A rank's outcome word -> the run's failure kind, in the order the root cause is looked for: a lost node
# makes its peers fail too, and an OOM kills or breaks the other ranks' collectives.
_OUTCOME_KINDS = {"lost": FailureKind.NODE_LOST, "oom": FailureKind.OOM, "died": FailureKind.CRASH,
                  "error": FailureKind.ERROR}


def _node_died(exc: BaseException) -> bool:
    """True when Ray says the actor died with its node."""
    return isinstance(exc, ray.exceptions.RayActorError) and "node has died" in str(exc)


def _node_text(node: str, ip: str, ranks: list[int]) -> str:
    return f"node lost: Ray node {node[:12]} ({ip}) holding rank {', '.join(map(str, ranks))} went away mid-run"


def _death_outcome(exc: BaseException, rank: int, placement: list[dict]) -> tuple:
    """The outcome of a rank whose actor died: 'lost' when its node died with it, else 'died'."""
    where = placement[rank]
    if _node_died(exc) or where["node"] not in _alive_nodes():
        ranks = [r for r, p in enumerate(placement) if p["node"] == where["node"]]
        return "lost", _node_text(where["node"], where["ip"], ranks), ""
    return "died", f"rank {rank} died ({_death_detail(exc)})", ""


def _lost_node(actors: list, running: list[int], outcomes: dict[int, tuple],
               placement: list[dict]) -> tuple[FailureKind, str] | None:
    """(NODE_LOST, reason) when a node of this run went away, else None.

    A rank already known dead with its node settles it. Ranks still running that do not answer a ping
    (a live actor answers at once: ``last_step`` runs beside ``run``) may sit on a node that vanished but
    that Ray has not declared dead yet: wait up to NODE_LOSS_WAIT_S for Ray's verdict on their nodes, and
    stop waiting as soon as each of them answers or dies on a node that is still there.
    """
    for rank in sorted(outcomes):
        if outcomes[rank][0] == "lost":
            return FailureKind.NODE_LOST, outcomes[rank][1]
    if not running:
        return None
    pings = {actors[r].last_step.remote(): r for r in running}
    deadline = time.monotonic() + NODE_LOSS_WAIT_S
    while pings:
        answered, _ = ray.wait(list(pings), num_returns=len(pings), timeout=0.5)
        for ref in answered:
            pings.pop(ref)  # alive, or died while its node stayed (a crash: the run outcome says so)
        dead = sorted({placement[r]["node"] for r in running} - _alive_nodes())
        if dead:
            ranks = [r for r, p in enumerate(placement) if p["node"] == dead[0]]
            return FailureKind.NODE_LOST, _node_text(dead[0], placement[ranks[0]]["ip"], ranks)
        if time.monotonic() > deadline:
            break
    return None


def _failure_reason(outcomes: dict[int, tuple]) -> tuple[FailureKind, str]:
    bad = sorted((rank, o) for rank, o in outcomes.items() if o[0] != "ok")
    for outcome, kind in _OUTCOME_KINDS.items():
        of_kind = [o[1] for _, o in bad if o[0] == outcome]
        if of_kind:
            more = len(bad) - 1
            return kind, of_kind[0] + (f" (and {more} more rank(s) failed)" if more else "")
    return FailureKind.ERROR, "a rank failed without a reason"


def _death_detail(exc: BaseException) -> str:
    text = str(exc)
    for needle, detail in (("SIGKILL", "killed by SIGKILL"), ("killed", "killed"), ("exit", "its process exited"),
                           ("OOM", "killed by the out-of-memory killer")):
        if needle in text:
            return detail
    return type(exc).__name__


def _startup_failure(exc: BaseException, timeout_s: float, pg: Any) -> tuple[str, FailureKind]:
    """(reason, kind) of rank actors that did not start: a node of the placement group lost, a timeout or an error."""
    try:
        nodes = set(ray.util.placement_group_table(pg).get("bundles_to_node_id", {}).values())
    except Exception:
        nodes = set()
    gone = sorted(nodes - _alive_nodes()) if nodes else []
    if _node_died(exc) or gone:
        where = f"Ray node {gone[0][:12]}" if gone else "a Ray node"
        return f"node lost: {where} went away while the rank actors started", FailureKind.NODE_LOST
    kind, reason = _startup_reason(exc, timeout_s)
    return reason, kind


def _startup_reason(exc: BaseException, timeout_s: float) -> tuple[FailureKind, str]:
    if isinstance(exc, ray.exceptions.GetTimeoutError):
        return FailureKind.TIMEOUT, f"timeout after {timeout_s:.0f} s starting the rank actors"
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return FailureKind.ERROR, f"rank actors failed to start: {first}"


def _this_node() -> str | None:
    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:
        return None


def _teardown(actors: list, pg: Any, pids: list[int]) -> None:
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass
    try:
        remove_placement_group(pg)
    except Exception:
        pass
    # ray.kill is asynchronous: wait until Ray reports every rank actor dead, wherever it ran, and until
    # this node's rank processes are really gone (made sure of), so that a trial never leaves an actor (or
    # its memory, or a GPU context) to the next one.
    deadline = time.monotonic() + TEARDOWN_WAIT_S
    _wait_actors_dead(actors, deadline)
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if pid_alive(p)]
        if pids:
            time.sleep(0.05)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _wait_actors_dead(actors: list, deadline: float) -> None:
    """Until ``deadline``: call every actor until each call fails (a killed actor's calls fail once Ray has
    it dead; on a node that is gone they fail at once)."""
    left = list(actors)
    while left and time.monotonic() < deadline:
        refs = {}
        for actor in left:
            try:
                refs[actor.last_step.remote()] = actor
            except Exception:
                pass  # the handle itself refuses: dead
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        alive = [refs[r] for r in refs if r not in done]
        for ref in done:
            try:
                ray.get(ref)
                alive.append(refs[ref])  # it still answered
            except Exception:
                pass
        left = alive
        if left:
            time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    """True while the local process ``pid`` exists and is not a zombie (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
