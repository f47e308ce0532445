"""Bodies of the read-only views the dashboard needs beside the core resources: the Megatron-LM arguments of
a job's best measured layout and the checkpoints a training has written."""

from __future__ import annotations

from pydantic import BaseModel, Field


class MegatronArgsOut(BaseModel):
    """The Megatron-LM command-line arguments of the fastest *measured* trial of a job."""

    job_id: int
    trial_number: int = Field(description="Optuna trial number of the best measured trial")
    layout: str = Field(description="the trial's label: the layout's, with the trial's precision as its last "
                                    "token when the job searched precision (reads back with "
                                    "ParallelConfig.parse_labelled)")
    step_time_s: float = Field(description="its measured seconds per optimizer step")
    args: list[list[str]] = Field(description="one flag with its values per inner list, in a stable order")
    environment: dict[str, str] = Field(description="the environment Megatron-LM needs for this layout "
                                                     "(CUDA_DEVICE_MAX_CONNECTIONS=1 with TP or CP)")
    text: str = Field(description="a shell fragment to paste before a Megatron-LM launch: the environment's export "
                                  "lines, then MEGATRON_ARGS=(...) (pass it as \"${MEGATRON_ARGS[@]}\")")


class CheckpointOut(BaseModel):
    step: int = Field(description="optimizer steps done when it was taken")
    name: str = Field(description="directory name under the training's checkpoint_dir")
    complete: bool = Field(description="its trainer state was written (an interrupted save leaves it false)")
    latest: bool = Field(description="the checkpoint a resume loads")
    bytes: int = Field(description="total size of its files")


class CheckpointsOut(BaseModel):
    training_id: int
    checkpoint_dir: str
    items: list[CheckpointOut] = Field(description="in step order, at most the last 1000")
