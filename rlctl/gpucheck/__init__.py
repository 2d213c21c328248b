"""GPU check: prove on real hardware what the CPU test tiers can only emulate.

Role: ``python -m rlctl.gpucheck`` (or ``bash tests/gpu/run.sh``) runs on a node with an NVIDIA
GPU, PyTorch and no internet, and prints ONE JSON object: per part, ``status`` ("ok",
"skipped" with a ``reason``, or "failed" with an ``error``) plus measured figures. Parts:

- ``nvml``: the agent's ``NvmlProvider`` against the real driver: facts, sane sample values, an
  event wait that times out cleanly;
- ``nvml_sample_cost``: milliseconds per ``NvmlProvider.sample()`` (what a heartbeat costs);
- ``torch_rollout``: ``TorchEngine`` on the GPU, tokens/s;
- ``torch_decode``: ``TorchEngine``'s CUDA-graph decode path against its goals (ms per step,
  tokens/s against the CPU, same samples as the eager path);
- ``torch_train_step``: one GRPO ``Trainer.train_step`` on the GPU, seconds per step;
- ``ucx_cuda``: a CUDA state dict published and fetched through the rlctl UCX transport
  (device->host staging, transfer, host->device), GB/s;
- ``weights_stage``: a 1 GiB bf16 CUDA state published through a weight server (chunked side-stream
  copy into reused pinned buffers) and loaded back from them, against GB/s goals each way;
- ``weights_pull_local``: a 0.5B- and an 8B-shape bf16 state published here, pulled by a joiner
  process on this node, loaded on the GPU: bit-exact, the lane named, end-to-end GB/s goal;
- ``nccl_watchdog``: an NCCL process group with the settings of ``rlctl.workload.nccl_env`` and a
  deliberately stalled collective, its ranks run by the agent's own supervisor and watch loop: the
  torch watchdog's report is classified as ``nccl-timeout`` and the rank killed, stall to gone <= 10 s;
- ``local_job``: a whole job on the one GPU (trainer, two rollouts, reward, warm standby; a 0.5B-shape
  Qwen3) through a trainer crash and a rollout crash: it must succeed with no trajectory lost;
- ``vllm_engine``: ``VllmEngine`` tokens/s and in-place weight update, where vllm is installed.

Without a GPU every part is skipped with its reason and the exit status is 0; the exit status
is 1 only when a part failed.
"""

from rlctl.gpucheck.report import PART_NAMES, run_all

__all__ = ["PART_NAMES", "run_all"]
