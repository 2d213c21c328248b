"""What the controller needs from the workload, and nothing more: the seam between the two.

The controller owns prompts, rounds and workers but knows nothing of tokenizers, data files,
model folders or NCCL. It is given a ``Workload`` (``rlctl.assembly.make_workload`` builds the
reference GRPO workload's, ``rlctl.workload.seam.GrpoWorkload``, from the job spec) and asks it
only for these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from rlctl.core.rounds import PromptRef


class Workload(Protocol):
    def prompts(self) -> list[PromptRef]:
        """The training prompts, deterministic for the spec (a resumed controller gets the same ids)."""
        ...

    def held_out_prompts(self) -> list[PromptRef]:
        """The held-out prompts (none without ``[data] eval_files``)."""
        ...

    def model_path(self) -> str:
        """The model folder every worker loads (absolute)."""
        ...

    def trainer_env(self, training_s: float, checkpoint_s: float, dump_dir: Path) -> dict[str, str]:
        """The environment of a trainer rank for steps and checkpoints bounded by these seconds
        (collective watchdogs and timeouts), with its debug dumps in ``dump_dir``."""
        ...
