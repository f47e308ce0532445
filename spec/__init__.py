"""foldtune's shared vocabulary: the specs every layer speaks, in Megatron-LM's words.

ModelSpec, TrainingSpec, ParallelConfig (its label, Optuna and JSON forms in one codec, layout_codec),
GPUSpec/HardwareProfile/ClusterSpec, the folded rank groups, the pipeline layer placement, the dispatcher
names, the validity rules (Megatron's and the executor's), the model and hardware catalog with profile files,
Megatron's FLOP-counting conventions and the project's errors. Pure Python and a leaf: it imports nothing of
foldtune's other packages, so the executor (torch), the cost model (pure Python) and the service can all
depend on it.
"""

from spec.catalog import get_hardware, get_model, hardware_names, load_catalog_file, model_names
from spec.errors import CatalogError, FoldtuneError, InvalidConfigError, SpecError
from spec.flops import flops_per_step, flops_per_token, mfu, tflops_per_gpu
from spec.hardware import ClusterSpec, GPUSpec, HardwareProfile, MeasuredCurve
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.rank_groups import FoldedGroups, RankGrid
from spec.training_spec import TrainingSpec

__all__ = [
    "CatalogError", "ClusterSpec", "FoldedGroups", "FoldtuneError", "GPUSpec", "HardwareProfile",
    "InvalidConfigError", "MeasuredCurve", "ModelSpec", "ParallelConfig", "RankGrid", "SpecError",
    "TrainingSpec", "flops_per_step", "flops_per_token", "get_hardware", "get_model", "hardware_names",
    "load_catalog_file", "mfu", "model_names", "tflops_per_gpu",
]
