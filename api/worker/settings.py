"""The runner's ``FOLDTUNE_*`` variables (pydantic-settings groups; docs/settings.md lists every variable).

:class:`RunnerEnv`: the runner process (its id, pacing in seconds, trials side by side, GPUs per node, the
auto-calibration mode, the health endpoint, the shutdown grace). :class:`TrialEnv`: one trial's budget and
test switches. The database and data root have their own groups (db.settings, api.service.paths).
"""

from __future__ import annotations

import math

from pydantic import field_validator

from api.env_settings import FoldtuneEnv

DEFAULT_HEARTBEAT_S = 10.0
DEFAULT_STALE_AFTER_S = 60.0
DEFAULT_POLL_S = 2.0
DEFAULT_HEALTH_HOST = "127.0.0.1"
DEFAULT_RUNNER_SHUTDOWN_SECONDS = 30.0  # a trial's ranks need a few seconds to stop; then the job is released
DEFAULT_WARMUP_STEPS = 1
DEFAULT_TIMED_STEPS = 3
DEFAULT_TRIAL_TIMEOUT_S = 300.0


class RunnerEnv(FoldtuneEnv):
    """``FOLDTUNE_RUNNER_ID`` (None: ``<host>-<pid>``), ``FOLDTUNE_HEARTBEAT_S``, ``FOLDTUNE_STALE_AFTER_S``,
    ``FOLDTUNE_POLL_S`` (seconds), ``FOLDTUNE_PARALLEL_TRIALS`` (None: as many as fit), ``FOLDTUNE_GPUS_PER_NODE``
    (None: the Ray cluster's), ``FOLDTUNE_AUTO_CALIBRATE`` (None: quick on GPUs, off on CPU),
    ``FOLDTUNE_RUNNER_HEALTH_HOST``/``_PORT`` (None: no /healthz) and ``FOLDTUNE_RUNNER_SHUTDOWN_SECONDS``."""

    what = "runner"
    runner_id: str | None = None
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    stale_after_s: float = DEFAULT_STALE_AFTER_S
    poll_s: float = DEFAULT_POLL_S
    parallel_trials: int | None = None
    gpus_per_node: int | None = None
    auto_calibrate: str | None = None
    runner_health_host: str = DEFAULT_HEALTH_HOST
    runner_health_port: int | None = None
    runner_shutdown_seconds: float = DEFAULT_RUNNER_SHUTDOWN_SECONDS

    @field_validator("gpus_per_node")
    @classmethod
    def _per_node(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"FOLDTUNE_GPUS_PER_NODE must be >= 1, got {value}")
        return value

    @field_validator("runner_health_port", mode="before")
    @classmethod
    def _port(cls, value: object) -> object:
        try:
            return int(value) if isinstance(value, str) else value
        except ValueError:
            raise ValueError(f"FOLDTUNE_RUNNER_HEALTH_PORT={value!r} is not a port number") from None

    @field_validator("runner_shutdown_seconds", mode="before")
    @classmethod
    def _seconds(cls, value: object) -> object:
        try:
            seconds = float(value) if isinstance(value, str) else value
        except ValueError:
            seconds = -1.0
        if not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"FOLDTUNE_RUNNER_SHUTDOWN_SECONDS={value!r} is not a number of seconds")
        return seconds


class TrialEnv(FoldtuneEnv):
    """``FOLDTUNE_TRIAL_WARMUP_STEPS``, ``FOLDTUNE_TRIAL_STEPS``, ``FOLDTUNE_TRIAL_TIMEOUT_S`` (seconds),
    ``FOLDTUNE_RANK_MEMORY_BYTES`` (``1e9`` allowed; None: the device's memory), ``FOLDTUNE_FAULT`` (injected
    faults, tests) and ``FOLDTUNE_REUSE_RANKS`` (as the executor reads it: '0', 'false', 'no', 'off' turn it off)."""

    what = "trial"
    trial_warmup_steps: int = DEFAULT_WARMUP_STEPS
    trial_steps: int = DEFAULT_TIMED_STEPS
    trial_timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S
    rank_memory_bytes: float | None = None
    fault: str = ""
    reuse_ranks: str = "1"
