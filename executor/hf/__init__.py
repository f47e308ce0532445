"""Hugging Face models in and out of the executor: tensor names per family (``names``), safetensors loading
under any layout and export (``weights``), full-vocabulary logits under TP/EP for comparisons (``logits``).

Needs ``safetensors`` (the ``foldtune[hf]`` extra) only when a function reads or writes a checkpoint; nothing
here imports ``transformers``.
"""
