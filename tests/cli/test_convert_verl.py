"""`rlctl convert verl`: verl's own example scripts (tests/cli/verl_scripts, as the shell hands their
overrides to main_ppo) become job files `rlctl launch --dry-run` accepts, every override judged
mapped, ignored or refused, and a refusal (or a malformed override) writes nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from rlctl.convert import verl_defaults
from rlctl.convert.hydra import OverrideError, parse_override, parse_value
from rlctl.convert.verl import ConvertOptions, convert_verl
from rlctl.convert.verl_config import apply_overrides
from rlctl.convert.verl_rules import JOB_KEYS, JOB_VALUES, RULES, rules_markdown
from rlctl.convert.verl_run import FactError
from rlctl.core.schema import Field
from rlctl.core.spec import JOB_SCHEMA
from tests.hf_models import gsm8k_data, tiny_model

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "verl_scripts"
WHEEL = Path("/tmp/verlwheel/verl-0.9.1-py3-none-any.whl")
GRPO = "run_qwen2-7b_math.args"
DAPO = "run_dapo_qwen2.5_32b.args"


def fixture_args(name: str, paths: dict[str, Path]) -> list[str]:
    """The fixture's overrides (its first line is the `python3 -m ...` command), @NAME@ paths filled in."""
    lines = [line for line in (SCRIPTS / name).read_text().splitlines() if line and not line.startswith("#")]
    assert lines[0].startswith("python3 -m "), lines[0]
    args = []
    for line in lines[1:]:
        for marker, path in paths.items():
            line = line.replace(f"@{marker}@", str(path))
        assert "@" not in line, line
        args.append(line)
    return args


def rlctl(*args: str, home: Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RLCTL_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "rlctl.cli", *args], env=env, capture_output=True, text=True,
                          timeout=180, check=False, cwd=cwd)


def convert_json(out: Path, args: list[str], *options: str, home: Path) -> tuple[int, dict[str, Any], str]:
    result = rlctl("convert", "verl", "--out", str(out), "--json", *options, *args, home=home)
    return result.returncode, json.loads(result.stdout) if result.stdout.strip() else {}, result.stderr


def statuses(report: dict[str, Any]) -> dict[str, str]:
    return {entry["verl"]: entry["status"] for entry in report["keys"]}


@pytest.fixture(scope="module")
def model() -> Path:
    path = tiny_model()
    config = json.loads((path / "config.json").read_text())
    # what DAPO's override_config lines need to change nothing
    assert config["attention_dropout"] == 0.0 and "embd_pdrop" not in config and "resid_pdrop" not in config
    return path


@pytest.fixture(scope="module")
def grpo_paths(model: Path) -> dict[str, Path]:
    gsm8k, math = gsm8k_data(train_rows=600), gsm8k_data(train_rows=300, test_rows=32)
    return {"GSM8K_TRAIN": gsm8k / "train.parquet", "GSM8K_TEST": gsm8k / "test.parquet",
            "MATH_TRAIN": math / "train.parquet", "MATH_TEST": math / "test.parquet", "MODEL": model}


@pytest.fixture(scope="module")
def dapo_paths(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    data = gsm8k_data(train_rows=1100, test_rows=64)  # more rows than one 512-prompt batch: 2 full batches
    return {"TRAIN_FILE": data / "train.parquet", "TEST_FILE": data / "test.parquet", "MODEL_PATH": model,
            "CKPTS_DIR": tmp_path_factory.mktemp("ckpts")}


# -- verl's example scripts -----------------------------------------------------------------------

GRPO_IGNORED = {
    "actor_rollout_ref.model.use_remove_padding", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.fsdp_config.param_offload", "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "actor_rollout_ref.rollout.gpu_memory_utilization",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "actor_rollout_ref.ref.fsdp_config.param_offload",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes", "trainer.critic_warmup",
    "trainer.logger", "trainer.project_name"}


@pytest.mark.parametrize("backend", ["local", "slurm"])
def test_verls_grpo_example_converts_with_nothing_refused_and_dry_runs(
        backend: str, grpo_paths: dict[str, Path], tmp_path: Path) -> None:
    args = fixture_args(GRPO, grpo_paths)
    out = tmp_path / "job.toml"
    code, report, stderr = convert_json(out, args, "--backend", backend, home=tmp_path / "home")
    assert code == 0, stderr
    assert report["job_file"] == str(out)
    assert [entry["verl"] for entry in report["keys"]] == [a.split("=", 1)[0] for a in args]
    found = statuses(report)
    assert {k for k, s in found.items() if s == "ignored"} == GRPO_IGNORED
    assert {k for k, s in found.items() if s == "refused"} == set()
    job = tomllib.loads(out.read_text())
    assert job["job"] == {"name": "qwen2_7b_function_rm", "steps": 3, "seed": 0, "checkpoint_every": 20}
    assert job["algorithm"]["use_kl_loss"] is True and job["algorithm"]["kl_loss_type"] == "low_var_kl"
    assert job["algorithm"]["ppo_mini_batch_size"] == 128 and job["rollout"]["group_size"] == 5
    assert job["roles"]["rollout"] == {"nodes": 1, "gpus_per_node": 4, "tensor_parallel_size": 2,
                                       "placement": "colocated"}
    assert job["data"]["train_files"] == [str(grpo_paths["GSM8K_TRAIN"]), str(grpo_paths["MATH_TRAIN"])]
    assert job["data"]["eval_every"] == 5 and job["data"]["eval_max_prompts"] == 0
    assert job["data"]["filter_overlong_prompts"] is True and job["workload"]["engine"] == "vllm"
    assert job["rollout"]["tail_batching"] == {"enabled": False}
    assert job["spares"] == {"nodes": 1}
    assert "converted from verl" in out.read_text().splitlines()[0].lower()
    dry = rlctl("launch", "--dry-run", str(out), home=tmp_path / "home")
    assert dry.returncode == 0, dry.stderr
    assert "batch 512 prompts x 5 samples, tail batching off" in dry.stdout


@pytest.mark.parametrize("backend", ["local", "slurm"])
def test_dapos_example_converts_with_nothing_refused_and_dry_runs(
        backend: str, dapo_paths: dict[str, Path], tmp_path: Path) -> None:
    args = fixture_args(DAPO, dapo_paths)
    out = tmp_path / "job.toml"
    code, report, stderr = convert_json(out, args, "--backend", backend, home=tmp_path / "home")
    assert code == 0, stderr
    found = statuses(report)
    assert len(report["keys"]) == len(args) and "refused" not in found.values()
    for key in ("data.gen_batch_size", "actor_rollout_ref.model.override_config.attention_dropout",
                "actor_rollout_ref.model.override_config.embd_pdrop", "trainer.val_before_train",
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size", "actor_rollout_ref.actor.use_dynamic_bsz",
                "trainer.default_local_dir"):
        assert found[key] == "ignored", key
    for key in ("actor_rollout_ref.actor.use_token_level_loss", "custom_reward_function.overlong_buffer.len",
                "algorithm.filter_groups.metric", "actor_rollout_ref.actor.grad_clip", "reward_model.reward_manager",
                "trainer.total_epochs"):
        assert found[key] == "mapped", key
    by_key = {entry["verl"]: entry for entry in report["keys"]}
    assert by_key["actor_rollout_ref.model.override_config.attention_dropout"]["value"] == 0.0
    assert "already has attention_dropout = 0.0" in by_key["actor_rollout_ref.model.override_config.attention_dropout"][
        "reason"]
    assert by_key["trainer.logger"]["value"] == ["console", "wandb"]
    job = tomllib.loads(out.read_text())
    assert job["job"]["name"] == "DAPO-Qwen2.5-32B"
    assert job["job"]["steps"] == 2  # 1 epoch x (1100 rows // 512), verl dropping the last partial batch
    assert job["algorithm"]["filter_groups"] == {"enable": True, "metric": "acc", "max_num_gen_batches": 10}
    assert job["algorithm"]["overlong_buffer"] == {"enable": True, "len": 4096, "penalty_factor": 1.0}
    assert job["algorithm"]["clip_ratio_high"] == 0.28 and job["algorithm"]["loss_agg_mode"] == "token-mean"
    assert job["workload"]["lr_warmup_steps"] == 10 and job["workload"]["weight_decay"] == 0.1
    assert job["model"]["max_response_tokens"] == 20480 and job["data"]["truncation"] == "left"
    assert job["roles"]["trainer"] == {"nodes": 16, "gpus_per_node": 8}
    assert job["roles"]["rollout"]["tensor_parallel_size"] == 4
    if backend == "local":
        assert job["cluster"]["local"] == {"gpus_per_node": 8}
    else:
        assert job["cluster"]["slurm"]["max_nodes"] == 0
        assert "partition" in out.read_text().split("[cluster.slurm]")[1].split("[")[0]
    dry = rlctl("launch", "--dry-run", str(out), home=tmp_path / "home")
    assert dry.returncode == 0, dry.stderr
    assert "trainer x16" in dry.stdout and "rollout x16 colocated" in dry.stdout


# -- verdicts -------------------------------------------------------------------------------------

def minimal(paths: dict[str, Path], *extra: str) -> list[str]:
    """A short run of main_ppo (the keys ``extra`` sets are left out of the rest)."""
    keys = {e.lstrip("+~").split("=", 1)[0] for e in extra}
    return [a for a in _minimal(paths) if a.split("=", 1)[0] not in keys] + list(extra)


def _minimal(paths: dict[str, Path]) -> list[str]:
    return ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=vllm",
            f"data.train_files={paths['TRAIN_FILE']}", f"data.val_files={paths['TEST_FILE']}",
            f"actor_rollout_ref.model.path={paths['MODEL_PATH']}", "data.train_batch_size=64",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16", "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=4"]


def test_json_has_one_entry_per_override_in_order_with_its_verdict(dapo_paths: dict[str, Path], tmp_path: Path) -> None:
    args = minimal(dapo_paths, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.balance_batch=False",
                   "trainer.val_before_train=False", "~trainer.logger", "+actor_rollout_ref.model.override_config."
                   "embd_pdrop=0.", "actor_rollout_ref.actor.optim.lr=2e-6", "actor_rollout_ref.rollout.n=8")
    out = tmp_path / "job.toml"
    code, report, stderr = convert_json(out, args, home=tmp_path / "home")
    assert code == 0, stderr
    assert set(report) == {"job_file", "keys"} and report["job_file"] == str(out)
    assert [entry["verl"] for entry in report["keys"]] == [a.lstrip("+~").split("=", 1)[0] for a in args]
    for entry in report["keys"]:
        assert set(entry) == {"verl", "value", "status", "job_key", "reason"} and entry["reason"]
    by_key = {entry["verl"]: entry for entry in report["keys"]}
    assert by_key["actor_rollout_ref.actor.optim.lr"] == {
        "verl": "actor_rollout_ref.actor.optim.lr", "value": 2e-6, "status": "mapped",
        "job_key": "workload.learning_rate", "reason": by_key["actor_rollout_ref.actor.optim.lr"]["reason"]}
    assert by_key["actor_rollout_ref.rollout.n"]["job_key"] == "rollout.group_size"
    assert by_key["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"]["status"] == "ignored"
    assert "micro-batch" in by_key["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"]["reason"]
    assert by_key["trainer.balance_batch"]["status"] == "ignored"
    assert "which rank trains which sample" in by_key["trainer.balance_batch"]["reason"]
    assert by_key["trainer.val_before_train"]["status"] == "ignored"
    assert "evaluates the initial weights" in by_key["trainer.val_before_train"]["reason"]
    assert by_key["trainer.logger"] == {"verl": "trainer.logger", "value": None, "status": "ignored", "job_key": None,
                                        "reason": by_key["trainer.logger"]["reason"]}
    assert by_key["actor_rollout_ref.model.override_config.embd_pdrop"]["status"] == "ignored"
    job = tomllib.loads(out.read_text())
    assert job["workload"]["learning_rate"] == 2e-6 and job["rollout"]["group_size"] == 8


@pytest.mark.parametrize("override, key, why", [
    ("algorithm.adv_estimator=gae", "algorithm.adv_estimator", "critic"),
    ("algorithm.adv_estimator=remax", "algorithm.adv_estimator", "baseline"),
    ("algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.type", "adaptive"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", "actor_rollout_ref.actor.policy_loss.loss_mode", "gspo"),
    ("actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.actor.strategy", "Megatron"),
    ("actor_rollout_ref.model.lora_rank=32", "actor_rollout_ref.model.lora_rank", "LoRA"),
    ("reward_model.enable=True", "reward_model.enable", "reward model"),
    ("trainer.device=npu", "trainer.device", "cuda"),
    ("actor_rollout_ref.rollout.multi_turn.enable=True", "actor_rollout_ref.rollout.multi_turn.enable", "multi-turn"),
    ("+actor_rollout_ref.model.override_config.attention_dropout=0.1",
     "actor_rollout_ref.model.override_config.attention_dropout", "changes the model"),
    ("~actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.actor.optim.lr", "decides what is learned"),
])
def test_a_refused_key_exits_2_names_the_key_and_writes_nothing(
        override: str, key: str, why: str, dapo_paths: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "job.toml"
    code, report, stderr = convert_json(out, minimal(dapo_paths, override), home=tmp_path / "home")
    assert code == 2 and not out.exists() and not list(tmp_path.glob(".job.toml*"))
    assert report["job_file"] is None
    refused = [entry for entry in report["keys"] if entry["status"] == "refused"]
    assert [entry["verl"] for entry in refused] == [key] and why in refused[0]["reason"]
    assert f"refused: {key}: " in stderr and "nothing written" in stderr


def test_the_human_summary_lists_each_key_and_a_refusal_writes_nothing(dapo_paths: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    out = tmp_path / "job.toml"
    result = rlctl("convert", "verl", "--out", str(out), *minimal(dapo_paths, "algorithm.adv_estimator=gae"),
                   home=tmp_path / "home")
    assert result.returncode == 2 and not out.exists()
    assert "algorithm.adv_estimator" in result.stdout and "refused" in result.stdout
    assert "refused: algorithm.adv_estimator: gae: needs a critic" in result.stderr


def test_verls_default_gae_is_refused_though_no_override_names_it(dapo_paths: dict[str, Path], tmp_path: Path) -> None:
    args = [a for a in minimal(dapo_paths) if not a.startswith("algorithm.adv_estimator")]
    code, report, _ = convert_json(tmp_path / "job.toml", args, home=tmp_path / "home")
    assert code == 2 and not (tmp_path / "job.toml").exists()
    assert len(report["keys"]) == len(args) + 1  # the overrides, then the refused default
    assert report["keys"][-1]["verl"] == "algorithm.adv_estimator" and report["keys"][-1]["value"] == "gae"
    assert report["keys"][-1]["status"] == "refused" and "verl's default" in report["keys"][-1]["reason"]


@pytest.mark.parametrize("argument, message", [
    ("foo", "'foo': expected key=value"),
    ("trainer.not_a_key=3", "not a key of verl 0.9's main_ppo config"),
    ("~trainer.not_a_key", "not a key of verl 0.9's main_ppo config"),
    ("~trainer.balance_batch=false", "only when the key holds that value"),
    ("trainer.logger=console,wandb", "a Hydra sweep"),
    ("data.train_files=['a.parquet'", "expected ',' or ']'"),
])
def test_a_malformed_override_or_an_unknown_key_exits_2_naming_the_argument(
        argument: str, message: str, dapo_paths: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "job.toml"
    result = rlctl("convert", "verl", "--out", str(out), *minimal(dapo_paths, argument), home=tmp_path / "home")
    assert result.returncode == 2 and not out.exists()
    assert message in result.stderr and argument.split("=")[0] in result.stderr


def test_a_value_rlctls_schema_refuses_is_a_refusal_of_its_verl_key() -> None:
    args = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=vllm", "trainer.total_training_steps=2",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.rollout.val_kwargs.n=100", "trainer.experiment_name=my run/2024 #1"]
    result = convert_verl(args, ConvertOptions(), _NoFiles())
    assert not result.ok and [d.verl for d in result.refused] == ["actor_rollout_ref.rollout.val_kwargs.n"]
    assert "algorithm.val_kwargs.n" in result.refused[0].reason
    named = convert_verl(args[:-2] + args[-1:], ConvertOptions(), _NoFiles())
    assert named.ok and named.job_text is not None
    assert tomllib.loads(named.job_text)["job"]["name"] == "my-run-2024-1"


def test_a_key_set_twice_takes_the_last_value(dapo_paths: dict[str, Path], tmp_path: Path) -> None:
    args = [*minimal(dapo_paths), "algorithm.adv_estimator=rloo"]
    code, report, stderr = convert_json(tmp_path / "job.toml", args, home=tmp_path / "home")
    assert code == 0, stderr
    first, last = (e for e in report["keys"] if e["verl"] == "algorithm.adv_estimator")
    assert first["status"] == "ignored" and "later override" in first["reason"] and last["status"] == "mapped"
    assert tomllib.loads((tmp_path / "job.toml").read_text())["algorithm"]["adv_estimator"] == "rloo"


def test_an_added_key_is_accepted_with_plus(dapo_paths: dict[str, Path], tmp_path: Path) -> None:
    code, report, stderr = convert_json(tmp_path / "job.toml", minimal(dapo_paths, "+ray_kwargs.ray_init.address=auto"),
                                        home=tmp_path / "home")
    assert code == 0, stderr
    assert statuses(report)["ray_kwargs.ray_init.address"] == "ignored"


def test_verls_defaults_that_differ_from_rlctls_are_written_explicitly(dapo_paths: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    out = tmp_path / "job.toml"
    code, _, stderr = convert_json(out, minimal(dapo_paths), home=tmp_path / "home")
    assert code == 0, stderr
    job = tomllib.loads(out.read_text())
    workload = job["workload"]
    # rlctl's own defaults: betas (0.9, 0.99), no weight decay, lr 3e-4, 5 warmup steps of warmup-constant
    assert (workload["adam_beta1"], workload["adam_beta2"]) == (0.9, 0.999)
    assert workload["weight_decay"] == 0.01 and workload["learning_rate"] == 1e-6
    assert workload["lr_warmup_steps"] == 0 and workload["lr_scheduler"] == "constant"
    assert job["algorithm"]["clip_ratio_c"] == 3.0 and job["algorithm"]["val_kwargs"]["do_sample"] is False
    assert job["data"]["filter_overlong_prompts"] is False and job["data"]["truncation"] == "error"
    assert job["model"]["gradient_checkpointing"] is True and job["model"]["max_prompt_tokens"] == 512
    assert "adam_beta2 = 0.999  # verl: optim.betas[1]" in out.read_text()


def test_the_steps_come_from_the_parquet_rows_when_only_epochs_are_given(dapo_paths: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    args = [a for a in minimal(dapo_paths) if not a.startswith("trainer.total_training_steps")]
    out = tmp_path / "job.toml"
    code, report, stderr = convert_json(out, [*args, "trainer.total_epochs=3"], home=tmp_path / "home")
    assert code == 0, stderr
    assert tomllib.loads(out.read_text())["job"]["steps"] == 3 * (1100 // 64)
    assert "3 epochs x 17 full batches of 64 = 51 steps" in statuses_reason(report, "trainer.total_epochs")
    warm = convert_json(tmp_path / "warm.toml", [*args, "trainer.total_epochs=3",
                        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1"], home=tmp_path / "home")
    assert warm[0] == 0 and tomllib.loads((tmp_path / "warm.toml").read_text())["workload"]["lr_warmup_steps"] == 5
    missing = [a.replace(str(dapo_paths["TRAIN_FILE"]), str(tmp_path / "absent.parquet")) for a in args]
    code, report, _ = convert_json(tmp_path / "no.toml", [*missing, "trainer.total_epochs=3"], home=tmp_path / "home")
    assert code == 2 and not (tmp_path / "no.toml").exists()
    assert "set trainer.total_training_steps" in statuses_reason(report, "trainer.total_epochs")


def statuses_reason(report: dict[str, Any], key: str) -> str:
    return next(entry["reason"] for entry in report["keys"] if entry["verl"] == key)


def test_an_existing_file_is_kept_unless_force(dapo_paths: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "job.toml"
    out.write_text("mine\n")
    result = rlctl("convert", "verl", "--out", str(out), *minimal(dapo_paths), home=tmp_path / "home")
    assert result.returncode == 2 and "--force" in result.stderr and out.read_text() == "mine\n"
    result = rlctl("convert", "verl", "--out", str(out), "--force", *minimal(dapo_paths), home=tmp_path / "home")
    assert result.returncode == 0, result.stderr
    assert tomllib.loads(out.read_text())["job"]["steps"] == 4


def test_ssh_leaves_the_inventory_to_fill_and_disaggregated_is_refused(dapo_paths: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    out = tmp_path / "job.toml"
    code, _, stderr = convert_json(out, minimal(dapo_paths), "--backend", "ssh", home=tmp_path / "home")
    assert code == 0, stderr
    assert tomllib.loads(out.read_text())["cluster"] == {"backend": "ssh", "ssh": {"hosts": []}}
    assert 'fill in 3 "name=address" entries' in out.read_text()
    dry = rlctl("launch", "--dry-run", str(out), home=tmp_path / "home")
    assert dry.returncode == 2 and "cluster.ssh.hosts" in dry.stderr
    result = rlctl("convert", "verl", "--out", str(tmp_path / "d.toml"), "--placement", "disaggregated",
                   *minimal(dapo_paths), home=tmp_path / "home")
    assert result.returncode == 2 and "disaggregated" in result.stderr and not (tmp_path / "d.toml").exists()


def test_relative_paths_are_read_from_where_verl_ran(dapo_paths: dict[str, Path], tmp_path: Path) -> None:
    shutil.copy(dapo_paths["TRAIN_FILE"], tmp_path / "train.parquet")
    args = [a for a in minimal(dapo_paths) if not a.startswith(("data.train_files", "trainer.total_training_steps"))]
    result = rlctl("convert", "verl", "--out", "job.toml", *args, "data.train_files=train.parquet",
                   "trainer.total_epochs=1", home=tmp_path / "home", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    job = tomllib.loads((tmp_path / "job.toml").read_text())
    assert job["data"]["train_files"] == [str(tmp_path / "train.parquet")] and job["job"]["steps"] == 1100 // 64


# -- the pieces -----------------------------------------------------------------------------------

def test_hydra_values_parse_as_hydra_parses_them() -> None:
    assert parse_value("['a.parquet', 'b.parquet']") == ["a.parquet", "b.parquet"]
    assert parse_value('["console"]') == ["console"] and parse_value("[console,wandb]") == ["console", "wandb"]
    assert parse_value("True") is True and parse_value("false") is False and parse_value("null") is None
    assert parse_value("0.") == 0.0 and parse_value("1e-6") == 1e-6 and parse_value("-1") == -1
    assert parse_value("{enable_thinking: False, n: 2}") == {"enable_thinking": False, "n": 2}
    assert parse_value("'a,b'") == "a,b" and parse_value("/x/y.parquet") == "/x/y.parquet" and parse_value("") == ""
    assert parse_override("~trainer.logger").value is None and parse_override("++a.b=1").op == "force"
    for bad in ("a=choice(1,2)", "a=1,2", "=3", "a b=1"):
        with pytest.raises(OverrideError):
            parse_override(bad)


def test_interpolations_follow_the_overrides_they_name() -> None:
    cfg = apply_overrides([parse_override("data.max_response_length=2048"),
                           parse_override("actor_rollout_ref.actor.ppo_max_token_len_per_gpu=9000")])
    assert cfg["actor_rollout_ref.rollout.response_length"] == 2048
    assert cfg["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"] == 9000
    assert cfg["trainer.default_local_dir"] == "checkpoints/verl_examples/gsm8k"
    pinned = apply_overrides([parse_override("actor_rollout_ref.rollout.response_length=100"),
                              parse_override("data.max_response_length=2048")])
    assert pinned["actor_rollout_ref.rollout.response_length"] == 100


class _NoFiles:
    def row_count(self, path: str) -> int:
        raise FactError(f"{path} is not a file here")

    def model_config(self, path: str) -> dict[str, Any]:
        raise FactError(f"{path} is not a folder here")


def test_a_response_length_other_than_the_datas_is_refused() -> None:
    args = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=vllm", "trainer.total_training_steps=2",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.rollout.response_length=100"]
    result = convert_verl(args, ConvertOptions(), _NoFiles())
    assert not result.ok and [d.verl for d in result.refused] == ["actor_rollout_ref.rollout.response_length"]


def test_every_mapped_rule_names_a_key_the_job_file_gets_and_every_written_key_is_rlctls() -> None:
    for rule in RULES:
        for job_key in (rule.job_key or "").split(", "):
            assert not job_key or job_key in JOB_KEYS, (rule.pattern, job_key)

    def schema_has(fields: dict[str, Field], dotted: str) -> bool:
        head, _, rest = dotted.partition(".")
        spec = fields.get(head)
        return spec is not None and (schema_has(spec.fields or {}, rest) if rest else spec.kind != "table")

    for job_value in JOB_VALUES:
        assert schema_has(JOB_SCHEMA, job_value.job_key), job_value.job_key


def test_the_docs_table_is_the_rule_table() -> None:
    text = (ROOT / "docs" / "algorithms.md").read_text()
    assert "## Converting a verl run script" in text
    table = text.split("<!-- verl-rules -->\n", 1)[1].split("<!-- /verl-rules -->", 1)[0]
    assert table == rules_markdown(), "regenerate the table with rlctl.convert.verl_rules.rules_markdown()"


def test_the_defaults_file_is_what_the_generator_makes_from_verls_wheel(tmp_path: Path) -> None:
    if not WHEEL.is_file():
        pytest.skip(f"verl's wheel is not at {WHEEL} (CI does not download it)")
    pytest.importorskip("yaml", reason="scripts/verl-defaults.py needs PyYAML")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "verl-defaults.py"), str(WHEEL), "--out",
                             str(tmp_path / "verl_defaults.py")], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "verl_defaults.py").read_text() == (ROOT / "rlctl" / "convert" / "verl_defaults.py").read_text()
    assert verl_defaults.VERL_VERSION == "0.9.1"
    assert verl_defaults.DEFAULTS["actor_rollout_ref.actor.optim.betas"] == [0.9, 0.999]
    assert verl_defaults.DEFAULTS["actor_rollout_ref.rollout.response_length"] == 512  # an interpolation, resolved
