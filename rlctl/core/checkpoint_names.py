"""How checkpoint folders are named, and what the hidden ones a killed write leaves behind are. Pure.

A checkpoint of version N is the folder ``step-00000N`` in the job's checkpoints folder. It is
written under a hidden staged name and renamed into place only once whole
(``rlctl.workload.trainer.Trainer.save_checkpoint``); a rewrite of a step that is already there
moves the old folder aside under a hidden retired name first. A step folder is therefore never
half written; a write killed half way leaves a staged folder (garbage) or, killed between the two
renames of a rewrite, a retired one (the checkpoint itself, to be moved back).
"""

from __future__ import annotations

STEP_FOLDER_PREFIX = "step-"
STAGED_MARK = ".tmp-"  # ``.step-000007.tmp-<pid>``: a folder being written, renamed into place once whole
RETIRED_MARK = ".old-"  # ``.step-000007.old-<pid>``: the folder a rewrite of the same step replaces


def step_folder(step: int) -> str:
    """The checkpoint folder of version ``step``."""
    return f"{STEP_FOLDER_PREFIX}{step:06d}"


def staged_name(folder: str, tag: str) -> str:
    """The hidden name a checkpoint folder is written under before it is renamed to ``folder``."""
    return f".{folder}{STAGED_MARK}{tag}"


def retired_name(folder: str, tag: str) -> str:
    """The hidden name a step folder is moved to while a rewrite of the same step takes its place."""
    return f".{folder}{RETIRED_MARK}{tag}"


def leftover_of(name: str) -> tuple[str, bool] | None:
    """For a hidden folder a checkpoint write left in the checkpoints folder: the step folder it
    belongs to and whether it is a retired copy (a whole checkpoint moved aside while a rewrite of
    the same step was renamed in; it is the checkpoint again if that rename never happened) rather
    than a staged, unfinished one. None for anything else."""
    if not name.startswith("." + STEP_FOLDER_PREFIX):
        return None
    for mark, retired in ((STAGED_MARK, False), (RETIRED_MARK, True)):
        folder, found, tag = name[1:].rpartition(mark)
        if found and tag and folder.startswith(STEP_FOLDER_PREFIX) and folder[len(STEP_FOLDER_PREFIX):].isdigit():
            return folder, retired
    return None
