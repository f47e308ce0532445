"""Microbenchmarks that calibrate the cost model on the devices at hand (``foldtune calibrate``).

One module per family: :mod:`.gemm` (dense GEMMs over MoE-layer shapes), :mod:`.grouped_gemm` (the
executor's grouped GEMM vs tokens per expert), :mod:`.hbm` (device-memory copy bandwidth),
:mod:`.collectives` (all-to-all, all-reduce, all-gather, reduce-scatter, p2p over message and group
sizes). :mod:`.runner` runs them on every local rank at once (as training would load the devices) and
returns raw timings; the pure-Python :mod:`costmodel.calibrate.profile_builder` turns them into a calibrated
:class:`~spec.hardware.HardwareProfile` in the units of the calibration contract of
``docs/time-model.md``.
"""
