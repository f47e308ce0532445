"""foldtune's cost model: per-GPU memory and step time of a folded layout, term by term.

Pure Python (no torch, no I/O). The vocabulary it prices (specs, catalog, rank groups, FLOP
conventions, errors) lives in the leaf package :mod:`spec`; ``costmodel`` adds parameter counts,
compute and communication rates, memory, step time and the per-layout estimate.
"""
