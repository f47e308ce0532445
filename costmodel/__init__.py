"""foldtune's cost model: the shared specs, Megatron-convention FLOPs, rank groups, memory and time.

Pure Python (no torch, no I/O beyond reading a catalog file the user names).
"""

from costmodel.catalog import get_hardware, get_model, hardware_names, load_catalog_file, model_names
from costmodel.errors import CatalogError, FoldtuneError, InvalidConfigError, SpecError
from costmodel.flops import flops_per_step, flops_per_token, mfu, tflops_per_gpu
from costmodel.hardware import ClusterSpec, GPUSpec, HardwareProfile, MeasuredCurve
from costmodel.model_spec import ModelSpec
from costmodel.parallel_config import ParallelConfig
from costmodel.rank_groups import FoldedGroups, RankGrid
from costmodel.training_spec import TrainingSpec

__all__ = [
    "CatalogError", "ClusterSpec", "FoldedGroups", "FoldtuneError", "GPUSpec", "HardwareProfile",
    "InvalidConfigError", "MeasuredCurve", "ModelSpec", "ParallelConfig", "RankGrid", "SpecError",
    "TrainingSpec", "flops_per_step", "flops_per_token", "get_hardware", "get_model", "hardware_names",
    "load_catalog_file", "mfu", "model_names", "tflops_per_gpu",
]
