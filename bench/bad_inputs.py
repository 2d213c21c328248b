"""Every bad input we try, and what rlctl answers: job files, CLI options, the agent protocol, the
controller's API and weight pulls, against a real local job.

Each row is tried for real: a job file written and launched, a CLI command run, bytes written to
the job's agent port, a request sent to its API socket, a pull made from one of its weight
holders. The baseline in the same run is a good input of each kind, which must be accepted.

    python bench/bad_inputs.py

Prints a markdown table (for docs/reliability.md), then one JSON object on the last line.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.update(UCX_NET_DEVICES="lo", UCX_TLS="tcp,self", UCXPY_PROGRESS_MODE="blocking", UCX_WARN_UNUSED_ENV_VARS="n")

from rlctl_agent import protocol

from rlctl.controller.agents import HANDSHAKE_TIMEOUT_S
from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from rlctl.lab.reference_jobs import write_job

Row = dict[str, Any]


def cli(state: Path, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, RLCTL_HOME=str(state), RLCTL_CACHE=os.environ.get("RLCTL_CACHE", str(ROOT / ".cache/rlctl")))
    return subprocess.run([sys.executable, "-m", "rlctl.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def answer_of(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line.strip() for line in (result.stderr or result.stdout).splitlines() if line.strip()]
    text = " ".join(lines)[:160]
    return f"exit {result.returncode}: {text}"


def job_file_rows(tmp: Path, state: Path) -> list[Row]:
    good = write_job(tmp / "files", name="good").read_text()
    cases = [
        ("no such file", None),
        ("not TOML", "steps = = 3"),
        ("an unknown key", good.replace("seed = 1", "seed = 1\nsede = 2")),
        ("a wrong type", good.replace("steps = 400", 'steps = "ten"')),
        ("zero trainer nodes", good.replace("[roles.trainer]\nnodes = 1", "[roles.trainer]\nnodes = 0")),
        ("an orphan timeout below its minimum", good.replace("[fault_tolerance]", "[fault_tolerance]\nagent_orphan_timeout_s = 5")),
        ("a negative heartbeat interval", good.replace("heartbeat_interval_s = 0.5", "heartbeat_interval_s = -1")),
    ]
    rows = []
    for index, (what, text) in enumerate(cases):
        path = tmp / "files" / f"bad{index}.toml"
        if text is not None:
            path.write_text(text)
        result = cli(state, "launch", str(path), "--dry-run")
        rows.append({"area": "job file", "input": what, "answer": answer_of(result), "refused": result.returncode != 0})
    result = cli(state, "launch", str(tmp / "files" / "good.toml"), "--dry-run")
    rows.append({"area": "job file", "input": "(baseline) the reference job", "answer": f"exit {result.returncode}",
                 "refused": result.returncode != 0, "baseline": True})
    return rows


def cli_rows(state: Path, job: str) -> list[Row]:
    cases = [
        ("inject-fault --kind hang --duration -5", ["--kind", "hang", "--duration", "-5"]),
        ("inject-fault --kind slow --after -3 --duration 1e309", ["--kind", "slow", "--after", "-3", "--duration", "1e309"]),
        ("inject-fault --kind xid --code -1", ["--kind", "xid", "--code", "-1"]),
        ("inject-fault --kind xid (no code)", ["--kind", "xid"]),
        ("inject-fault --kind slow --factor 1", ["--kind", "slow", "--factor", "1"]),
        ("inject-fault --kind crash --duration 4", ["--kind", "crash", "--duration", "4"]),
        ("inject-fault --kind meteor", ["--kind", "meteor"]),
        ("inject-fault --kind ecc --ecc triple", ["--kind", "ecc", "--ecc", "triple"]),
        ("inject-fault --kind xid --code 1e300", ["--kind", "xid", "--code", "1e300"]),
    ]
    rows = []
    for what, args in cases:
        result = cli(state, "inject-fault", "node02", "--job", job, *args)
        rows.append({"area": "CLI", "input": what, "answer": answer_of(result), "refused": result.returncode != 0})
    result = cli(state, "inject-fault", "node99", "--job", job, "--kind", "crash")
    rows.append({"area": "CLI", "input": "inject-fault node99 (not in the job)", "answer": answer_of(result),
                 "refused": result.returncode != 0})
    result = cli(state, "inject-fault", "--cancel", "inj-00000000", "--job", job)
    rows.append({"area": "CLI", "input": "inject-fault --cancel inj-00000000 (no such injection)",
                 "answer": answer_of(result), "refused": result.returncode != 0})
    result = cli(state, "status", "no-such-job")
    rows.append({"area": "CLI", "input": "status no-such-job", "answer": answer_of(result), "refused": result.returncode != 0})
    return rows


def wire(port: int, payload: bytes, read_after: float = 2.0) -> str:
    """Write ``payload`` after the challenge; what the controller answered, or how it closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.settimeout(read_after)
        challenge = sock.recv(4096)
        try:
            sock.sendall(payload)
        except OSError as exc:
            return f"closed while sending ({exc.__class__.__name__})"
        try:
            data = sock.recv(4096)
        except TimeoutError:
            return "no answer yet (connection held)"
        except OSError as exc:
            return f"connection reset ({exc.__class__.__name__})"
        if not data:
            return "connection closed, nothing sent"
        return data.decode(errors="replace").strip()[:120]
    return challenge.decode()


def protocol_rows(jobdir: JobDir) -> list[Row]:
    port = int(jobdir.read_controller()["agent_port"])
    secret = jobdir.secret()

    def hello(node: str, auth: str, **extra: Any) -> bytes:
        return protocol.encode("hello", job_id=jobdir.job_id, node=node, incarnation=1, auth=auth, facts={}, **extra)

    cases = [
        ("garbage bytes with a newline", b"\x00\xff garbage\n"),
        ("a JSON line of another protocol version", b'{"v": 9, "type": "hello"}\n'),
        ("a JSON array", b"[1, 2, 3]\n"),
        ("a hello with a wrong HMAC", hello("node02", "00" * 32)),
        ("a hello for a node not in the job", hello("node99", "00" * 32)),
        ("a 1 MiB hello", hello("node02", "00" * 32, pad="x" * (1 << 20))),
        ("8 MiB without a newline", b"A" * (8 << 20)),
        ("a hello nested 5,000 arrays deep", b'{"v": 1, "type": "hello", "node": ' + b"[" * 5_000 + b"]" * 5_000
         + b"}\n"),
    ]
    rows = [{"area": "agent protocol", "input": what, "answer": wire(port, payload), "refused": True}
            for what, payload in cases]
    silence = HANDSHAKE_TIMEOUT_S + 2.0  # past the controller's deadline for a hello
    rows.append({"area": "agent protocol", "input": f"silence after the challenge ({silence:g} s)",
                 "answer": wire(port, b"", read_after=silence), "refused": True})
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        nonce = protocol.decode(sock.recv(4096), protocol.CONTROLLER_TO_AGENT)["nonce"]
        sock.sendall(hello("node99", protocol.auth_digest(secret, nonce, "node99")))
        answer = sock.recv(4096).decode().strip()
    rows.append({"area": "agent protocol", "input": "the job's secret, for a node not in the job", "answer": answer[:120],
                 "refused": '"reject"' in answer})
    for row in rows:
        row["refused"] = "welcome" not in row["answer"]
    return rows


def api_rows(jobdir: JobDir) -> list[Row]:
    def call(raw: bytes) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            sock.connect(str(jobdir.api_socket))
            sock.sendall(raw)
            return sock.recv(1 << 16).decode(errors="replace").strip()[:160]

    cases = [
        ("not JSON", b"hello\n"),
        ("a JSON array", b"[1]\n"),
        ("an unknown op", b'{"op": "format-disk"}\n'),
        ("inject with params as a string", b'{"op": "inject", "node": "node02", "kind": "hang", "params": "x"}\n'),
        ("inject with a non-finite duration", b'{"op": "inject", "node": "node02", "kind": "hang", "params": {"duration": 1e999}}\n'),
        ("inject a worker the agent does not have", b'{"op": "inject", "node": "node02", "kind": "hang", "params": {"wid": "nobody"}}\n'),
        ("diagnostics with since_mono a string", b'{"op": "diagnostics", "since_mono": "x"}\n'),
        ("diagnostics with since_mono = 10**400", b'{"op": "diagnostics", "since_mono": 1' + b"0" * 400 + b"}\n"),
        ("diagnostics with since_mono NaN", b'{"op": "diagnostics", "since_mono": NaN}\n'),
        ("inject with after = 10**400", b'{"op": "inject", "node": "node02", "kind": "crash", "params": {"after": 1'
         + b"0" * 400 + b"}}\n"),
        ("arrays nested 100,000 deep", b"[" * 100_000 + b"]" * 100_000 + b"\n"),
        ("cancel an unknown fault id", b'{"op": "cancel", "fault_id": "inj-00000000"}\n'),
    ]
    rows = [{"area": "API", "input": what, "answer": call(raw)} for what, raw in cases]
    for row in rows:
        row["refused"] = '"ok": false' in row["answer"]
    rows.append({"area": "API", "input": "(baseline) status", "answer": call(b'{"op": "status"}\n')[:40],
                 "refused": False, "baseline": True})
    return rows


def weight_rows(jobdir: JobDir) -> list[Row]:
    from rlctl.weights import WeightError
    from rlctl.weights.auth import TOKEN_ENV
    from rlctl.weights.client import fetch

    def newest_source() -> dict[str, Any]:
        journal = Journal(jobdir.journal, readonly=True)
        try:
            return dict([ev.data["source"] for ev in journal.read(types=("WeightsPublished",))][-1])
        finally:
            journal.close()

    def pull(token: str | None) -> str:
        if token is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = token
        answer = ""
        for _ in range(5):  # the trainer may publish a newer version between reading and pulling
            try:
                version, _ = asyncio.run(fetch(newest_source(), timeout=10.0))
            except WeightError as exc:
                answer = f"refused: {str(exc)[:120]}"
                if "version mismatch" in answer:
                    continue
                return answer
            return f"served version {version}"
        return answer

    transport = newest_source()["transport"]
    rows = [{"area": "weight pull", "input": f"{transport} pull without the job token", "answer": pull(None)},
            {"area": "weight pull", "input": f"{transport} pull with a wrong token", "answer": pull("ab" * 32)}]
    for row in rows:
        row["refused"] = row["answer"].startswith("refused")
    served = pull(protocol.weights_token(jobdir.secret()))
    rows.append({"area": "weight pull", "input": "(baseline) a pull with the job's token", "answer": served,
                 "refused": not served.startswith("served"), "baseline": True})
    return rows


def main() -> None:
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="rlctl-bad-") as tmp_name:
        tmp = Path(tmp_name)
        state = tmp / "jobs"
        print("[bad_inputs] job files ...", file=sys.stderr, flush=True)
        rows += job_file_rows(tmp, state)
        launched = json.loads(cli(state, "launch", str(write_job(tmp, name="target")), "--json").stdout.splitlines()[-1])
        job, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
        try:
            deadline = time.monotonic() + 180
            while json.loads(cli(state, "status", job, "--json").stdout.splitlines()[-1])["job"]["step"] < 2:
                if time.monotonic() > deadline:
                    raise RuntimeError("the target job did not train")
                time.sleep(1.0)
            for name, part in (("CLI", lambda: cli_rows(state, job)), ("agent protocol", lambda: protocol_rows(jobdir)),
                               ("API", lambda: api_rows(jobdir)), ("weight pulls", lambda: weight_rows(jobdir))):
                print(f"[bad_inputs] {name} ...", file=sys.stderr, flush=True)
                rows += part()
            alive = json.loads(cli(state, "status", job, "--json").stdout.splitlines()[-1])["job"]
        finally:
            cli(state, "stop", job)
    print("| where | bad input | what rlctl answered |")
    print("|---|---|---|")
    for row in rows:
        print(f"| {row['area']} | {row['input']} | {row['answer'].replace('|', '/')} |")
    bad = [r for r in rows if not r.get("baseline")]
    print(json.dumps({"rows": rows, "tried": len(bad), "refused": sum(1 for r in bad if r["refused"]),
                      "baselines_accepted": all(not r["refused"] for r in rows if r.get("baseline")),
                      "job_state_after": alive["state"], "job_step_after": alive["step"]}))


if __name__ == "__main__":
    main()
