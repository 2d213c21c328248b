"""The reference GRPO workload as the controller sees it (``rlctl.controller.seam.Workload``).

Role: the one place the controller's questions about prompts, the model folder and trainer
settings are answered from the job spec; ``rlctl.assembly.make_workload`` hands it to the
controller, which imports nothing from ``rlctl.workload``.
"""

from __future__ import annotations

from pathlib import Path

from rlctl.core.rounds import PromptRef
from rlctl.core.spec import JobSpec


class GrpoWorkload:
    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec

    def prompts(self) -> list[PromptRef]:
        from rlctl.workload.prompts import load_prompts

        return load_prompts(self.spec)

    def held_out_prompts(self) -> list[PromptRef]:
        from rlctl.workload.prompts import load_held_out_prompts

        return load_held_out_prompts(self.spec)

    def model_path(self) -> str:
        from rlctl.workload.reference import model_path_for

        return str(model_path_for(self.spec))

    def trainer_env(self, training_s: float, checkpoint_s: float, dump_dir: Path) -> dict[str, str]:
        """PyTorch NCCL watchdog and flight-recorder settings sized from the phase bounds."""
        from rlctl.workload.nccl_env import NcclBounds, installed_torch_version, trainer_nccl_settings

        bounds = NcclBounds(max_step_s=training_s, checkpoint_s=checkpoint_s, dump_dir=dump_dir)
        settings = trainer_nccl_settings(bounds, installed_torch_version())  # the workers run this torch
        return {**settings.env, "RLCTL_PG_TIMEOUT_S": str(int(settings.pg_timeout.total_seconds()))}
