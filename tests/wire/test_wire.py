"""The frame format: every message round-trips; every malformed message is a BadRequest naming why."""

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libbus import PROTOCOL
from libbus.errors import ERROR_CODES, BadRequest, BusError, PeerTimeout, TooLarge, error_from_code
from libbus.wire.messages import (
    MESSAGE_TYPES,
    BatchRequest,
    BatchResponse,
    Evaluate,
    Hello,
    Progress,
    decode,
    encode,
    request_id_of,
)


def head(**fields) -> bytes:
    return orjson.dumps(fields)


def test_hello_round_trips_with_every_field():
    msg = Hello(
        id=7, role="trainer", name="t1", token="abc", host_id="h", pid=12, version="0.1", caps={"heartbeat": True}
    )
    frames = encode(msg)
    assert frames[0] == PROTOCOL
    assert decode(frames) == msg


def test_payload_frames_travel_apart_from_the_header():
    msg = BatchResponse(id=3, shapes=[[2, 2], [2]], dtypes=["<f4", "<i8"], nbytes=32, frames=[b"\0" * 16, b"\1" * 16])
    frames = encode(msg)
    assert frames[2:] == [b"\0" * 16, b"\1" * 16]
    assert b"\\u0000" not in frames[1] and b"frames" not in frames[1]
    out = decode(frames)
    assert out.frames == msg.frames and out.shapes == [[2, 2], [2]]


@pytest.mark.parametrize(
    "frames, words",
    [
        ([PROTOCOL], "at least 2 frames"),
        ([b"XX9", head(type="Stats")], "protocol tag"),
        ([PROTOCOL, b"{not json"], "not valid JSON"),
        ([PROTOCOL, b"[1, 2]"], "JSON object"),
        ([PROTOCOL, head(type="Nope")], "unknown message type"),
        ([PROTOCOL, head(id=1)], "unknown message type"),
        ([PROTOCOL, head(type="Hello", role="trainer", name="x")], "missing field 'token'"),
        ([PROTOCOL, head(type="Hello", role=1, name="x", token="t")], "Hello.role must be a string"),
        ([PROTOCOL, head(type="BatchRequest", dataset="d", split="train", range="0:3")], "range must be"),
        ([PROTOCOL, head(type="BatchRequest", dataset="d", split="train"), b"a", b"b"], "payload frame"),
        ([PROTOCOL, head(type="Evaluate", dataset="d", model={})], "payload frame"),
        ([PROTOCOL, head(type="Progress", job="j", progress={}, id=True)], "Progress.id must be an integer"),
    ],
)
def test_malformed_messages_are_bad_requests_that_say_why(frames, words):
    with pytest.raises(BadRequest, match=words):
        decode(frames)


def test_too_many_frames_is_too_large():
    with pytest.raises(TooLarge):
        decode([PROTOCOL, head(type="Stats")] + [b"x"] * 100)


def test_request_id_survives_a_bad_message_so_the_error_can_be_matched():
    assert request_id_of([PROTOCOL, head(type="Nope", id=42)]) == 42
    assert request_id_of([PROTOCOL, b"garbage"]) == 0


def test_every_wire_code_maps_back_to_its_exception_class():
    for code, cls in ERROR_CODES.items():
        err = error_from_code(code, "m")
        assert type(err) is cls and err.code == code and str(err) == "m"
    assert isinstance(PeerTimeout("x"), TimeoutError)
    unknown = error_from_code("SOMETHING_NEW", "m")
    assert type(unknown) is BusError and unknown.code == "SOMETHING_NEW"


def test_every_message_type_is_registered_once():
    assert {
        "Hello",
        "Welcome",
        "BatchRequest",
        "BatchResponse",
        "Evaluate",
        "SubmitJob",
        "GetTask",
        "PushResult",
        "Command",
        "Error",
    } <= set(MESSAGE_TYPES)
    assert Progress.type == "Progress" and BatchRequest.nframes == (0, 1) and Evaluate.nframes == (1, 1)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.binary(max_size=64), max_size=5),
    st.dictionaries(
        st.sampled_from(["type", "id", "dataset", "split", "range", "role", "token", "name"]),
        st.one_of(
            st.none(),
            st.integers(-(2**63), 2**63 - 1),
            st.text(max_size=8),
            st.sampled_from(list(MESSAGE_TYPES)),
            st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3),
        ),
        max_size=6,
    ),
)
def test_decode_never_fails_with_anything_but_a_bus_error(extra, header):
    for frames in ([PROTOCOL, orjson.dumps(header), *extra], extra):
        try:
            decode(frames)
        except BusError:
            pass


def test_an_older_wire_version_is_refused_naming_both_and_answered_under_its_tag():
    from libbus.wire.messages import error_reply

    with pytest.raises(BadRequest, match=r"version 1 \(b'BB1'\), this service version 2 \(b'BB2'\)") as caught:
        decode([b"BB1", head(type="Stats", id=4)])
    assert encode(error_reply(4, caught.value))[0] == b"BB1"  # the old peer can read its refusal
    assert encode(error_reply(4, BadRequest("x")))[0] == PROTOCOL


def test_every_registered_message_is_exported_once_by_its_family_and_the_face():
    from libbus.wire import messages, msg_data, msg_jobs, msg_session

    families = {m.__name__: m.__all__ for m in (msg_session, msg_data, msg_jobs)}
    for name, cls in MESSAGE_TYPES.items():
        assert cls.type == name and name in families[cls.__module__], f"{name} missing from its family's __all__"
        assert getattr(messages, name) is cls
    assert len(messages.__all__) == len(set(messages.__all__))
    assert set(MESSAGE_TYPES) <= set(messages.__all__)


def test_a_message_name_declared_twice_is_refused_at_import():
    from libbus.wire.frames import Message, message

    with pytest.raises(TypeError, match="'Ok' is declared twice"):

        @message
        class Ok(Message):  # noqa: F811 - the clash is the point
            pass

    assert MESSAGE_TYPES["Ok"].__module__ == "libbus.wire.msg_session"


def test_every_request_names_its_reply_types_and_they_are_messages():
    from libbus.wire.messages import ControlJob, GetJob, GetTask, JobInfo, Model, NoTask, Ok, Request, Task

    requests = {name: cls for name, cls in MESSAGE_TYPES.items() if issubclass(cls, Request)}
    assert len(requests) >= 25
    for cls in requests.values():
        assert cls.reply_types() and all(r.type in MESSAGE_TYPES for r in cls.reply_types())
    assert GetJob.reply_types() == (JobInfo,)
    assert ControlJob.reply_types() == (Ok, Model) and GetTask.reply_types() == (Task, NoTask)


def test_a_handler_serves_what_its_methods_are_marked_with_mixins_included():
    from libbus.serve.handler import Handler, serves
    from libbus.wire.messages import GetJob, JobInfo, Stats, StatsReply

    class Mixin:
        @serves(Stats, "admin", "trainer")
        def on_stats(self, session, msg):
            return StatsReply(services={"seen": msg.id})

    class Service(Mixin, Handler):
        @serves(GetJob, "admin")
        def on_get_job(self, session, msg):
            return JobInfo(job={"id": msg.job})

    assert Service.roles == {"Stats": ("admin", "trainer"), "GetJob": ("admin",)}
    service = Service()
    assert service.handle(None, GetJob(job="j1")).job == {"id": "j1"}
    assert service.handle(None, Stats(id=4)).services == {"seen": 4}
    with pytest.raises(BadRequest, match="Service does not serve Hello"):
        service.handle(None, Hello(role="admin", name="a", token="t"))
    with pytest.raises(TypeError, match="names no role"):
        serves(GetJob)
