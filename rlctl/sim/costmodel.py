"""The simulator's cost model: how long everything takes, loaded from a documented TOML file.

Every default is drawn from a public figure in shared/notes (field.md, reliability.md); the source
of each is listed in docs/cost-model.md and in ``SOURCES`` below. A cost-model file may set any
subset of keys; the rest keep their defaults. Unknown keys are errors (a typo must not silently
fall back to a default). Pure apart from ``load_cost_model`` reading its file.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from rlctl.sim.measured import STRIPED_PULL, sender_efficiency


@dataclass(frozen=True)
class ClusterCost:
    gpus_per_node: int = 8
    trainer_share: float = 0.25
    reward_nodes_per_256_gpus: float = 1.0
    spare_fraction: float = 0.05


@dataclass(frozen=True)
class WorkloadCost:
    batch_prompts: int = 512
    group_size: int = 8
    sim_batch_prompts: int = 0  # prompts the scheduler tracks per round (0: the job file's batch)
    sim_group_size: int = 0  # samples per tracked prompt (0: the job file's group size)
    constant_group_fraction: float = 0.4  # a group's samples all get the same reward (dynamic sampling filters it)


@dataclass(frozen=True)
class GenerationCost:
    response_median_tokens: float = 600.0
    response_sigma: float = 0.6
    max_new_tokens: int = 8192  # 0: take the job file's cap
    short_max_tokens: int = 2048  # 0: take the job file's short-round cap
    per_token_s: float = 0.03
    overhead_s: float = 5.0
    wide_per_token_ratio: float = 0.65  # per-token latency of a regrouped (twice as wide) engine, relative
    regroup_s: float = 15.0  # an engine rebuilt at another degree from the weights it holds
    env_call_s: float = 0.5  # multi-turn: one environment call, rollout -> controller -> env worker and back
    env_turns: int = 0  # multi-turn: turns of a round's longest episode (the simulated job sets it: [env] max_turns)


@dataclass(frozen=True)
class StepCost:
    reward_s: float = 5.0
    train_s: float = 120.0
    jitter: float = 0.05  # relative standard deviation of reward and train times
    checkpoint_s: float = 20.0
    checkpoint_load_s: float = 30.0
    colocation_switch_s: float = 6.0  # a colocated step: engines sleep and wake, optimizer state out and back
    optimizer_s: float = 0.2  # one more optimizer update of the sharded model (a mini-batch's)
    logprob_pass_ratio: float = 1.0 / 3.0  # a no-grad forward over the batch, relative to train_s


@dataclass(frozen=True)
class WeightsCost:
    """A weight version moved point to point: each trainer rank serves its shard, every rollout
    engine pulls the whole version striped over all ranks. A pull is bound by the receiver's link,
    or by each sender's link shared by every puller at once, whichever is slower; a sender achieves
    ``sender_efficiency`` of its link (fitted from a measured striped pull, ``rlctl.sim.measured``).
    Where the bytes go through host memory (``stage_bytes_per_s`` > 0), each sender first copies its
    share device to host and the receiver then copies the whole version host to device, neither
    overlapped with the transfer; 0 means no host copy on the critical path (a transport that carries
    GPU memory, or staging hidden behind the transfer)."""

    bytes: float = 16e9
    bandwidth_bytes_per_s: float = 25e9  # one link, a sender's or a receiver's
    overhead_s: float = 1.0
    stage_bytes_per_s: float = 0.0  # GPU<->host copy at each end of a pull (0: none on the critical path)
    sender_efficiency: float = field(default_factory=sender_efficiency)
    state_serve_bytes_per_s: float = 2.6e9  # a rank's part of the trainer state copied and checksummed for its standby
    senders: int = 1  # trainer ranks that serve a version (the simulated layout sets it: one per trainer GPU)
    pullers: int = 1  # rollout engines that pull each version at once (the layout: rollout GPUs over TP)

    def pull_s(self, nbytes: float, pullers: int) -> float:
        """``pullers`` receivers each pulling ``nbytes`` split evenly over the senders."""
        receiver_s = nbytes / self.bandwidth_bytes_per_s
        sender_s = nbytes * pullers / (max(1, self.senders) * self.bandwidth_bytes_per_s * self.sender_efficiency)
        return self.overhead_s + self.staging_s(nbytes) + max(receiver_s, sender_s)

    def staging_s(self, nbytes: float) -> float:
        """Host staging around a pull of ``nbytes``: a sender's share device to host, then the whole
        version host to device at the receiver (0 without staging)."""
        if self.stage_bytes_per_s <= 0:
            return 0.0
        return nbytes / max(1, self.senders) / self.stage_bytes_per_s + nbytes / self.stage_bytes_per_s

    @property
    def sync_s(self) -> float:
        """A version to every rollout engine."""
        return self.pull_s(self.bytes, self.pullers)

    @property
    def state_serve_s(self) -> float:
        """What serving its part of the trainer state to the standby adds to each rank's step: a
        copy and a checksum of 1/N of the 7x-weight-bytes state (``rlctl.workload.rank_state``)."""
        return 7 * self.bytes / max(1, self.senders) / self.state_serve_bytes_per_s

    @property
    def state_copy_s(self) -> float:
        """The trainer's full state to a warm standby (one puller): bf16 weights plus an fp32 master
        copy and two fp32 Adam moments, 7x the weight bytes, each rank its part."""
        return self.pull_s(7 * self.bytes, 1)


@dataclass(frozen=True)
class InitCost:
    trainer_s: float = 240.0
    rollout_s: float = 120.0
    reward_s: float = 20.0
    env_s: float = 20.0
    standby_s: float = 240.0  # a warm standby loads every role's environment (trainer and rollout)
    agent_start_s: float = 10.0
    allocate_s: float = 60.0

    def for_role(self, role: str) -> float:
        return {"trainer": self.trainer_s, "rollout": self.rollout_s, "reward": self.reward_s, "env": self.env_s}[role]


@dataclass(frozen=True)
class DetectionCost:
    exit_report_s: float = 0.5
    nvml_poll_s: float = 5.0
    probe_s: float = 5.0
    tick_s: float = 0.1
    nccl_timeout_s: float = 600.0
    network_error_s: float = 30.0
    agent_restart_s: float = 5.0
    heartbeat_jitter_s: float = 0.02


@dataclass(frozen=True)
class RecoveryCost:
    slurm_realloc_s: float = 120.0
    stop_s: float = 15.0
    requeue_s: float = 60.0
    worker_stop_s: float = 1.0


@dataclass(frozen=True)
class CostModel:
    cluster: ClusterCost = field(default_factory=ClusterCost)
    workload: WorkloadCost = field(default_factory=WorkloadCost)
    generation: GenerationCost = field(default_factory=GenerationCost)
    step: StepCost = field(default_factory=StepCost)
    weights: WeightsCost = field(default_factory=WeightsCost)
    init: InitCost = field(default_factory=InitCost)
    detection: DetectionCost = field(default_factory=DetectionCost)
    recovery: RecoveryCost = field(default_factory=RecoveryCost)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return asdict(self)


# Where each default comes from (rendered into docs/cost-model.md). [P] primary, [S] secondary,
# [D] derived arithmetic or an assumption stated as such, [M] fitted from rlctl's own measured curve
# (rlctl.sim.measured).
SOURCES: dict[str, str] = {
    "cluster.gpus_per_node": "[P] HGX H100/H800 nodes carry 8 GPUs (Llama 3, RobustRL testbeds)",
    "cluster.trainer_share": "[D] disaggregated RL: rollout is ~70-80% of the step (verl DAPO-32B, hotdry blog), so ~25% of GPUs train",
    "cluster.reward_nodes_per_256_gpus": "[D] math verifiers are CPU-light; one node per 256 GPUs",
    "cluster.spare_fraction": "[P] NCSA Delta (arXiv 2503.11901): about 5% over-provisioning needed",
    "workload.batch_prompts": "[P] DAPO/verl recipes: 512 prompts per step",
    "workload.group_size": "[D] GRPO group of 8 samples per prompt (verl examples use 5-16)",
    "workload.constant_group_fraction": "[D] assumed 0.4: the probability that a group's samples all get the same "
                                        "reward (all right or all wrong), which DAPO's dynamic sampling drops. DAPO "
                                        "(arXiv 2503.14476, section 3.2) reports the share of all-right groups "
                                        "growing through training, without a figure in shared/notes; a practitioner's "
                                        "GRPO check found ~40% of a curated math set zero-variance (deepchokshi.in, "
                                        "GRPO reward-variance analysis). Drawn per step and prompt from the job seed",
    "generation.response_median_tokens": "[D] lognormal response lengths with a long tail; median 600 tokens for math RL",
    "generation.response_sigma": "[D] sigma 0.6 gives a sync-round max near 4.8k tokens for 4,096 samples",
    "generation.max_new_tokens": "[D] 8k-token cap, typical for Qwen-8B math RL",
    "generation.short_max_tokens": "[P] RollPacker short rounds cap responses well below the hard cap",
    "generation.per_token_s": "[P/D] verl Qwen2.5-Math-7B DAPO on H20: generation 150-357 s per step; 30 ms/token decode",
    "generation.overhead_s": "[D] prefill and scheduling per round",
    "generation.wide_per_token_ratio": "[S/D] elastic rollout: twice the tensor parallelism decodes the long tail's "
                                       "few sequences ~35% faster (PAT, arXiv 2605.23945: up to 34.6% lower generation "
                                       "latency with adaptive TP, LLaMA3.1-8B/Qwen3-14B); memory-bound decode reads "
                                       "half the weights per GPU, less the all-reduce",
    "generation.regroup_s": "[D] a vLLM engine restarted at another TP degree from host-held weights: 16 GB in "
                            "(<1 s), KV cache allocated and CUDA graphs captured (~10 s); 15 s, an assumption "
                            "(rlctl's torch engine measures its own: bench/elastic_rollout.py)",
    "generation.env_call_s": "[D] multi-turn (ROLL environment workers): one tool call relayed through the controller "
                             "to an env worker and back; a calculator answers in milliseconds, a sandboxed code run "
                             "in about a second; 0.5 s assumed. A round's longest episode pays it once a turn "
                             "([env] max_turns), its turns one after another",
    "step.reward_s": "[D] rule-based math verifier, seconds per batch",
    "step.train_s": "[P/D] verl 7B DAPO step 356-790 s of which 150-357 s generation; the rest on H100 ~120 s. "
                    "One pass of forward + backward over the batch with one optimizer update: a recipe with "
                    "mini-batches, epochs or a KL pays more (docs/cost-model.md, dynamic sampling and mini-batch "
                    "updates)",
    "step.jitter": "[D] 5% step-to-step variation",
    "step.checkpoint_s": "[D] ~96 GB (8B weights + Adam) to a parallel FS at ~5 GB/s",
    "step.checkpoint_load_s": "[D] reading the same checkpoint back plus optimizer re-shard",
    "step.colocation_switch_s": "[D] per colocated step: the engines' weights back from host memory (16 GB bf16 over "
                                "PCIe5 at ~50 GB/s per GPU, <1 s), the KV cache re-allocated and CUDA graphs "
                                "re-captured (seconds), the trainer's sharded Adam state out and back (<1 s): ~6 s, "
                                "an assumption",
    "step.optimizer_s": "[D] one more AdamW update of an 8B model sharded over 64 ranks: 125M parameters a rank, "
                        "~30 bytes each read and written (fp32 master, two moments, gradient, bf16 copy), 3.75 GB at "
                        "~3 TB/s HBM is ~1.3 ms; with the gradient-norm all-reduce and the pipeline drained at the "
                        "update's boundary, 0.2 s assumed",
    "step.logprob_pass_ratio": "[D] a no-grad forward over the batch (old log-probs before the first of several "
                               "updates, or the reference's) is about a third of forward + backward (the backward "
                               "costs about twice the forward); an assumption",
    "weights.bytes": "[D] 8B parameters in BF16 = 16 GB (reliability.md 4)",
    "weights.bandwidth_bytes_per_s": "[D] assumed: 25 GB/s point to point (reliability.md 4: 0.64 s for 16 GB); "
                                     "rlctl measured 0.76 GB/s on one H200 node (tcp/lo; docs/cost-model.md): "
                                     "--calibrate sets it from a GPU-check report or a job's pulls",
    "weights.overhead_s": "[P] assumed from NeMo-RL nccl_reshard Qwen3-4B 0.21-0.34 s; 1 s including bookkeeping "
                          "(--calibrate fits it when the pulls moved two sizes or more)",
    "weights.stage_bytes_per_s": "[D] assumed: 0, no host copy on the critical path (GPU-direct transfers); rlctl "
                                 "today stages through host memory at 1.14 GB/s on an H200 (--calibrate sets it)",
    "weights.sender_efficiency": f"[M] fitted at load from rlctl's measured striped pull ({STRIPED_PULL.command}: "
                                 f"{', '.join(f'{s:g} s' for s in STRIPED_PULL.seconds)} from "
                                 f"{', '.join(map(str, STRIPED_PULL.holders))} holders of 1 GB at 1 Gbit/s each): "
                                 "seconds = overhead + per_holder / N, efficiency = (bytes / link) / per_holder",
    "weights.state_serve_bytes_per_s": "[M] rlctl's own: a 139 MB trainer state built and served in 0.054 s "
                                       "in-process on this CPU (one copy, one checksum; docs/figures.md, FSDP recovery); "
                                       "a GPU host adds a device-to-host copy at PCIe rates, faster than this",
    "init.trainer_s": "[P/S] NVSentinel reschedule 5-7 min; FlashRecovery restores in 150 s; 4 min cold trainer init",
    "init.rollout_s": "[D] vLLM engine load + CUDA graph capture for an 8B model, ~2 min",
    "init.reward_s": "[D] verifier process start",
    "init.env_s": "[D] environment worker process start (the user's class imported and built), like a verifier",
    "init.standby_s": "[D] a warm standby loads trainer and rollout environments in parallel: max of the two",
    "init.agent_start_s": "[D] agent zipapp ship + start over SSH/srun",
    "init.allocate_s": "[D] initial Slurm allocation with idle nodes",
    "detection.exit_report_s": "[D] agent waitpid + one message",
    "detection.nvml_poll_s": "[P] k8s-device-plugin waits 5000 ms on nvmlEventSetWait; reliability.md 4 'NVML events: poll <=5 s'",
    "detection.probe_s": "[P] rlctl ssh probe_timeout_s default 5 s (a dead node answers only by timing out)",
    "detection.tick_s": "[P] controller tick 0.1 s (rlctl/controller/server.py TICK_S)",
    "detection.nccl_timeout_s": "[P] PyTorch ProcessGroupNCCL default timeout 10 min (reliability.md 2)",
    "detection.network_error_s": "[S] ByteRobust ~30 s for network faults (as cited by RobustRL)",
    "detection.agent_restart_s": "[D] restart the agent process over the second path",
    "detection.heartbeat_jitter_s": "[D] 20 ms heartbeat jitter on a healthy network",
    "recovery.slurm_realloc_s": "[P/D] NVSentinel reschedule 5-7 min; 2 min for a single node from an idle pool",
    "recovery.stop_s": "[P] NVRx --workers-stop-timeout 15 s",
    "recovery.requeue_s": "[P/D] AReaL full relaunch: 10 s sleep + resubmit + reload; 60 s to requeue",
    "recovery.worker_stop_s": "[P] rlctl stop_worker grace 1 s (core/recovery.py)",
}


# Set from the simulated job and layout (layout.layout_costs), never from a file.
LAYOUT_KEYS = frozenset({"senders", "pullers", "env_turns"})


class CostModelError(ValueError):
    """A cost-model file with an unknown key or a value of the wrong type."""


def default_cost_model() -> CostModel:
    return CostModel()


def cost_model_from_dict(data: dict[str, Any], source: str = "<dict>", base: CostModel | None = None) -> CostModel:
    """Overlay ``data`` (a parsed TOML table) on ``base`` (defaults); raise on unknown keys or bad types."""
    model = base or CostModel()
    sections: dict[str, Any] = {}
    known = {f.name: f for f in fields(CostModel)}
    for name, table in data.items():
        if name not in known:
            raise CostModelError(f"{source}: unknown section [{name}]; expected one of {', '.join(known)}")
        if not isinstance(table, dict):
            raise CostModelError(f"{source}: [{name}] must be a table")
        sections[name] = _overlay(getattr(model, name), table, f"{source}: {name}")
    return replace(model, **sections)


def _overlay(section: Any, table: dict[str, Any], where: str) -> Any:
    known = {f.name: f for f in fields(section) if f.name not in LAYOUT_KEYS}
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key in LAYOUT_KEYS:
            raise CostModelError(f"{where}.{key}: set from the simulated job and layout, not from a cost-model file")
        if key not in known:
            raise CostModelError(f"{where}.{key}: unknown key; expected one of {', '.join(known)}")
        current = getattr(section, key)
        if isinstance(current, bool) or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CostModelError(f"{where}.{key}: expected a number, got {value!r}")
        if isinstance(current, int) and not isinstance(value, int):
            raise CostModelError(f"{where}.{key}: expected an integer, got {value!r}")
        if value < 0:
            raise CostModelError(f"{where}.{key}: expected a value >= 0, got {value!r}")
        values[key] = value
    return replace(section, **values)


def load_cost_model(path: Path | None) -> CostModel:
    """The defaults, overlaid with the TOML (or JSON) file at ``path`` when given."""
    if path is None:
        return CostModel()
    text = path.read_text()
    if path.suffix == ".json":
        import json

        return cost_model_from_dict(json.loads(text), str(path))
    try:
        return cost_model_from_dict(tomllib.loads(text), str(path))
    except tomllib.TOMLDecodeError as exc:
        raise CostModelError(f"{path}: not valid TOML: {exc}") from None


def cost_model_to_toml(model: CostModel, comments: bool = True) -> str:
    """Render ``model`` as a TOML file, each key commented with the source of its default."""
    lines: list[str] = []
    for section, values in model.as_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if key in LAYOUT_KEYS:
                continue
            note = SOURCES.get(f"{section}.{key}", "")
            rendered = repr(value) if isinstance(value, int) else f"{float(value)!r}"
            lines.append(f"{key} = {rendered}" + (f"  # {note}" if comments and note else ""))
        lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------- response lengths


def normal_quantile(p: float) -> float:
    """Φ^-1(p) for a standard normal (Acklam's rational approximation, |error| < 1.2e-9)."""
    p = min(max(p, 1e-15), 1.0 - 1e-15)
    a = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02, 1.383577518672690e02,
         -3.066479806614716e01, 2.506628277459239e00)
    b = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02, 6.680131188771972e01,
         -1.328068155288572e01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00, -2.549732539343734e00,
         4.374664141464968e00, 2.938163982698783e00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)
    if p < 0.02425:
        q = math.sqrt(-2 * math.log(p))
        return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / (
            (((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    if p > 1 - 0.02425:
        return -normal_quantile(1 - p)
    q = p - 0.5
    r = q * q
    return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q / (
        ((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)


def response_quantile(gen: GenerationCost, p: float) -> float:
    """Response length (tokens) at quantile ``p`` of the lognormal length distribution."""
    return gen.response_median_tokens * math.exp(gen.response_sigma * normal_quantile(p))


def response_cdf(gen: GenerationCost, tokens: float) -> float:
    if tokens <= 0:
        return 0.0
    z = math.log(tokens / gen.response_median_tokens) / gen.response_sigma
    return 0.5 * math.erfc(-z / math.sqrt(2.0))
