"""The verl -> rlctl mapping, written once: what each verl key becomes, and how each job key is made.

Role: two tables. ``RULES`` classifies a verl key (a dotted pattern: ``*`` is one segment, a
trailing ``**`` any depth) as ``mapped`` (carried exactly, naming the rlctl key), ``ignored`` (it
tunes only verl's own speed, memory or logging, or is read only by a feature that is off) or
``refused`` (it changes what is learned and rlctl cannot carry it); a rule may refuse some values
of a key it otherwise maps or ignores. A key no rule names is ignored at verl's default and
refused otherwise. ``JOB_VALUES`` lists every job-file key the converter writes, in file order,
with the verl keys that decide it and how (through ``verl_run.Run``, which refuses what cannot be
carried). docs/algorithms.md's table is ``rules_markdown()``. Pure.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from rlctl.convert.hydra import Override
from rlctl.convert.verl_config import VerlConfig, known_defaults
from rlctl.convert.verl_run import OPTIM, A, FactError, M, R, Refusal, Run

MAPPED, IGNORED, REFUSED = "mapped", "ignored", "refused"
REF = "actor_rollout_ref.ref"


@dataclass(frozen=True)
class Verdict:
    status: str
    reason: str
    job_key: str | None = None


@dataclass(frozen=True)
class KeyContext:
    """A key being judged: its value in the resolved config, the override that set it (None for a
    default) and the run it belongs to."""

    key: str
    value: Any
    run: Run
    override: Override | None = None

    @property
    def cfg(self) -> VerlConfig:
        return self.run.cfg


Check = Callable[[KeyContext], "str | None"]  # a refusal's reason, or None
Decide = Callable[[KeyContext], Verdict]


@dataclass(frozen=True)
class Rule:
    """How verl keys matching ``pattern`` are judged: usually ``status`` with ``reason`` (and
    ``job_key`` when mapped), ``refused`` when ``refuse`` gives a reason, or whatever ``decide``
    says. ``reason`` is also the docs' text."""

    pattern: str
    status: str
    reason: str
    job_key: str | None = None
    refuse: Check | None = None
    decide: Decide | None = None
    regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regex", re.compile(r"\.".join(_segment(part) for part in self.pattern.split("."))))

    @property
    def concrete(self) -> bool:
        """Names one key (no wildcard): its default can be checked too."""
        return "*" not in self.pattern

    def matches(self, key: str) -> bool:
        return self.regex.fullmatch(key) is not None

    def verdict(self, ctx: KeyContext) -> Verdict:
        if self.decide is not None:
            return self.decide(ctx)
        why = self.refusal(ctx)
        if why:
            return Verdict(REFUSED, why)
        return Verdict(self.status, self.reason, self.job_key if self.status == MAPPED else None)

    def refusal(self, ctx: KeyContext) -> str | None:
        if self.refuse is None:
            return None
        try:
            return self.refuse(ctx)
        except Refusal as exc:
            return exc.reason if exc.key == ctx.key else None


def _segment(part: str) -> str:
    """A pattern's segment as a regex: ``**`` is one or more segments, ``*`` one, ``a*`` a glob."""
    if part == "**":
        return r"[^.]+(?:\.[^.]+)*"
    if part == "*":
        return r"[^.]+"
    return re.escape(part).replace(r"\*", r"[^.]*")


def mapped(pattern: str, job_key: str | None, reason: str, refuse: Check | None = None) -> Rule:
    return Rule(pattern, MAPPED, reason, job_key, refuse)


def ignored(pattern: str, reason: str, refuse: Check | None = None) -> Rule:
    return Rule(pattern, IGNORED, reason, None, refuse)


def refused(pattern: str, reason: str) -> Rule:
    """A key rlctl has no equivalent of: its value is refused unless it is verl's default."""
    return Rule(pattern, REFUSED, reason, None, None, _refused_unless_default(reason))


def custom(pattern: str, status: str, reason: str, decide: Decide, job_key: str | None = None) -> Rule:
    return Rule(pattern, status, reason, job_key, None, decide)


def at_default(ctx: KeyContext) -> bool:
    defaults = known_defaults()
    return ctx.key in defaults and ctx.value == defaults[ctx.key]


def _refused_unless_default(reason: str) -> Decide:
    def decide(ctx: KeyContext) -> Verdict:
        if at_default(ctx):
            return Verdict(IGNORED, "verl's default value: changes nothing")
        return Verdict(REFUSED, reason)
    return decide


def fallback(ctx: KeyContext) -> Verdict:
    """A key no rule names: nothing changes at verl's default, anything else cannot be judged."""
    if at_default(ctx):
        return Verdict(IGNORED, "verl's default value: changes nothing")
    if ctx.key not in known_defaults():
        return Verdict(REFUSED, "an added key this converter has no rule for (it may change what verl learns)")
    return Verdict(REFUSED, f"changes verl's default ({known_defaults()[ctx.key]!r}) and rlctl has no equivalent "
                   "of this key")


def _from_run(read: Callable[[Run], object]) -> Check:
    """A check that reads a ``Run`` property (which raises Refusal for what cannot be carried)."""
    def check(ctx: KeyContext) -> str | None:
        read(ctx.run)
        return None
    return check


def _kl_type(ctx: KeyContext) -> str | None:
    ctx.run.kl_type(ctx.key)
    return None


def _unless(accepted: Callable[[Any], bool], reason: str) -> Check:
    return lambda ctx: None if accepted(ctx.value) else reason


# -- custom deciders -----------------------------------------------------------------------------

def _lookup(config: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _override_config(ctx: KeyContext) -> Verdict:
    """``+actor_rollout_ref.model.override_config.X=V`` changes nothing where the model's
    config.json has no X (the model does not read it) or already has V."""
    prefix = f"{M}.override_config"
    name = ctx.key[len(prefix) + 1:]
    items = ctx.value if isinstance(ctx.value, dict) and not name else {name: ctx.value}
    if not items:
        return Verdict(IGNORED, "no keys: changes nothing")
    try:
        config = ctx.run.model_config()
    except FactError as exc:
        return Verdict(REFUSED, f"{exc}: whether it changes the model cannot be known")
    reasons = []
    for item, value in items.items():
        present, current = _lookup(config, str(item))
        if present and current != value:
            return Verdict(REFUSED, f"the model's config.json has {item} = {current!r}: {value!r} changes the "
                           "model, and rlctl loads the folder as it is")
        reasons.append(f"config.json already has {item} = {current!r}" if present
                       else f"config.json has no {item} (the model does not read it)")
    return Verdict(IGNORED, "; ".join(reasons) + ": changes nothing")


SAFE_ENGINE_KWARGS = frozenset({"swap_space", "disable_custom_all_reduce", "disable_mm_preprocessor_cache",
                                "compilation_config", "block_size"})


def _engine_kwargs(ctx: KeyContext) -> Verdict:
    if at_default(ctx):
        return Verdict(IGNORED, "verl's default value: changes nothing")
    name = ctx.key.split(".")[4] if ctx.key.count(".") >= 4 else ""
    if name in SAFE_ENGINE_KWARGS:
        return Verdict(IGNORED, f"the engine's {name}: memory, kernels or scheduling, not what is generated")
    return Verdict(REFUSED, "an engine argument this converter cannot judge: it may change what is generated")


def _gen_batch_size(ctx: KeyContext) -> Verdict:
    if ctx.value is None or ctx.value == ctx.cfg["data.train_batch_size"] or ctx.cfg[
            "algorithm.filter_groups.enable"] is True:
        return Verdict(IGNORED, "rlctl refills exactly the groups dynamic sampling drops, as verl 0.9's own trainer "
                       "does (it sets gen_batch_size to 1 under filtering), so no surplus is generated and none "
                       "discarded")
    return Verdict(REFUSED, "without dynamic sampling verl 0.9 generates gen_batch_size prompts a step and drops "
                   "the surplus; rlctl generates exactly data.train_batch_size")


def _val_before_train(ctx: KeyContext) -> Verdict:
    if ctx.value is False:
        return Verdict(IGNORED, "rlctl always evaluates the initial weights when it evaluates (eval files and "
                       "data.eval_every > 0); an evaluation changes nothing that is learned")
    return Verdict(IGNORED, "rlctl evaluates the initial weights too (eval files and data.eval_every > 0)")


def _total_epochs(ctx: KeyContext) -> Verdict:
    run = ctx.run
    try:
        steps = run.steps
        if ctx.cfg["trainer.total_training_steps"] is not None:
            return Verdict(MAPPED, f"trainer.total_training_steps decides the steps ({steps}); the epochs bound "
                           "them only where they end first (checked where the train files can be read)", "job.steps")
        return Verdict(MAPPED, f"{run.read_int('trainer.total_epochs')} epochs x {run.steps_per_epoch} full batches "
                       f"of {run.batch_prompts} = {steps} steps (verl drops an epoch's last partial batch)",
                       "job.steps")
    except Refusal as exc:
        if exc.key == ctx.key:
            return Verdict(REFUSED, exc.reason)
        return Verdict(MAPPED, "job.steps (with trainer.total_training_steps)", "job.steps")


# -- the rules -----------------------------------------------------------------------------------

PADDING = "padding removal: the same tokens are trained, without pad tokens in the batch"
ULYSSES = "Ulysses sequence parallelism: splits each sequence over GPUs, the same loss"
OFFLOAD = "CPU offload of parameters or optimizer state: memory, not the math"
MICRO = ("micro-batches and dynamic token budgets per GPU: gradients accumulate to the same mini-batch update "
         "(rlctl's micro-batches: [workload] micro_batch_tokens)")
COMPILE = "torch.compile, fused or Liger kernels: speed, the same math"
FSDP_LAYOUT = "how FSDP shards, wraps, reshards and prefetches: memory and speed, the same update"
ENGINE = "the rollout engine's memory, batching, CUDA graphs, chunked prefill and caching: not what is sampled"
CHECKPOINT = "checkpoint storage, retention and resumption: rlctl checkpoints every job.checkpoint_every steps " \
             "into the job's directory and resumes with `rlctl resume`"
LOGGING = "logging, tracking and names: rlctl logs to its journal (and [observability] sinks)"
PROFILE = "profiling: measures, changes nothing"
OPS = "Ray, transfer queue and NCCL settings of verl's own processes"
NO_CRITIC = "read only with a critic (algorithm.adv_estimator=gae, which is refused)"
NO_MODEL_REWARD = "read only with a model reward (reward_model.enable, which is refused)"


def _divides_batch(ctx: KeyContext) -> str | None:
    mini, batch = ctx.run.mini_batch, ctx.run.batch_prompts
    return None if batch % mini == 0 and mini <= batch else f"{mini} does not divide data.train_batch_size ({batch})"


RULES: tuple[Rule, ...] = (
    # the algorithm
    mapped("algorithm.adv_estimator", "algorithm.adv_estimator", "the advantage estimator",
           _from_run(lambda run: run.adv_estimator)),
    mapped("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std_in_grpo", "GRPO's std normalisation"),
    mapped("algorithm.gamma", "algorithm.gamma", "REINFORCE++'s discount"),
    ignored("algorithm.lam", "GAE's lambda: read only by gae (refused)"),
    mapped("algorithm.use_kl_in_reward", "algorithm.use_kl_in_reward", "a KL penalty in the token rewards"),
    mapped("algorithm.kl_penalty", "algorithm.kl_penalty", "the in-reward KL's estimator",
           _kl_type),
    mapped("algorithm.kl_ctrl.kl_coef", "algorithm.kl_coef", "the in-reward KL's weight"),
    mapped("algorithm.kl_ctrl.type", "algorithm.use_kl_in_reward", "fixed: rlctl's in-reward KL weight is fixed",
           _from_run(lambda run: run.kl_coef)),
    ignored("algorithm.kl_ctrl.horizon", "read only by the adaptive KL controller (refused)"),
    ignored("algorithm.kl_ctrl.target_kl", "read only by the adaptive KL controller (refused)"),
    mapped("algorithm.filter_groups.enable", "algorithm.filter_groups.enable", "DAPO's dynamic sampling"),
    mapped("algorithm.filter_groups.metric", "algorithm.filter_groups.metric", "the metric whose variation keeps "
           "a group"),
    mapped("algorithm.filter_groups.max_num_gen_batches", "algorithm.filter_groups.max_num_gen_batches",
           "the draws one step may take before the job fails, as DAPO's recipe (verl 0.9's main_ppo only warns)"),
    ignored("algorithm.filter_groups.max_inflight_gen_batches", "how many refill generations run at once: speed"),
    refused("algorithm.use_pf_ppo", "PF-PPO's reweighting of samples: rlctl has no equivalent"),
    ignored("algorithm.pf_ppo.**", "read only with algorithm.use_pf_ppo (refused)"),
    refused("algorithm.rollout_correction.**", "rollout importance-sampling or rejection corrections: rlctl trains "
            "on-policy samples of the current weights and has no such correction"),
    # the actor's loss
    mapped(f"{A}.policy_loss.loss_mode", "algorithm.policy_loss", "the policy loss",
           _from_run(lambda run: run.policy_loss)),
    ignored(f"{A}.policy_loss.*", "read only by policy losses rlctl refuses (clip-cov, kl-cov, DRO, ...)"),
    ignored(f"{A}.tau_pos", "read only by policy losses rlctl refuses"),
    ignored(f"{A}.tau_neg", "read only by policy losses rlctl refuses"),
    mapped(f"{A}.clip_ratio", "algorithm.clip_ratio", "the PPO clip where the low/high clips are null"),
    mapped(f"{A}.clip_ratio_low", "algorithm.clip_ratio_low", "the lower clip"),
    mapped(f"{A}.clip_ratio_high", "algorithm.clip_ratio_high", "the upper clip (clip-higher)"),
    mapped(f"{A}.clip_ratio_c", "algorithm.clip_ratio_c", "the dual-clip bound"),
    mapped(f"{A}.loss_agg_mode", "algorithm.loss_agg_mode", "how token losses are aggregated",
           _from_run(lambda run: run.loss_agg_mode)),
    mapped(f"{A}.use_token_level_loss", "algorithm.loss_agg_mode", "DAPO's older key: true is token-mean, false "
           "seq-mean-token-mean", _from_run(lambda run: run.loss_agg_mode)),
    mapped(f"{A}.loss_scale_factor", "algorithm.loss_scale_factor", "seq-mean-token-sum-norm's divisor (null: the "
           "response cap)", _from_run(lambda run: run.loss_scale_factor)),
    mapped(f"{A}.entropy_coeff", "algorithm.entropy_coeff", "the entropy bonus"),
    mapped(f"{A}.use_kl_loss", "algorithm.use_kl_loss", "a KL loss to the reference"),
    mapped(f"{A}.kl_loss_coef", "algorithm.kl_loss_coef", "the KL loss's weight"),
    mapped(f"{A}.kl_loss_type", "algorithm.kl_loss_type", "the KL loss's estimator",
           _kl_type),
    mapped(f"{A}.ppo_mini_batch_size", "algorithm.ppo_mini_batch_size", "prompts per optimizer update",
           _divides_batch),
    mapped(f"{A}.ppo_epochs", "algorithm.ppo_epochs", "passes over a step's batch"),
    mapped(f"{A}.shuffle", "algorithm.shuffle", "the mini-batch shuffle"),
    mapped(f"{A}.data_loader_seed", "algorithm.data_loader_seed", "the mini-batch shuffle's seed"),
    ignored(f"{A}.rollout_n", "verl copies rollout.n here"),
    ignored(f"{A}.calculate_entropy", "an entropy metric (the entropy is computed for the loss when entropy_coeff "
            "is not 0)"),
    ignored(f"{A}.calculate_sum_pi_squared", "a metric"),
    ignored(f"{A}.use_prefix_grouper", "shares a group's prompt in one forward pass: speed"),
    # the actor's optimizer
    mapped(f"{A}.grad_clip", "workload.grad_clip", "the gradient-norm clip (verl 0.9 reads optim.clip_grad; older "
           "releases and DAPO's scripts this)", _from_run(lambda run: run.grad_clip)),
    mapped(f"{OPTIM}.clip_grad", "workload.grad_clip", "the gradient-norm clip", _from_run(lambda run: run.grad_clip)),
    mapped(f"{OPTIM}.grad_clip", "workload.grad_clip", "the gradient-norm clip (deprecated spelling)",
           _from_run(lambda run: run.grad_clip)),
    mapped(f"{OPTIM}.lr", "workload.learning_rate", "AdamW's learning rate"),
    mapped(f"{OPTIM}.lr_warmup_steps", "workload.lr_warmup_steps", "the warmup (<= 0: the ratio's)"),
    mapped(f"{OPTIM}.lr_warmup_steps_ratio", "workload.lr_warmup_steps", "the warmup as int(ratio x steps), as "
           "verl computes it"),
    mapped(f"{OPTIM}.weight_decay", "workload.weight_decay", "AdamW's weight decay"),
    mapped(f"{OPTIM}.betas", "workload.adam_beta1, workload.adam_beta2", "AdamW's betas",
           _from_run(lambda run: run.betas)),
    mapped(f"{OPTIM}.lr_scheduler_type", "workload.lr_scheduler", "verl's constant or cosine schedule",
           _from_run(lambda run: run.lr_scheduler)),
    mapped(f"{OPTIM}.warmup_style", "workload.lr_scheduler", "the schedule's deprecated spelling",
           _from_run(lambda run: run.lr_scheduler)),
    mapped(f"{OPTIM}.min_lr_ratio", "workload.min_lr_ratio", "the cosine's floor"),
    mapped(f"{OPTIM}.num_cycles", "workload.num_cycles", "the cosine's waves"),
    mapped(f"{OPTIM}.zero_indexed_step", "workload.lr_scheduler", "true: rlctl's schedules count from 0",
           _from_run(lambda run: run.lr_scheduler)),
    mapped(f"{OPTIM}.optimizer", None, "AdamW: rlctl's optimizer", _from_run(lambda run: run.betas)),
    mapped(f"{OPTIM}.optimizer_impl", None, "torch.optim: rlctl's optimizer", _from_run(lambda run: run.betas)),
    mapped(f"{OPTIM}.override_optimizer_config", None, "none: rlctl's optimizer",
           _from_run(lambda run: run.betas)),
    ignored(f"{OPTIM}.total_training_steps", "verl fills it in at run time from the steps"),
    # the actor's engine
    mapped(f"{A}.strategy", "workload.sharding", "FSDP (fsdp, fsdp2): rlctl shards with FSDP2",
           _from_run(lambda run: run.sharding)),
    mapped(f"{A}.fsdp_config.dtype", "model.dtype", "the dtype layers compute in", _from_run(lambda run: run.dtype)),
    mapped(f"{A}.fsdp_config.model_dtype", None, "fp32: rlctl keeps float32 master weights",
           _from_run(lambda run: run.dtype)),
    refused(f"{A}.fsdp_config.qat.**", "quantization-aware training: rlctl has no equivalent"),
    refused(f"{A}.qat.**", "quantization-aware training: rlctl has no equivalent"),
    ignored("**.fsdp_config.*offload*", OFFLOAD),
    ignored("**.fsdp_config.ulysses_sequence_parallel_size", ULYSSES),
    ignored(f"{A}.fsdp_config.**", FSDP_LAYOUT),
    ignored(f"{A}.checkpoint.**", CHECKPOINT),
    ignored("**.ulysses_sequence_parallel_size", ULYSSES),
    ignored("**.ppo_micro_batch_size", MICRO),
    ignored("**.ppo_micro_batch_size_per_gpu", MICRO),
    ignored("**.use_dynamic_bsz", MICRO),
    ignored("**.ppo_max_token_len_per_gpu", MICRO),
    ignored("**.log_prob_micro_batch_size", MICRO),
    ignored("**.log_prob_micro_batch_size_per_gpu", MICRO),
    ignored("**.log_prob_use_dynamic_bsz", MICRO),
    ignored("**.log_prob_max_token_len_per_gpu", MICRO),
    ignored("**.use_torch_compile", COMPILE),
    ignored("**.entropy_from_logits_with_chunking", "computes the entropy in chunks: memory"),
    ignored("**.entropy_from_logits_chunk_size", "computes the entropy in chunks: memory"),
    ignored("**.entropy_checkpointing", "recomputes the entropy in the backward pass: memory"),
    ignored("**.pad_to_length", "pads micro-batches to a fixed length: speed"),
    ignored("**.profiler.**", PROFILE),
    # the reference
    refused(f"{REF}.fsdp_config.dtype", "the reference computes in rlctl's [model] dtype"),
    refused(f"{REF}.fsdp_config.model_dtype", "the reference keeps rlctl's float32 weights"),
    ignored(f"{REF}.fsdp_config.**", "how the frozen reference is sharded and offloaded: memory"),
    ignored(f"{REF}.strategy", "how the frozen reference is sharded: rlctl keeps it beside the trainer"),
    ignored(f"{REF}.rollout_n", "verl copies rollout.n here"),
    # the model
    mapped(f"{M}.path", "model.path", "the model folder (`~` expanded, relative paths from where verl ran)"),
    mapped(f"{M}.trust_remote_code", "model.trust_remote_code", "run the folder's code"),
    mapped(f"{M}.enable_gradient_checkpointing", "model.gradient_checkpointing", "activation recomputation"),
    custom(f"{M}.override_config.**", IGNORED, "ignored when the model's config.json lacks the key or has the value "
           "already; else refused (it changes the model)", _override_config),
    custom(f"{M}.override_config", IGNORED, "as override_config.X, for each key of the table", _override_config),
    ignored(f"{M}.use_remove_padding", PADDING),
    ignored(f"{M}.enable_activation_offload", OFFLOAD),
    ignored(f"{M}.use_shm", "loads the model through shared memory: speed"),
    ignored(f"{M}.use_fused_kernels", COMPILE),
    ignored(f"{M}.fused_kernel_options.**", COMPILE),
    ignored(f"{M}.use_liger", COMPILE),
    ignored(f"{M}.tiled_mlp.**", "tiles the MLP's activations: memory"),
    ignored(f"{M}.lora_rank", "0: no LoRA", _unless(lambda v: not v, "LoRA trains adapters; rlctl trains every "
                                                     "weight")),
    ignored(f"{M}.lora.rank", "0: no LoRA", _unless(lambda v: not v, "LoRA trains adapters; rlctl trains every "
                                                      "weight")),
    ignored(f"{M}.lora_*", "read only with LoRA (lora_rank > 0, refused)"),
    ignored(f"{M}.lora.**", "read only with LoRA (lora.rank > 0, refused)"),
    ignored(f"{M}.target_modules", "read only with LoRA (lora_rank > 0, refused)"),
    ignored(f"{M}.exclude_modules", "read only with LoRA (lora_rank > 0, refused)"),
    refused(f"{M}.mtp.**", "multi-token prediction: rlctl has no equivalent"),
    refused(f"{M}.external_lib", "imports a library that registers model code: rlctl loads the folder with "
            "transformers alone"),
    refused(f"{M}.custom_chat_template", "a chat template other than the tokenizer's: rlctl renders prompts with "
            "the folder's own"),
    refused(f"{M}.hf_config_path", "a config.json other than the folder's"),
    refused(f"{M}.tokenizer_path", "a tokenizer other than the folder's"),
    # the data
    mapped("data.train_files", "data.train_files", "the training prompts (`~` expanded, relative paths from where "
           "verl ran)", _from_run(lambda run: run.train_files)),
    mapped("data.val_files", "data.eval_files", "the held-out prompts, all of them (eval_max_prompts = 0)",
           _from_run(lambda run: run.eval_files)),
    mapped("data.prompt_key", "data.prompt_key", "the prompt column"),
    mapped("data.reward_fn_key", "data.data_source_key", "the column that picks the reward function"),
    mapped("data.max_prompt_length", "model.max_prompt_tokens", "the prompt cap"),
    mapped("data.max_response_length", "model.max_response_tokens, rollout.max_new_tokens", "the response cap"),
    mapped("data.train_batch_size", "rollout.batch_prompts", "prompts a step"),
    mapped("data.filter_overlong_prompts", "data.filter_overlong_prompts", "leave out prompts over the cap"),
    mapped("data.truncation", "data.truncation", "what an over-long prompt becomes (error, left, right, middle)"),
    mapped("data.shuffle", "job.seed", "true: rlctl shuffles every epoch's prompts too (from job.seed)",
           _from_run(lambda run: run.seed)),
    mapped("data.seed", "job.seed", "the seed (null: job.seed 0)"),
    mapped("data.val_max_samples", "data.eval_max_prompts", "held-out prompts an evaluation takes (-1: all; rlctl "
           "takes the first N in file order)"),
    refused("data.train_max_samples", "trains a subset of the train files: rlctl trains every row"),
    custom("data.gen_batch_size", IGNORED, "rlctl refills exactly the groups dynamic sampling drops, as verl 0.9's "
           "trainer does; refused without dynamic sampling when it differs from train_batch_size", _gen_batch_size),
    ignored("data.dataloader_num_workers", "data-loading processes: speed"),
    ignored("data.filter_overlong_prompts_workers", "processes that filter prompts: speed"),
    ignored("data.use_shm", "shared memory for data: speed"),
    ignored("data.return_raw_input_ids", "what verl's dataset hands its workers internally"),
    ignored("data.return_raw_chat", "what verl's dataset hands its workers internally"),
    ignored("data.return_full_prompt", "what verl's dataset hands its workers internally"),
    ignored("data.val_batch_size", "how the held-out prompts are batched: evaluation only"),
    ignored("data.validation_shuffle", "the held-out prompts' order: evaluation only"),
    refused("data.apply_chat_template_kwargs", "arguments to the chat template (e.g. enable_thinking): rlctl renders "
            "prompts with the template's defaults"),
    refused("data.custom_cls.**", "a dataset class of your own"),
    refused("data.tokenizer", "a tokenizer other than the model folder's"),
    refused("data.tool_config_path", "tools for multi-turn rollouts: rlctl's multi-turn runs [env] classes"),
    refused("data.function_tool_path", "tools for multi-turn rollouts: rlctl's multi-turn runs [env] classes"),
    # the rollout
    mapped(f"{R}.n", "rollout.group_size", "samples per prompt"),
    mapped(f"{R}.temperature", "algorithm.temperature", "sampling temperature",
           _from_run(lambda run: run.rollout_sampling)),
    mapped(f"{R}.top_p", "algorithm.top_p", "nucleus sampling", _from_run(lambda run: run.rollout_sampling)),
    mapped(f"{R}.top_k", "algorithm.top_k", "top-k sampling", _from_run(lambda run: run.rollout_sampling)),
    mapped(f"{R}.do_sample", None, "true: rlctl samples training rollouts", _from_run(lambda run: run.rollout_sampling)),
    mapped(f"{R}.val_kwargs.n", "algorithm.val_kwargs.n", "held-out samples per prompt"),
    mapped(f"{R}.val_kwargs.do_sample", "algorithm.val_kwargs.do_sample", "held-out sampling or greedy"),
    mapped(f"{R}.val_kwargs.temperature", "algorithm.val_kwargs.temperature", "held-out temperature"),
    mapped(f"{R}.val_kwargs.top_p", "algorithm.val_kwargs.top_p", "held-out nucleus sampling"),
    mapped(f"{R}.val_kwargs.top_k", "algorithm.val_kwargs.top_k", "held-out top-k sampling"),
    mapped(f"{R}.name", "workload.engine", "vllm is vLLM, hf is torch", _from_run(lambda run: run.engine)),
    mapped(f"{R}.tensor_model_parallel_size", "roles.rollout.tensor_parallel_size", "GPUs of one engine",
           _from_run(lambda run: run.tensor_parallel)),
    mapped(f"{R}.dtype", "model.dtype", "the engines generate in the trainer's dtype",
           _from_run(lambda run: run.dtype)),
    ignored(f"{R}.response_length", "verl copies data.max_response_length here",
            lambda ctx: None if ctx.value == ctx.cfg["data.max_response_length"] else "differs from "
            "data.max_response_length: rlctl has one response cap"),
    ignored(f"{R}.prompt_length", "verl copies data.max_prompt_length here",
            lambda ctx: None if ctx.value == ctx.cfg["data.max_prompt_length"] else "differs from "
            "data.max_prompt_length: rlctl has one prompt cap"),
    ignored(f"{R}.max_model_len", "the engine's context (null: prompt + response caps)",
            lambda ctx: None if ctx.value is None or ctx.value >= ctx.cfg["data.max_prompt_length"] + ctx.cfg[
                "data.max_response_length"] else "shorter than the prompt and response caps: it cuts responses"),
    ignored(f"{R}.seed", "the engine's sampling seed: rlctl seeds sampling from job.seed"),
    ignored(f"{R}.full_determinism", "deterministic kernels: the same distribution"),
    ignored(f"{R}.mode", "async is verl 0.9's rollout mode"),
    ignored(f"{R}.nnodes", "verl fills it in; rlctl's engines are on the trainer's nodes"),
    ignored(f"{R}.n_gpus_per_node", "verl copies trainer.n_gpus_per_node here"),
    *(ignored(f"{R}.{name}", ENGINE) for name in (
        "gpu_memory_utilization", "enforce_eager", "cudagraph_capture_sizes", "free_cache_engine",
        "max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill", "enable_prefix_caching", "load_format",
        "layered_summon", "multi_stage_wake_up", "skip_tokenizer_init", "scheduling_policy", "data_parallel_size",
        "expert_parallel_size", "pipeline_model_parallel_size", "calculate_log_probs")),
    ignored(f"{R}.disable_log_stats", LOGGING),
    ignored(f"{R}.checkpoint_engine.**", "how weights reach the engines (buckets, backend): rlctl's weight sync "
            "carries the same weights"),
    ignored(f"{R}.agent.num_workers", "agent-loop processes: speed"),
    ignored(f"{R}.prometheus.**", LOGGING),
    ignored(f"{R}.trace.**", LOGGING),
    ignored(f"{R}.disaggregation.**", "prefill/decode disaggregation inside the engine: speed"),
    custom(f"{R}.engine_kwargs.**", IGNORED, "ignored for " + ", ".join(sorted(SAFE_ENGINE_KWARGS)) + "; any other "
           "engine argument is refused", _engine_kwargs),
    refused(f"{R}.multi_turn.**", "multi-turn rollouts with verl's tools: rlctl's multi-turn runs [env] classes"),
    refused(f"{R}.agent.**", "an agent loop other than single-turn generation"),
    refused(f"{R}.over_sample_rate", "aborts the slowest requests of a round, which changes which samples are "
            "trained"),
    refused(f"{R}.quantization", "quantized generation"),
    refused(f"{R}.quantization_config_file", "quantized generation"),
    refused(f"{R}.ignore_eos", "generates past end-of-sequence"),
    refused(f"{R}.logprobs_mode", "log-probs of other than the processed distribution"),
    mapped("actor_rollout_ref.hybrid_engine", "roles.rollout.placement", "true: the engines share the trainer's "
           "GPUs (colocated)", _from_run(lambda run: run.placement)),
    ignored("actor_rollout_ref.nccl_timeout", OPS),
    # the reward
    mapped("custom_reward_function.path", "reward.path", "the reward function's file"),
    mapped("custom_reward_function.name", "reward.name", "the reward function (null: compute_score)"),
    mapped("reward.custom_reward_function.path", "reward.path", "the reward function's file"),
    mapped("reward.custom_reward_function.name", "reward.name", "the reward function"),
    *(refused(f"{prefix}custom_reward_function.reward_kwargs.**", "keyword arguments to the reward function: rlctl "
              "passes verl's four") for prefix in ("", "reward.")),
    mapped("reward_model.reward_manager", None, "naive or dapo: rlctl scores as they do (the dapo manager's "
           "overlong shaping is [algorithm.overlong_buffer])", _from_run(lambda run: run.reward_manager)),
    mapped("reward.reward_manager.name", None, "naive or dapo: rlctl scores as they do",
           _from_run(lambda run: run.reward_manager)),
    mapped("reward.reward_manager.source", None, "register: verl's own managers",
           _from_run(lambda run: run.reward_manager)),
    refused("reward.reward_manager.module.**", "a reward manager of your own"),
    *(mapped(f"{spelling}.{name}", f"algorithm.overlong_buffer.{name}", f"DAPO's overlong shaping ({where})",
             _from_run(lambda run: run.overlong))
      for spelling, where in (("reward_model.overlong_buffer", "DAPO's recipe"),
                              ("custom_reward_function.overlong_buffer", "an older recipe's spelling"),
                              ("reward_model.reward_kwargs.overlong_buffer_cfg", "verl 0.9's spelling"),
                              ("reward.reward_kwargs.overlong_buffer_cfg", "verl 0.9's spelling, migrated"))
      for name in ("enable", "len", "penalty_factor")),
    ignored("**.overlong_buffer.log", "logs the overlong metrics"),
    ignored("**.overlong_buffer_cfg.log", "logs the overlong metrics"),
    mapped("reward_model.reward_kwargs.max_resp_len", "model.max_response_tokens", "must equal "
           "data.max_response_length: rlctl measures the buffer against the job's response cap",
           _from_run(lambda run: run.overlong)),
    mapped("reward.reward_kwargs.max_resp_len", "model.max_response_tokens", "must equal data.max_response_length",
           _from_run(lambda run: run.overlong)),
    ignored("reward_model.enable", "false: a rule-based reward", _unless(lambda v: not v, "a reward model: rlctl "
                                                                           "scores with reward functions only")),
    ignored("reward.reward_model.enable", "false: a rule-based reward",
            _unless(lambda v: not v, "a reward model: rlctl scores with reward functions only")),
    refused("reward_model.model.**", "a reward model: rlctl scores with reward functions only"),
    refused("reward.reward_model.model_path", "a reward model: rlctl scores with reward functions only"),
    refused("reward_model.reward_loop_*", "a reward loop of your own"),
    *(refused(f"{prefix}.reward_kwargs.**", "an argument of the reward manager rlctl does not carry")
      for prefix in ("reward_model", "reward")),
    ignored("reward_model.num_workers", "reward processes: speed"),
    ignored("reward.num_workers", "reward processes: speed"),
    ignored("reward_model.**", NO_MODEL_REWARD),
    ignored("reward.reward_model.**", NO_MODEL_REWARD),
    *(refused(f"{prefix}sandbox_fusion.url", "a remote code sandbox: rlctl's code reward runs its own sandbox")
      for prefix in ("", "reward.")),
    *(ignored(f"{prefix}sandbox_fusion.*", "read only with sandbox_fusion.url (refused)") for prefix in ("", "reward.")),
    # the trainer
    mapped("trainer.total_training_steps", "job.steps", "the steps", _from_run(lambda run: run.steps)),
    custom("trainer.total_epochs", MAPPED, "epochs x (rows of data.train_files // train_batch_size), read from the "
           "parquet files (verl drops an epoch's last partial batch); refused where neither can be known",
           _total_epochs, "job.steps"),
    mapped("trainer.save_freq", "job.checkpoint_every", "the checkpoint interval (-1: the job's steps)"),
    mapped("trainer.test_freq", "data.eval_every", "the evaluation interval (-1: 0, never)"),
    mapped("trainer.nnodes", "roles.trainer.nodes, roles.rollout.nodes", "the trainer's nodes, which the colocated "
           "engines share; rlctl adds [spares] nodes = 1, a spare node for fault tolerance",
           _from_run(lambda run: run.nodes)),
    mapped("trainer.n_gpus_per_node", "roles.trainer.gpus_per_node, roles.rollout.gpus_per_node", "GPUs a node "
           "(and [cluster.local] gpus_per_node on the local backend)", _from_run(lambda run: run.gpus_per_node)),
    mapped("trainer.experiment_name", "job.name", "the job's name (made to fit rlctl's name pattern)"),
    mapped("trainer.device", "workload.device", "cuda", _from_run(lambda run: run.device)),
    custom("trainer.val_before_train", IGNORED, "rlctl evaluates the initial weights whenever it evaluates; an "
           "evaluation changes nothing that is learned", _val_before_train),
    refused("trainer.val_only", "evaluates without training"),
    ignored("trainer.balance_batch", "balances sequence lengths over the data-parallel ranks: rlctl's update does "
            "not depend on which rank trains which sample"),
    ignored("trainer.critic_warmup", NO_CRITIC),
    refused("trainer.resume_from_path", "starts from a verl checkpoint: rlctl starts from [model] path"),
    *(ignored(f"trainer.{name}", CHECKPOINT) for name in (
        "default_local_dir", "default_hdfs_dir", "del_local_ckpt_after_load", "max_actor_ckpt_to_keep",
        "max_critic_ckpt_to_keep", "resume_mode", "esi_redundant_time")),
    *(ignored(f"trainer.{name}", LOGGING) for name in (
        "logger", "project_name", "log_val_generations", "rollout_data_dir", "validation_data_dir")),
    ignored("trainer.ray_wait_register_center_timeout", OPS),
    refused("trainer.v1.trainer_mode", "asynchronous (off-policy) training: rlctl trains each step on samples of "
            "the step's weights"),
    ignored("trainer.v1.sync.**", "settings of verl's synchronous trainer: none change the update"),
    ignored("trainer.v1.colocate_async.**", "read only by the asynchronous trainers (refused)"),
    ignored("trainer.v1.separate_async.**", "read only by the asynchronous trainers (refused)"),
    refused("critic.enable", "a critic (value model): rlctl has no critic role yet"),
    ignored("critic.**", NO_CRITIC),
    refused("distillation.enabled", "distillation from a teacher model: rlctl has no equivalent"),
    ignored("distillation.**", "read only with distillation.enabled (refused)"),
    ignored("ray_kwargs.**", OPS),
    ignored("transfer_queue.**", OPS),
    ignored("global_profiler.**", PROFILE),
    ignored("hydra.**", "Hydra's own output folders and logging"),
)


def rule_for(key: str) -> Rule | None:
    return next((rule for rule in RULES if rule.matches(key)), None)


def judge(ctx: KeyContext) -> Verdict:
    """The verdict on one verl key (its rule's, or the fallback's)."""
    rule = rule_for(ctx.key)
    try:
        return rule.verdict(ctx) if rule is not None else fallback(ctx)
    except Refusal as exc:  # a rule's reading of the run met a value it cannot take
        return Verdict(REFUSED, exc.reason if exc.key == ctx.key else f"{exc.key}: {exc.reason}")


def default_refusals(run: Run, overridden: set[str]) -> list[Refusal]:
    """Refusals of verl defaults no override touched (a rule that checks its key's value)."""
    found = []
    for rule in RULES:
        if not rule.concrete or rule.refuse is None or rule.pattern in overridden or rule.pattern not in run.cfg.values:
            continue
        why = rule.refusal(KeyContext(rule.pattern, run.cfg[rule.pattern], run))
        if why:
            found.append(Refusal(rule.pattern, why))
    return found


# -- the job file --------------------------------------------------------------------------------

@dataclass(frozen=True)
class JobValue:
    """One key of the job file: the verl keys that decide it (the file's comment) and its value."""

    job_key: str
    verl: str
    value: Callable[[Run], Any]
    when: Callable[[Run], bool] = lambda run: True
    note: str = ""

    @cached_property
    def comment(self) -> str:
        parts = [f"verl: {self.verl}"] if self.verl else []
        return "; ".join([*parts, *([self.note] if self.note else [])])


def _clip(run: Run, which: str) -> float:
    value = run.cfg[f"{A}.clip_ratio_{which}"]
    return run.read_float(f"{A}.clip_ratio") if value is None else run.read_float(f"{A}.clip_ratio_{which}")


def _ssh_hosts(run: Run) -> list[str]:
    needed = run.nodes + 2  # the trainer's nodes (the engines share them), one reward node, one spare
    run.notes.append(f"[cluster.ssh] hosts is empty: fill in {needed} \"name=address\" entries ({run.nodes} "
                     "trainer nodes, 1 reward node, 1 spare) before `rlctl launch`")
    return []


def _filter_metric(run: Run) -> str:
    metric = run.cfg["algorithm.filter_groups.metric"]
    return "reward" if metric is None else run.read_str("algorithm.filter_groups.metric")


VK = f"{R}.val_kwargs"
JOB_VALUES: tuple[JobValue, ...] = (
    JobValue("job.name", "trainer.experiment_name", lambda run: run.job_name),
    JobValue("job.steps", "trainer.total_training_steps or total_epochs x (rows // data.train_batch_size)",
             lambda run: run.steps),
    JobValue("job.seed", "data.seed (data.shuffle)", lambda run: run.seed),
    JobValue("job.checkpoint_every", "trainer.save_freq", lambda run: run.checkpoint_every),
    JobValue("cluster.backend", "", lambda run: run.options.backend, note="rlctl convert --backend"),
    JobValue("cluster.local.gpus_per_node", "trainer.n_gpus_per_node", lambda run: max(1, run.gpus_per_node),
             lambda run: run.options.backend == "local", "simulated GPUs of a virtual node"),
    JobValue("cluster.slurm.partition", "", lambda run: "", lambda run: run.options.backend == "slurm",
             "set the partition (empty: the cluster's default)"),
    JobValue("cluster.slurm.account", "", lambda run: "", lambda run: run.options.backend == "slurm",
             "set the account to charge (empty: none)"),
    JobValue("cluster.slurm.max_nodes", "", lambda run: 0, lambda run: run.options.backend == "slurm",
             "the partition's nodes (0: placements are not checked)"),
    JobValue("cluster.ssh.hosts", "", lambda run: _ssh_hosts(run), lambda run: run.options.backend == "ssh",
             "fill in: one \"name=address\" per node (roles and spares)"),
    JobValue("roles.trainer.nodes", "trainer.nnodes", lambda run: run.nodes),
    JobValue("roles.trainer.gpus_per_node", "trainer.n_gpus_per_node", lambda run: run.gpus_per_node),
    JobValue("roles.rollout.nodes", "trainer.nnodes", lambda run: run.nodes, note="the trainer's (colocated)"),
    JobValue("roles.rollout.gpus_per_node", "trainer.n_gpus_per_node", lambda run: run.gpus_per_node),
    JobValue("roles.rollout.tensor_parallel_size", "actor_rollout_ref.rollout.tensor_model_parallel_size",
             lambda run: run.tensor_parallel),
    JobValue("roles.rollout.placement", "actor_rollout_ref.hybrid_engine", lambda run: run.placement,
             note="the engines share the trainer's GPUs"),
    JobValue("roles.reward.nodes", "", lambda run: 1, note="rule-based rewards run on one CPU node"),
    JobValue("roles.reward.gpus_per_node", "", lambda run: 0),
    JobValue("spares.nodes", "", lambda run: 1, note="rlctl adds a spare node for fault tolerance (verl has none)"),
    JobValue("model.path", "actor_rollout_ref.model.path", lambda run: run.model_path),
    JobValue("model.dtype", "actor_rollout_ref.actor.fsdp_config.dtype", lambda run: run.dtype),
    JobValue("model.trust_remote_code", "actor_rollout_ref.model.trust_remote_code",
             lambda run: run.read_bool(f"{M}.trust_remote_code")),
    JobValue("model.gradient_checkpointing", "actor_rollout_ref.model.enable_gradient_checkpointing",
             lambda run: run.read_bool(f"{M}.enable_gradient_checkpointing")),
    JobValue("model.max_prompt_tokens", "data.max_prompt_length", lambda run: run.read_int("data.max_prompt_length", 1)),
    JobValue("model.max_response_tokens", "data.max_response_length",
             lambda run: run.read_int("data.max_response_length", 1)),
    JobValue("data.train_files", "data.train_files", lambda run: run.train_files),
    JobValue("data.eval_files", "data.val_files", lambda run: run.eval_files),
    JobValue("data.eval_every", "trainer.test_freq", lambda run: run.eval_every),
    JobValue("data.eval_max_prompts", "data.val_max_samples", lambda run: run.eval_max_prompts),
    JobValue("data.prompt_key", "data.prompt_key", lambda run: run.read_str("data.prompt_key")),
    JobValue("data.ground_truth_key", "", lambda run: "reward_model.ground_truth", note="verl's fixed column"),
    JobValue("data.data_source_key", "data.reward_fn_key", lambda run: run.read_str("data.reward_fn_key")),
    JobValue("data.extra_info_key", "", lambda run: "extra_info", note="verl's fixed column"),
    JobValue("data.filter_overlong_prompts", "data.filter_overlong_prompts",
             lambda run: run.read_bool("data.filter_overlong_prompts")),
    JobValue("data.truncation", "data.truncation",
             lambda run: run.choice("data.truncation", ("error", "left", "right", "middle"))),
    JobValue("reward.function", "", lambda run: "auto", lambda run: run.reward_function is None,
             "verl's default_compute_score: chosen by data_source"),
    JobValue("reward.path", "custom_reward_function.path", lambda run: run.reward_function and run.reward_function[0],
             lambda run: run.reward_function is not None),
    JobValue("reward.name", "custom_reward_function.name", lambda run: run.reward_function and run.reward_function[1],
             lambda run: run.reward_function is not None),
    JobValue("rollout.batch_prompts", "data.train_batch_size", lambda run: run.batch_prompts),
    JobValue("rollout.group_size", "actor_rollout_ref.rollout.n", lambda run: run.read_int(f"{R}.n", 1)),
    JobValue("rollout.max_new_tokens", "data.max_response_length",
             lambda run: run.read_int("data.max_response_length", 1)),
    JobValue("rollout.dataset_size", "", lambda run: run.batch_prompts, lambda run: run.batch_prompts > 512,
             "at least a batch (the generated task's size; the train files decide the prompts)"),
    JobValue("rollout.tail_batching.enabled", "", lambda run: False,
             note="verl trains synchronous batches; tail batching changes which prompts form a batch"),
    JobValue("workload.learning_rate", "actor_rollout_ref.actor.optim.lr", lambda run: run.read_float(f"{OPTIM}.lr")),
    JobValue("workload.lr_warmup_steps", "optim.lr_warmup_steps, or int(optim.lr_warmup_steps_ratio x steps)",
             lambda run: run.warmup_steps),
    JobValue("workload.lr_scheduler", "optim.lr_scheduler_type (warmup_style)", lambda run: run.lr_scheduler),
    JobValue("workload.min_lr_ratio", "optim.min_lr_ratio", lambda run: run.min_lr_ratio),
    JobValue("workload.num_cycles", "optim.num_cycles", lambda run: run.read_float(f"{OPTIM}.num_cycles")),
    JobValue("workload.weight_decay", "optim.weight_decay", lambda run: run.read_float(f"{OPTIM}.weight_decay")),
    JobValue("workload.adam_beta1", "optim.betas[0]", lambda run: run.betas[0]),
    JobValue("workload.adam_beta2", "optim.betas[1]", lambda run: run.betas[1]),
    JobValue("workload.grad_clip", "optim.clip_grad (actor.grad_clip)", lambda run: run.grad_clip),
    JobValue("workload.engine", "actor_rollout_ref.rollout.name", lambda run: run.engine),
    JobValue("workload.sharding", "actor_rollout_ref.actor.strategy", lambda run: run.sharding),
    JobValue("workload.device", "trainer.device", lambda run: run.device),
    JobValue("algorithm.adv_estimator", "algorithm.adv_estimator", lambda run: run.adv_estimator),
    JobValue("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std_in_grpo",
             lambda run: run.read_bool("algorithm.norm_adv_by_std_in_grpo")),
    JobValue("algorithm.gamma", "algorithm.gamma", lambda run: run.read_float("algorithm.gamma")),
    JobValue("algorithm.policy_loss", "actor.policy_loss.loss_mode", lambda run: run.policy_loss),
    JobValue("algorithm.clip_ratio", "actor.clip_ratio", lambda run: run.read_float(f"{A}.clip_ratio")),
    JobValue("algorithm.clip_ratio_low", "actor.clip_ratio_low", lambda run: _clip(run, "low")),
    JobValue("algorithm.clip_ratio_high", "actor.clip_ratio_high", lambda run: _clip(run, "high")),
    JobValue("algorithm.clip_ratio_c", "actor.clip_ratio_c", lambda run: run.read_float(f"{A}.clip_ratio_c")),
    JobValue("algorithm.loss_agg_mode", "actor.loss_agg_mode (use_token_level_loss)", lambda run: run.loss_agg_mode),
    JobValue("algorithm.loss_scale_factor", "actor.loss_scale_factor", lambda run: run.loss_scale_factor,
             note="0: the response cap, as verl's null"),
    JobValue("algorithm.entropy_coeff", "actor.entropy_coeff", lambda run: run.read_float(f"{A}.entropy_coeff")),
    JobValue("algorithm.use_kl_loss", "actor.use_kl_loss", lambda run: run.read_bool(f"{A}.use_kl_loss")),
    JobValue("algorithm.kl_loss_coef", "actor.kl_loss_coef", lambda run: run.read_float(f"{A}.kl_loss_coef")),
    JobValue("algorithm.kl_loss_type", "actor.kl_loss_type", lambda run: run.kl_type(f"{A}.kl_loss_type")),
    JobValue("algorithm.use_kl_in_reward", "algorithm.use_kl_in_reward",
             lambda run: run.read_bool("algorithm.use_kl_in_reward")),
    JobValue("algorithm.kl_penalty", "algorithm.kl_penalty", lambda run: run.kl_type("algorithm.kl_penalty")),
    JobValue("algorithm.kl_coef", "algorithm.kl_ctrl.kl_coef", lambda run: run.kl_coef),
    JobValue("algorithm.ppo_mini_batch_size", "actor.ppo_mini_batch_size", lambda run: run.mini_batch),
    JobValue("algorithm.ppo_epochs", "actor.ppo_epochs", lambda run: run.read_int(f"{A}.ppo_epochs", 1)),
    JobValue("algorithm.shuffle", "actor.shuffle", lambda run: run.read_bool(f"{A}.shuffle")),
    JobValue("algorithm.data_loader_seed", "actor.data_loader_seed", lambda run: run.read_int(f"{A}.data_loader_seed", 0)),
    JobValue("algorithm.temperature", "rollout.temperature", lambda run: run.rollout_sampling[0]),
    JobValue("algorithm.top_p", "rollout.top_p", lambda run: run.rollout_sampling[1]),
    JobValue("algorithm.top_k", "rollout.top_k", lambda run: run.rollout_sampling[2]),
    JobValue("algorithm.val_kwargs.do_sample", "rollout.val_kwargs.do_sample",
             lambda run: run.read_bool(f"{VK}.do_sample")),
    JobValue("algorithm.val_kwargs.n", "rollout.val_kwargs.n", lambda run: run.read_int(f"{VK}.n", 1)),
    JobValue("algorithm.val_kwargs.temperature", "rollout.val_kwargs.temperature",
             lambda run: run.read_float(f"{VK}.temperature")),
    JobValue("algorithm.val_kwargs.top_p", "rollout.val_kwargs.top_p", lambda run: run.read_float(f"{VK}.top_p")),
    JobValue("algorithm.val_kwargs.top_k", "rollout.val_kwargs.top_k", lambda run: run.read_int(f"{VK}.top_k")),
    JobValue("algorithm.filter_groups.enable", "algorithm.filter_groups.enable",
             lambda run: run.read_bool("algorithm.filter_groups.enable")),
    JobValue("algorithm.filter_groups.metric", "algorithm.filter_groups.metric", _filter_metric),
    JobValue("algorithm.filter_groups.max_num_gen_batches", "algorithm.filter_groups.max_num_gen_batches",
             lambda run: run.read_int("algorithm.filter_groups.max_num_gen_batches", 0)),
    JobValue("algorithm.overlong_buffer.enable", "reward_model.overlong_buffer.enable (or its other spellings)",
             lambda run: run.overlong[0]),
    JobValue("algorithm.overlong_buffer.len", "reward_model.overlong_buffer.len", lambda run: run.overlong[1]),
    JobValue("algorithm.overlong_buffer.penalty_factor", "reward_model.overlong_buffer.penalty_factor",
             lambda run: run.overlong[2]),
)
JOB_KEYS = frozenset(value.job_key for value in JOB_VALUES)


def rules_markdown() -> str:
    """The rule table as docs/algorithms.md shows it."""
    lines = ["| verl key | verdict | rlctl key | why |", "|---|---|---|---|"]
    for rule in RULES:
        job_key = f"`{rule.job_key}`" if rule.job_key else ""
        verdict = rule.status + (" (some values refused)" if rule.refuse is not None and rule.status != REFUSED else "")
        lines.append(f"| `{rule.pattern}` | {verdict} | {job_key} | {rule.reason.replace('|', '/')} |")
    lines.append("| any other key | ignored at verl's default, else refused | | |")
    return "\n".join(lines) + "\n"
