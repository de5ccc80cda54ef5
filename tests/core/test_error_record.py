"""``wtcore.errors.ErrorRecord``: the one JSON form of an error, on every transport.

Round trips for every wtcore error class (the record, its JSON, the exception it becomes
again), and a hostile peer's dicts refused with the field named. The transports' own tests
(tests/http_client, tests/core/test_pipes.py) check that each one answers with it.
"""

from __future__ import annotations

import json
import pickle
from http import HTTPStatus
from typing import Any

import pytest

import wtcore.errors as errors
from wtcore.errors import (
    MAX_MESSAGE_CHARS,
    ErrorRecord,
    PayloadError,
    PluginLoadError,
    ProtocolStateError,
    ReceiverError,
    ReceiverFailure,
    RemoteError,
    TransferError,
    TransferTimeoutError,
    WtcoreError,
    http_status,
)
from wtcore_kit.fanout import failure_of

#: Every exception class of wtcore that a message alone builds (ReceiverError takes failures).
CLASSES = [
    getattr(errors, name)
    for name in errors.__all__
    if isinstance(getattr(errors, name), type)
    and issubclass(getattr(errors, name), WtcoreError)
    and not issubclass(getattr(errors, name), (ReceiverError, RemoteError))
]


def test_the_classes_are_all_there() -> None:
    names = {c.__name__ for c in CLASSES}
    assert names == {
        "WtcoreError",
        "PayloadError",
        "ProtocolStateError",
        "TransferError",
        "VerificationError",
        "TransferTimeoutError",
        "PluginLoadError",
    }


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_round_trip_of_each_wtcore_error(cls: type[WtcoreError]) -> None:
    original = cls("it went wrong: 'x'")
    record = ErrorRecord.from_exception(original)
    assert record == ErrorRecord(cls.__name__, "it went wrong: 'x'", http_status(original))
    wire = json.loads(json.dumps(record.to_json()))
    assert wire == {"error": record.message, "error_type": cls.__name__, "status": record.status}
    assert ErrorRecord.from_json(wire) == record

    again = record.to_exception("w0.update_weights")
    # caught as the local class (and its builtin), named like it, and still a peer's error
    assert isinstance(again, cls) and isinstance(again, RemoteError)
    assert type(again).__name__ == cls.__name__
    assert str(again) == f"w0.update_weights: {cls.__name__}: it went wrong: 'x'"
    assert again.record == record and again.status == record.status == http_status(again)
    # it crosses the transport a second time unchanged (a relay), and pickles (Ray)
    assert ErrorRecord.from_exception(again) == record
    unpickled = pickle.loads(pickle.dumps(again))
    assert type(unpickled) is type(again) and unpickled.record == record
    assert str(unpickled) == str(again)


def test_statuses_are_the_one_table() -> None:
    expected: list[tuple[WtcoreError, int]] = [
        (PayloadError("x"), 400),
        (PluginLoadError("x", "not-found"), 404),
        (ProtocolStateError("x"), 409),
        (TransferError("x"), 500),
        (TransferTimeoutError("x"), 504),
    ]
    expected += [
        (PluginLoadError("x", r), 500) for r in ("conflict", "wrong-type", "api", "import")
    ]
    for error, status in expected:
        assert ErrorRecord.from_exception(error).status == status, repr(error)
    # 0.1.0's names of merged classes are the merged class
    assert errors.WrongTypeError is errors.MetadataMismatchError is PayloadError
    assert errors.PluginNotFoundError is PluginLoadError
    assert ErrorRecord.from_exception(RuntimeError("x")) == ErrorRecord("RuntimeError", "x", 500)


def test_a_plugins_own_class_keeps_its_name_and_status() -> None:
    """wtcore-delta's StaleBaseError (a ProtocolStateError there) from a receiver: the trainer
    reads its name in the failure (to resend in full) and 409 as the status."""
    e = ErrorRecord("StaleBaseError", "delta round refused", 409).to_exception("w0")
    assert type(e) is RemoteError and http_status(e) == 409
    failure = failure_of("w0", e)
    assert (failure.error_type, failure.status) == ("StaleBaseError", 409)


def test_a_peers_plugin_error_keeps_its_status() -> None:
    e = ErrorRecord.from_exception(PluginLoadError("unknown engine 'x'", "not-found"))
    again = e.to_exception()
    assert isinstance(again, PluginLoadError) and isinstance(again, LookupError)
    assert http_status(again) == 404


def test_a_receiver_error_keeps_its_name_but_not_its_class() -> None:
    err = ReceiverError.of("start", [ReceiverFailure("w0", "slow", None, None, True)], 2)
    record = ErrorRecord.from_exception(err)
    assert (record.type, record.status) == ("ReceiverTimeoutError", 504)
    again = record.to_exception()
    assert type(again) is RemoteError and again.record.type == "ReceiverTimeoutError"


@pytest.mark.parametrize(
    "name", ["SomethingOnlyTheChildKnows", "KeyError", "SystemExit", "http_status",
             "ReceiverFailure", "__class__", "wtcore.errors.PayloadError", "AuthError"],
)  # fmt: skip
def test_other_names_give_the_generic_class(name: str) -> None:
    """A peer's name is never looked up: only wtcore's own classes are mapped back."""
    e = ErrorRecord(name, "boom", 500).to_exception()
    assert type(e) is RemoteError and isinstance(e, RuntimeError) and isinstance(e, WtcoreError)
    assert e.record.type == name and str(e) == f"{name}: boom"


def test_extra_keys_are_the_envelopes() -> None:
    msg = {"id": 3, "ok": False, "error": "x", "error_type": "PayloadError", "status": 400}
    assert ErrorRecord.from_json(msg) == ErrorRecord("PayloadError", "x", 400)


_GOOD: dict[str, Any] = {"error": "x", "error_type": "PayloadError", "status": 400}


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        ([1, 2], "error_record: expected a JSON object"),
        ("PayloadError: x", "error_record: expected a JSON object"),
        (None, "error_record: expected a JSON object"),
        ({"error_type": "X", "status": 500}, "error_record.error: missing"),
        ({"error": "x", "status": 500}, "error_record.error_type: missing"),
        ({"error": "x", "error_type": "X"}, "error_record.status: missing"),
        ({**_GOOD, "error": 3}, "error_record.error: expected a string, got int 3"),
        ({**_GOOD, "error": {"nested": 1}}, "error_record.error: expected a string"),
        ({**_GOOD, "error": "m" * (MAX_MESSAGE_CHARS + 1)},
         f"error_record.error: {MAX_MESSAGE_CHARS + 1} characters, over the limit"),
        ({**_GOOD, "error_type": None}, "error_record.error_type: expected a string"),
        ({**_GOOD, "error_type": ["PayloadError"]}, "error_record.error_type: expected a string"),
        ({**_GOOD, "error_type": ""}, "error_record.error_type: expected a class name"),
        ({**_GOOD, "error_type": "Payload Error"}, "error_record.error_type: expected a class"),
        ({**_GOOD, "error_type": "1Error"}, "error_record.error_type: expected a class name"),
        ({**_GOOD, "error_type": "E" * 129}, "error_record.error_type: expected a class name"),
        ({**_GOOD, "error_type": "Error\n"}, "error_record.error_type: expected a class name"),
        ({**_GOOD, "error_type": "<script>"}, "error_record.error_type: expected a class name"),
        ({**_GOOD, "status": "400"}, "error_record.status: expected an integer, got str"),
        ({**_GOOD, "status": 400.0}, "error_record.status: expected an integer, got float"),
        ({**_GOOD, "status": True}, "error_record.status: expected an integer, got bool"),
        ({**_GOOD, "status": None}, "error_record.status: expected an integer"),
        ({**_GOOD, "status": 200}, "error_record.status: expected an HTTP error status"),
        ({**_GOOD, "status": 600}, "error_record.status: expected an HTTP error status"),
        ({**_GOOD, "status": -1}, "error_record.status: expected an HTTP error status"),
        ({**_GOOD, "status": 10**30}, "error_record.status: expected an HTTP error status"),
    ],
)  # fmt: skip
def test_a_hostile_dict_is_refused_naming_the_field(obj: object, field: str) -> None:
    with pytest.raises(PayloadError) as err:
        ErrorRecord.from_json(obj)
    assert str(err.value).startswith(field), str(err.value)
    assert len(str(err.value)) < 300  # a huge value is not echoed back


def test_a_long_message_is_cut_here_and_refused_from_a_peer() -> None:
    record = ErrorRecord.from_exception(RuntimeError("m" * (4 * MAX_MESSAGE_CHARS)))
    assert len(record.message) == MAX_MESSAGE_CHARS and record.message.endswith("(cut)")
    assert ErrorRecord.from_json(record.to_json()) == record  # what is sent is accepted
    exact = "m" * MAX_MESSAGE_CHARS
    assert ErrorRecord.from_json({**_GOOD, "error": exact}).message == exact
    # a multi-line message (a ReceiverError's) is fine
    assert ErrorRecord.from_json({**_GOOD, "error": "a\n  - b"}).message == "a\n  - b"


def test_a_record_made_here_is_checked_too() -> None:
    with pytest.raises(PayloadError, match="ErrorRecord.type: expected a class name"):
        ErrorRecord("not a name", "x", 500)
    with pytest.raises(PayloadError, match="ErrorRecord.status: expected an HTTP error status"):
        ErrorRecord("X", "x", 200)
    with pytest.raises(PayloadError, match="ErrorRecord.message: expected a string"):
        ErrorRecord("X", 5, 500)  # type: ignore[arg-type]
    record = ErrorRecord("HTTPError", "x", HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)
    assert type(record.status) is int and record.to_json()["status"] == 431


def test_from_exception_survives_odd_exceptions() -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    record = ErrorRecord.from_exception(Unprintable())
    assert record.type == "Unprintable" and "str() failed" in record.message
    odd = type("weird name!", (ValueError,), {})
    assert ErrorRecord.from_exception(odd("x")).type == "weird_name_"
    assert ErrorRecord.from_exception(type("9lives", (Exception,), {})()).type == "_9lives"
    assert ErrorRecord.from_exception(type("", (Exception,), {})()).type == "_"


def test_a_peers_status_is_kept() -> None:
    """A status the peer gave (401 from an HTTP receiver's auth) is what the error reports."""
    e = ErrorRecord("AuthError", "invalid API key", 401).to_exception("POST /x")
    assert e.status == 401 and http_status(e) == 401
    assert ErrorRecord.from_exception(e).status == 401
    failure = failure_of("http://a", e)
    assert (failure.error_type, failure.message, failure.status) == (
        "AuthError",
        "invalid API key",
        401,
    )
