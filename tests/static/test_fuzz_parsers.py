"""Property-based fuzzing of the parsers a stranger or a careless operator can reach: the agent
protocol decoder, the job-spec loader and the controller's API request handler. Whatever they are
fed (numbers no float holds, NaN and infinities, arrays nested thousands deep included), nothing
escapes but the documented errors (``ProtocolError``; ``SpecError``; a refusal in the answer, or
``BadRequest`` for a request of the wrong shape), and every API request line gets one answer."""

from __future__ import annotations

import asyncio
import json
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rlctl_agent import protocol

from rlctl.controller.api import ApiHandlers, ApiServer, BadRequest, encode_answer
from rlctl.core.faultparams import FaultParamError, validate_fault
from rlctl.core.spec import SpecError, parse_spec
from rlctl.lab.reference_jobs import write_job
from rlctl.spec_loader import load_job_file

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Numbers a float cannot hold, NaN and the infinities (``json.dumps`` writes them as NaN, Infinity).
NUMBERS = (st.integers(min_value=-(10**500), max_value=10**500) | st.floats()
           | st.sampled_from([10**400, -(10**400), 2**1024, float("nan"), float("inf"), float("-inf")]))
ODD_JSON = st.recursive(
    st.none() | st.booleans() | NUMBERS | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20)


def nested(depth: int, inner: str = "0") -> str:
    """``depth`` arrays, one inside the other, around ``inner``."""
    return "[" * depth + inner + "]" * depth


DEEP = st.integers(min_value=1, max_value=100_000).map(nested)


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
                       stop=lambda reason, checkpoint, timeout_s: {"reason": reason, "checkpoint": checkpoint},
                       inject=inject, injections=list,
                       cancel=lambda fault_id: {"ok": False, "error": f"no injection {fault_id}"})


_SERVER = ApiServer(Path("/nonexistent/api.sock"), _handlers())
OPS = ["status", "diagnostics", "stop", "inject", "injections", "cancel", "x"]
FIELDS = ["since_mono", "reason", "node", "kind", "params", "fault_id", "checkpoint", "timeout_s"]


@FUZZ
@given(ODD_JSON | st.fixed_dictionaries({"op": st.sampled_from(OPS)}, optional={key: ODD_JSON for key in FIELDS}))
def test_the_api_handler_answers_or_refuses_any_request(request: Any) -> None:
    try:
        answer = asyncio.run(_SERVER.dispatch(request))
    except BadRequest:
        return  # the server answers these {"ok": false, "error": "bad request: ..."}
    assert isinstance(answer, dict) and isinstance(answer.get("ok"), bool)
    json.dumps(answer, allow_nan=False)


def _answer(line: bytes) -> dict[str, Any]:
    answer = asyncio.run(_SERVER.answer(line))
    assert isinstance(answer, dict) and isinstance(answer.get("ok"), bool), answer
    assert json.loads(encode_answer(answer))["ok"] == answer["ok"]
    return answer


@FUZZ
@given(st.fixed_dictionaries({"op": st.sampled_from(OPS)}, optional={key: ODD_JSON for key in FIELDS})
       | st.fixed_dictionaries({"op": st.just("inject"), "node": st.just("node01"), "kind": st.just("xid"),
                                "params": st.dictionaries(st.sampled_from(["after", "code", "gpu", "duration"]),
                                                          NUMBERS, min_size=1)}))
def test_every_api_request_line_gets_one_answer_whatever_its_numbers(request: dict[str, Any]) -> None:
    answer = _answer(json.dumps(request).encode() + b"\n")
    if not answer["ok"] and answer["error"].startswith("the controller could not answer"):
        raise AssertionError(f"a handler failed on {request!r}: {answer['error']}")


@FUZZ
@given(st.sampled_from([('{"op": "diagnostics", "since_mono": ', "}"), ('{"op": "stop", "reason": ', "}"),
                        ('{"op": "inject", "node": "n", "kind": "crash", "params": {"after": ', "}}"), ("", "")]),
       DEEP)
def test_every_api_request_line_gets_one_answer_however_deep_it_nests(around: tuple[str, str], deep: str) -> None:
    answer = _answer((around[0] + deep + around[1]).encode())
    assert answer["ok"] is False and answer["error"].startswith("bad request: "), answer


@pytest.mark.parametrize(("line", "reason"), [
    ('{"op": "diagnostics", "since_mono": 1%s}' % ("0" * 400), "since_mono is out of range"),
    ('{"op": "diagnostics", "since_mono": -1%s}' % ("0" * 400), "since_mono is out of range"),
    ('{"op": "diagnostics", "since_mono": 1e400}', "since_mono is a finite number, got inf"),
    ('{"op": "diagnostics", "since_mono": NaN}', "NaN is not a number a request may hold"),
    ('{"op": "diagnostics", "since_mono": -Infinity}', "-Infinity is not a number a request may hold"),
    ('{"op": "diagnostics", "since_mono": "soon"}', "since_mono is a number, got a string"),
    ('{"op": "diagnostics", "since_mono": 1%s}' % ("0" * 5000), "not JSON: Exceeds the limit"),
    ('{"op": "inject", "node": "node01", "kind": "crash", "params": {"after": 1%s}}' % ("0" * 400),
     "--after: expected a value in [0, 86400], got an integer of about 401 digits"),
    ('{"op": "inject", "node": "node01", "kind": "xid", "params": {"code": 1e300}}',
     "--code: expected an integer in [1, 255], got 1e+300"),
    ('{"op": "inject", "node": ["node01"], "kind": "crash"}', "node is a non-empty string, got an array"),
    ('{"op": "inject", "node": "node01", "kind": "crash", "params": [1]}', "params is a JSON object, got an array"),
    ('{"op": "cancel", "fault_id": 7}', "fault_id is a non-empty string, got a number"),
    ('{"op": "diagnostics", "since_mono": ' + nested(100_000) + "}", "nested deeper than 16 levels"),
    ('{"op": "status", "x": ' + nested(20) + "}", "nested deeper than 16 levels"),
    ('[{"op": "status"}]', "a request is a JSON object, got an array"),
    ('{"op": "status"', "not JSON"),
])
def test_a_malformed_request_is_answered_bad_request_with_its_reason(line: str, reason: str) -> None:
    answer = _answer(line.encode() + b"\n")
    assert answer["ok"] is False and answer["error"].startswith(f"bad request: {reason}"), answer["error"]
    assert len(answer["error"]) < 300, "the reason is bounded, not the request echoed"


@FUZZ
@given(DEEP, st.sampled_from(sorted(protocol.AGENT_TO_CONTROLLER)))
def test_the_protocol_decoder_refuses_any_nesting_it_cannot_read(deep: str, message_type: str) -> None:
    for line in (deep.encode(), f'{{"v": 1, "type": "{message_type}", "x": {deep}}}'.encode()):
        try:
            message = protocol.decode(line, protocol.AGENT_TO_CONTROLLER)
        except protocol.ProtocolError:
            continue
        assert message["type"] == message_type


@FUZZ
@given(st.dictionaries(st.text(max_size=12), ODD_JSON, max_size=6))
def test_the_protocol_decoder_takes_any_numbers(fields: dict[str, Any]) -> None:
    line = json.dumps({**fields, "v": protocol.PROTOCOL_VERSION, "type": "heartbeat"}).encode() + b"\n"
    assert protocol.decode(line, protocol.AGENT_TO_CONTROLLER)["type"] == "heartbeat"


def test_the_protocol_decoder_refuses_a_hello_nested_too_deep_to_read() -> None:
    with pytest.raises(protocol.ProtocolError, match="nested too deeply"):
        protocol.decode(f'{{"v": 1, "type": "hello", "node": {nested(100_000)}}}'.encode(), frozenset({"hello"}))
    with pytest.raises(protocol.ProtocolError, match="not JSON"):
        protocol.decode(b'{"v": 1, "type": "hello", "node": 1' + b"0" * 5000 + b"}", frozenset({"hello"}))


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
