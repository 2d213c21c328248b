"""Property-based fuzzing of the parsers a stranger or a careless operator can reach: the agent
protocol decoder, the job-spec loader and the controller's API request handler. Whatever they are
fed, nothing escapes but the documented errors (``ProtocolError``; ``SpecError``; a refusal in
the answer or ``ValueError``/``TypeError`` for a request of the wrong shape)."""

from __future__ import annotations

import asyncio
import json
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rlctl_agent import protocol

from rlctl.controller.api import ApiHandlers, ApiServer
from rlctl.core.faultparams import FaultParamError, validate_fault
from rlctl.core.spec import SpecError, parse_spec
from rlctl.jobtemplates import write_job
from rlctl.specfile import load_job_file

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=2048))
def test_the_protocol_decoder_raises_only_protocol_errors_on_bytes(data: bytes) -> None:
    for allowed in (protocol.AGENT_TO_CONTROLLER, protocol.CONTROLLER_TO_AGENT):
        try:
            message = protocol.decode(data, allowed)
        except protocol.ProtocolError:
            continue
        assert isinstance(message, dict) and message["type"] in allowed


@FUZZ
@given(st.dictionaries(st.text(max_size=12), JSON, max_size=6), st.sampled_from(sorted(protocol.AGENT_TO_CONTROLLER)))
def test_the_protocol_decoder_takes_any_structure(fields: dict[str, Any], message_type: str) -> None:
    body = {**fields, "v": protocol.PROTOCOL_VERSION, "type": message_type}
    line = json.dumps(body).encode() + b"\n"
    assert protocol.decode(line, protocol.AGENT_TO_CONTROLLER)["type"] == message_type
    try:
        protocol.decode(json.dumps(fields).encode(), protocol.AGENT_TO_CONTROLLER)
    except protocol.ProtocolError:
        pass


@FUZZ
@given(st.text(max_size=400))
def test_the_job_file_loader_raises_only_spec_errors_on_text(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.toml"
        path.write_text(text)
        try:
            load_job_file(path)
        except SpecError as exc:
            assert exc.problems


_VALID = tomllib.loads(write_job(Path(tempfile.mkdtemp()), name="fuzz").read_text())


@FUZZ
@given(st.sampled_from(sorted(_VALID)), st.data())
def test_the_spec_parser_raises_only_spec_errors_on_any_structure(table: str, data: st.DataObject) -> None:
    changed = {k: dict(v) if isinstance(v, dict) else v for k, v in _VALID.items()}
    if isinstance(changed[table], dict) and changed[table] and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(changed[table])))
        changed[table][key] = data.draw(JSON)
    else:
        changed[table] = data.draw(JSON)
    try:
        parse_spec(changed, "fuzz.toml")
    except SpecError as exc:
        assert exc.problems


def _handlers() -> ApiHandlers:
    async def inject(node: str, kind: str, params: dict[str, Any]) -> dict[str, Any]:
        try:
            validate_fault(kind, params)
        except FaultParamError as exc:
            return {"ok": False, "error": str(exc)}
        return {"ok": True, "fault_id": "f", "node": node, "kind": kind}

    return ApiHandlers(status=lambda: {"job": {}}, diagnostics=lambda since: {"since": since},
                       stop=lambda reason: None, inject=inject)


_SERVER = ApiServer(Path("/nonexistent/api.sock"), _handlers())


@FUZZ
@given(JSON | st.fixed_dictionaries({"op": st.sampled_from(["status", "diagnostics", "stop", "inject", "x"])},
                                    optional={"since_mono": JSON, "reason": JSON, "node": JSON, "kind": JSON,
                                              "params": JSON}))
def test_the_api_handler_answers_or_refuses_any_request(request: Any) -> None:
    try:
        answer = asyncio.run(_SERVER.dispatch(request))
    except (ValueError, TypeError):
        return  # the server turns these into {"ok": false, "error": "bad request: ..."}
    assert isinstance(answer, dict) and isinstance(answer.get("ok"), bool)
    json.dumps(answer)


@FUZZ
@given(st.sampled_from(["crash", "hang", "slow", "xid", "ecc", "partition", "slow-link", "node-down", "?"]),
       st.dictionaries(st.sampled_from(["after", "duration", "factor", "code", "gpu", "kind", "delay_ms", "wid", "x"]),
                       JSON | st.floats(), max_size=4))
def test_fault_parameters_are_accepted_in_range_or_refused_by_name(kind: str, params: dict[str, Any]) -> None:
    try:
        checked = validate_fault(kind, params)
    except FaultParamError as exc:
        assert exc.option and str(exc).startswith(exc.option)
        return
    json.dumps(checked, allow_nan=False)  # whatever passes can go on the wire to an agent
