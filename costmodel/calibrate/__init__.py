"""Calibration: measured timings into a hardware profile (``foldtune calibrate``), pure Python.

The executor's microbenchmarks (``executor/microbench/``) only measure and return raw timings; this
package turns them into profile fields. :mod:`.profile_builder` builds the machine curves from raw
microbenchmark timings; :mod:`.component_factors` compares the executor's components, timed at a model's
shapes, with the time model's prediction as per-term factors; :mod:`.merge` recomputes the factors of
several component runs against one machine profile (``foldtune calibrate merge``); :mod:`.rebuild`
re-derives a stored profile from its raw timings (``foldtune calibrate rebuild``). The search's own
learned correction is a different thing: :mod:`planner.calibration`.
"""
