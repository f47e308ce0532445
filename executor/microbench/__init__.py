"""Microbenchmarks that calibrate the cost model on the devices at hand (``foldtune calibrate``).

One module per family: :mod:`.gemm` (dense GEMMs over MoE-layer shapes), :mod:`.grouped_gemm` (the
executor's grouped GEMM vs tokens per expert), :mod:`.hbm` (device-memory copy bandwidth),
:mod:`.collectives` (all-to-all, all-reduce, all-gather, reduce-scatter, p2p over message and group
sizes). :mod:`.runner` runs them on every local rank at once (as training would load the devices) and
returns raw timings; the pure-Python :mod:`costmodel.calibrate.profile_builder` turns them into a calibrated
:class:`~spec.hardware.HardwareProfile` in the units of the calibration contract of
``docs/time-model.md``. Every module times through :mod:`.timing` (wall clock, CUDA events, device time with
the host ahead, steady-state and alternated windows, host issue time): the package's one clock.

Beside the calibration families, the measurement cores of the benchmark scripts (``bench/``, which parse
arguments, call these and print): :mod:`.moe_bar` (the MoE layer against its ideal expert FFN) and
:mod:`.moe_stages` (the same layer cut into stages), :mod:`.stack_variants` (the decoder stack's speed
switches), :mod:`.fp8_gemms`, :mod:`.fp8_step_bar`, :mod:`.quant_tiles`, :mod:`.grouped_mm_check` and
:mod:`.grad_accumulate` (the fp8 and gradient kernels), :mod:`.ep_overlap_bar` (the all-to-all overlap's
hidden fraction), :mod:`.table_rows` (running a worker on a stored layout table's rows), :mod:`.step_trace`
(one rank's profiled step), and the readers of a profiled step (:mod:`.intervals`, :mod:`.device_timeline`,
:mod:`.sync_debug`).
"""
