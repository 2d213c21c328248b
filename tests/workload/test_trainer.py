"""Trainer: one step per batch, atomic checkpoints, replay after restore, 2-process gloo DP."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rlctl.core.algorithm import AlgorithmSpec
from rlctl.workload.hf_model import load_hf_policy
from rlctl.workload.policy_update import response_rows
from rlctl.workload.rendezvous import held_store
from rlctl.workload.trainer import TRAINER_STATE_FILE, Trainer, TrainerConfig, micro_batches

from .batches import small_model, synthetic_batch

KL_RECIPE = AlgorithmSpec(use_kl_loss=True, kl_loss_coef=0.05)
CONFIG = TrainerConfig(lr=1e-3, warmup_steps=2, total_steps=10, algorithm=KL_RECIPE)
HERE = Path(__file__).resolve().parent


def _trainer(seed: int) -> Trainer:
    return Trainer(small_model(seed), CONFIG, distributed=False)


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


def test_response_rows_point_at_the_response_tokens_only() -> None:
    batch = synthetic_batch(0, prompts=2, group_size=1)
    rows = response_rows(batch)
    for row, sample in enumerate(batch):
        count = len(sample.response_tokens)
        assert rows.mask[row].sum().item() == count
        picked = rows.ids[row, 1:][rows.index[row, :count]].tolist()
        assert picked == sample.response_tokens == rows.targets[row, :count].tolist()
        assert rows.index[row, 0].item() == len(sample.prompt_tokens) - 1


def test_train_step_changes_weights_and_reports_metrics() -> None:
    trainer = _trainer(0)
    before = trainer.state_dict_for_publish()
    batch = synthetic_batch(3)
    metrics = trainer.train_step(batch)
    assert trainer.step == 1 and metrics["step"] == 1.0
    assert metrics["reward_mean"] == pytest.approx(sum(s.reward for s in batch) / len(batch))
    assert metrics["tokens"] == sum(len(s.response_tokens) for s in batch)
    assert metrics["grad_norm"] > 0 and metrics["kl"] == pytest.approx(0.0, abs=1e-7)
    after = trainer.state_dict_for_publish()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert trainer.train_step(synthetic_batch(4))["kl"] > 0  # second step: policy moved off the reference


def test_micro_batches_sort_by_length_and_respect_the_budget() -> None:
    lengths = [30, 5, 160, 7, 6, 31, 29]
    plan = micro_batches(lengths, 64)
    assert sorted(i for chunk in plan for i in chunk) == list(range(len(lengths)))
    for chunk in plan:
        assert len(chunk) == 1 or len(chunk) * max(lengths[i] for i in chunk) <= 64
    assert [lengths[i] for i in plan[0]] == [5, 6, 7]  # the short ones together, not padded to 160
    assert [2] in plan  # longer than the budget: alone
    assert micro_batches(lengths, 0) == [list(range(len(lengths)))] and micro_batches([], 64) == []


def test_micro_batched_step_equals_one_forward_over_the_batch() -> None:
    whole = Trainer(small_model(3), TrainerConfig(lr=1e-3, algorithm=KL_RECIPE, micro_batch_tokens=0),
                    distributed=False)
    split = Trainer(small_model(3), TrainerConfig(lr=1e-3, algorithm=KL_RECIPE, micro_batch_tokens=40),
                    distributed=False)
    for step in range(3):
        batch = synthetic_batch(10 + step, prompts=6)
        metrics_whole, metrics_split = whole.train_step(batch), split.train_step(batch)
        assert metrics_whole["micro_batches"] == 1 and metrics_split["micro_batches"] >= 3
        for key in ("loss", "kl", "clip_frac", "grad_norm", "tokens"):
            assert metrics_split[key] == pytest.approx(metrics_whole[key], rel=1e-4, abs=1e-6), key
        if step == 0:  # same weights going in: the accumulated gradients are the one-pass gradients
            for (name, a), b in zip(whole.model.named_parameters(), split.model.parameters()):
                assert a.grad is not None and b.grad is not None
                torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7, msg=name)
    # Adam divides by sqrt(v): where a gradient is at float noise level its sign can differ, which
    # moves that one weight by up to lr; everything else agrees to float precision.
    for key, value in whole.state_dict_for_publish().items():
        gap = (value - split.state_dict_for_publish()[key]).abs()
        assert gap.max() <= 1e-4 and int((gap > 1e-5).sum()) <= max(1, value.numel() // 1000), key


def test_checkpoint_replay_equals_uninterrupted_run(tmp_path: Path) -> None:
    batches = [synthetic_batch(seed) for seed in range(5)]
    checkpoint = tmp_path / "ckpt" / "step-000002"
    uninterrupted = _trainer(0)
    for index, batch in enumerate(batches):
        uninterrupted.train_step(batch)
        if index == 1:
            uninterrupted.save_checkpoint(checkpoint)
            draws_after_save = (random.random(), torch.rand(3), np.random.rand())
    restored = _trainer(seed=123)  # different initial weights: everything must come from the file
    assert restored.load_checkpoint(checkpoint) == 2
    assert (random.random(), np.random.rand()) == (draws_after_save[0], draws_after_save[2])
    assert torch.equal(torch.rand(3), draws_after_save[1])
    for batch in batches[2:]:
        restored.train_step(batch)
    assert restored.step == uninterrupted.step == 5
    _assert_same_weights(restored.state_dict_for_publish(), uninterrupted.state_dict_for_publish())
    assert restored.scheduler.get_last_lr() == uninterrupted.scheduler.get_last_lr()
    assert [p.name for p in checkpoint.parent.iterdir()] == ["step-000002"]  # no staging folder left


def test_state_served_to_a_standby_replica_resumes_like_the_uninterrupted_run() -> None:
    """The in-memory replica path end to end: rank_state -> weight server (tcp) -> the standby's
    TrainerStateReplica, which serves it again -> a restarted trainer fetches it from the standby
    (the trainer that served it is gone) -> load_rank_state, then the same batches give the same weights."""
    from rlctl.roles.standby import TrainerStateReplica
    from rlctl.weights import WeightServerThread, fetch_sync
    from rlctl.weights.shards import combine
    from rlctl.workload.rank_state import load_rank_state, rank_state

    batches = [synthetic_batch(seed) for seed in range(4)]
    uninterrupted = _trainer(0)
    for batch in batches[:2]:
        uninterrupted.train_step(batch)
    replica = TrainerStateReplica("tcp", "127.0.0.1")
    try:
        with WeightServerThread("tcp") as server:
            source = combine([server.publish(2, rank_state(uninterrupted))], 2)
            replica.copy({"step": 2, "source": source})
            replica.copy({"step": 1, "source": source})  # older than what it holds: ignored
        held = replica.held()
        assert held is not None and held[0] == 2
        report = replica.report()
        assert report["trainer_state_step"] == 2 and len(report["trainer_state_source"]["shards"]) == 1
        version, served = fetch_sync(report["trainer_state_source"]["shards"][0], timeout=30)
        assert version == 2 and served.keys() == held[1].keys()
    finally:
        replica.close()
    draws_after = (random.random(), torch.rand(3))
    restored = _trainer(seed=99)
    assert load_rank_state(restored, served) == 2
    assert random.random() == draws_after[0] and torch.equal(torch.rand(3), draws_after[1])
    for batch in batches[2:]:
        restored.train_step(batch)
        uninterrupted.train_step(batch)
    _assert_same_weights(restored.state_dict_for_publish(), uninterrupted.state_dict_for_publish())
    assert restored.optimizer.state_dict()["state"][0]["step"] == 4
    with pytest.raises(ValueError, match="not one rank's rlctl trainer state"):
        load_rank_state(restored, {"meta": torch.frombuffer(bytearray(_model_only_bytes()), dtype=torch.uint8)})


def test_a_restart_takes_the_standbys_newer_copy_when_the_named_one_was_replaced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller names the step the standby held when the restarted trainer asked; the standby
    finishes copying the next step meanwhile and serves only that. The trainer asks the controller
    again, takes the newer copy while it is not past the published version, and goes the checkpoint
    way when it is, or when the controller never names a newer copy."""
    from types import SimpleNamespace

    from rlctl.roles import trainer as trainer_role
    from rlctl.roles.common import RoleSettings
    from rlctl.roles.standby import TrainerStateReplica
    from rlctl.weights import WeightServerThread
    from rlctl.weights.shards import combine
    from rlctl.workload.rank_state import rank_state

    monkeypatch.setattr(trainer_role, "REPLICA_MOVED_WAIT_S", 1.0)
    source_trainer = _trainer(0)
    for seed in range(2):
        source_trainer.train_step(synthetic_batch(seed))
    replica = TrainerStateReplica("tcp", "127.0.0.1")

    def offered(report: dict) -> dict:
        return {"step": report["trainer_state_step"], "source": report["trainer_state_source"]}

    try:
        with WeightServerThread("tcp") as server:
            replica.copy({"step": 2, "source": combine([server.publish(2, rank_state(source_trainer))], 2)})
            named = offered(replica.report())
            source_trainer.train_step(synthetic_batch(2))
            replica.copy({"step": 3, "source": combine([server.publish(3, rank_state(source_trainer))], 3)})
        newest = offered(replica.report())
        for controller_names, target_version, restored_step in [(newest, 3, 3), (newest, 2, None), (named, 3, None)]:
            role = object.__new__(trainer_role.TrainerRole)
            role.w = SimpleNamespace(phase=lambda *args: None,
                                     request=lambda op, names=controller_names: {"state_replica": names})
            role.settings = RoleSettings(raw={"weights_shared_memory": True}, checkpoint_dir=Path("."),
                                         weights_transport="tcp", weights_host="127.0.0.1", standby=False)
            role.trainer, role.server, role.state_server, role.version = _trainer(seed=99), None, None, 0
            try:
                step = role.restore_replica({"state_replica": named, "checkpoint_step": None,
                                             "target_version": target_version})
            finally:
                role.close()
            assert step == restored_step and role.version == (restored_step or 0)
    finally:
        replica.close()


def test_replica_skips_a_source_that_failed() -> None:
    from rlctl.roles.standby import TrainerStateReplica
    from rlctl.weights.shards import combine

    replica = TrainerStateReplica("tcp", "127.0.0.1")
    replica.FETCH_TIMEOUT_S = 2.0
    with socket.socket() as sock:  # a port nobody serves on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dead = {"transport": "tcp", "host": "127.0.0.1", "port": port, "version": 3, "nbytes": 10, "checksum": "x"}
    replica.copy({"step": 3, "source": combine([dead], 3)})
    assert replica.held() is None and replica.step == -1 and "trainer_state_source" not in replica.report()
    assert replica._failed_step == 3


def test_a_source_that_stops_answering_never_blocks_the_standby() -> None:
    """A paused trainer's server accepts and then says nothing: the copy runs in the background, so
    ``offer`` and ``report`` (what the standby's polling loop calls) return at once, and the next
    offer from a live source is copied once the stalled fetch gives up."""
    from rlctl.roles.standby import TrainerStateReplica
    from rlctl.weights import WeightServerThread
    from rlctl.weights.shards import combine
    from rlctl.workload.rank_state import rank_state

    replica = TrainerStateReplica("tcp", "127.0.0.1")
    replica.FETCH_TIMEOUT_S = 3.0
    with socket.socket() as silent:  # listens (the kernel accepts), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        stalled = {"transport": "tcp", "host": "127.0.0.1", "port": port, "version": 3, "nbytes": 10, "checksum": "x"}
        try:
            with WeightServerThread("tcp") as server:
                live = combine([server.publish(4, rank_state(_trainer(0)))], 4)
                started = time.monotonic()
                replica.offer({"step": 3, "source": combine([stalled], 3)})
                while replica._wanted is not None:  # the copier has taken step 3 (else step 4 would replace it)
                    time.sleep(0.01)
                replica.offer({"step": 4, "source": live})
                assert replica.report() == {"trainer_state_step": -1}
                assert time.monotonic() - started < 2.0  # the polling loop was never held up (the stall is 3 s)
                assert replica.wait_idle(30.0)
                assert replica.step == 4 and replica._failed_step == 3
                assert time.monotonic() - started >= replica.FETCH_TIMEOUT_S  # the stalled fetch was given up first
        finally:
            replica.close()
    replica.offer({"step": 5, "source": live})  # closed: nothing more is fetched
    assert replica.wait_idle(1.0) and replica.step == 4


def test_closing_the_replica_cancels_a_copy_in_flight() -> None:
    """The standby takes a role: a pull still waiting on a silent source ends at once (it held
    the copy's memory for up to its 60 s timeout before), and nothing lands afterwards."""
    from rlctl.roles.standby import TrainerStateReplica
    from rlctl.weights.shards import combine

    replica = TrainerStateReplica("tcp", "127.0.0.1")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        stalled = {"transport": "tcp", "host": "127.0.0.1", "port": port, "version": 3, "nbytes": 10, "checksum": "x"}
        replica.offer({"step": 3, "source": combine([stalled], 3)})
        deadline = time.monotonic() + 10.0
        while replica._fetch is None and time.monotonic() < deadline:  # the pull is in flight
            time.sleep(0.01)
        assert replica._fetch is not None
        started = time.monotonic()
        replica.close()
        assert replica.wait_idle(5.0) and time.monotonic() - started < 2.0
    assert replica.step == -1 and replica._failed_step == -1 and replica.held() is None


def _model_only_bytes() -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save({"format": "something-else"}, buffer)
    return buffer.getvalue()


def test_failed_write_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = _trainer(0)
    path = tmp_path / "step-000000"
    trainer.save_checkpoint(path)
    original = {f.name: f.read_bytes() for f in path.iterdir()}
    trainer.train_step(synthetic_batch(0))

    def broken_save(obj: object, handle: object) -> None:
        handle.write(b"partial")  # type: ignore[attr-defined]
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        trainer.save_checkpoint(path)
    assert {f.name: f.read_bytes() for f in path.iterdir()} == original
    assert [p.name for p in tmp_path.iterdir()] == ["step-000000"]  # the staging folder is gone


def test_checkpoint_is_an_hf_folder_that_loads_as_a_model_and_as_a_trainer(tmp_path: Path) -> None:
    trainer = _trainer(0)
    trainer.train_step(synthetic_batch(1))
    path = trainer.save_checkpoint(tmp_path / "step-000001", {"cursor.json": b"{}"})
    assert path is not None and (path / TRAINER_STATE_FILE).is_file() and (path / "cursor.json").read_bytes() == b"{}"
    model = load_hf_policy(path, "cpu", "float32")
    _assert_same_weights(dict(model.state_dict()), trainer.state_dict_for_publish())
    resumed = Trainer.from_hf(path, CONFIG, distributed=False)
    assert resumed.step == 1
    with pytest.raises(FileNotFoundError, match=TRAINER_STATE_FILE):
        _trainer(2).load_checkpoint(tmp_path)


def _run_worker(out: Path, env_extra: dict[str, str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    return subprocess.Popen([sys.executable, str(HERE / "dp_worker.py"), str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


MODES = [None, "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def test_two_process_gloo_equals_single_process(tmp_path: Path) -> None:
    # Every aggregation over two mini-batches: each needs the whole mini-batch's token or sequence
    # count. One group runs every recipe in turn (a fresh trainer each), and so does the single process.
    asked = [{} if mode is None else {"loss_agg_mode": mode, "ppo_mini_batch_size": 2, "use_kl_loss": True,
                                       "kl_loss_coef": 0.05, "entropy_coeff": 0.01} for mode in MODES]
    recipes = json.dumps([fields or {"use_kl_loss": True, "kl_loss_coef": 0.05} for fields in asked])
    with held_store() as rendezvous:
        ranks = [_run_worker(tmp_path / f"rank{r}.pt", {**rendezvous, "WORLD_SIZE": "2", "RANK": str(r),
                                                         "RECIPES": recipes})
                 for r in range(2)]
        single = _run_worker(tmp_path / "single.pt", {"WORLD_SIZE": "1", "RANK": "0", "RECIPES": recipes})
        for proc in [*ranks, single]:
            output, _ = proc.communicate(timeout=240)
            assert proc.returncode == 0, output.decode()[-2000:]
    runs = [torch.load(tmp_path / name, weights_only=True) for name in ("rank0.pt", "rank1.pt", "single.pt")]
    initial = small_model(11).state_dict()
    for mode, results in zip(MODES, zip(*runs, strict=True), strict=True):
        assert [r["world"] for r in results] == [2, 2, 1], mode
        _assert_same_weights(results[0]["state"], results[1]["state"])  # ranks agree exactly
        for key, value in results[2]["state"].items():
            moved = (value - initial[key]).abs().max().item()
            gap = (results[0]["state"][key] - value).abs().max().item()
            # Adam divides by sqrt(v): float-level gradient differences show up in tiny-gradient weights,
            # so compare against the size of the update itself.
            assert gap <= max(1e-6, 0.05 * moved), (mode, key, gap, moved)
        for dp, alone in zip(results[0]["metrics"], results[2]["metrics"]):
            assert dp["tokens"] == alone["tokens"]
            assert dp["loss"] == pytest.approx(alone["loss"], abs=1e-6), mode
            assert dp["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-4), mode


def test_serving_the_state_before_the_first_step_changes_no_update() -> None:
    """The replica's part of an optimizer that has not stepped is empty: building it with a step of
    zero gradients (what ``get_optimizer_state_dict`` does) would advance Adam's step counter, so the
    served trainer's every later update would differ from the one that was not served."""
    from rlctl.workload.rank_state import load_rank_state, rank_state

    served, alone = _trainer(5), _trainer(5)
    part = {k: v.clone() for k, v in rank_state(served).items()}
    assert not [k for k in part if k.startswith("optim/")] and not served.optimizer.state
    for seed in (1, 2):
        served.train_step(synthetic_batch(seed))
        rank_state(served)
        alone.train_step(synthetic_batch(seed))
    _assert_same_weights(served.state_dict_for_publish(), alone.state_dict_for_publish())
    fresh = _trainer(6)
    assert load_rank_state(fresh, part) == 0 and not fresh.optimizer.state
    fresh.train_step(synthetic_batch(1))
    again = _trainer(5)
    again.train_step(synthetic_batch(1))
    _assert_same_weights(fresh.state_dict_for_publish(), again.state_dict_for_publish())
