"""The dispatch channel: the trainer hands rollouts to agent workers and hears back from them (docs/protocol.md,
"Dispatch"). Each ZeroMQ message (after the trainer's ROUTER identity frame) is one MessagePack map
``{"v": VERSION, "t": tag, ...fields}``.

One frozen dataclass per message: its fields are the wire fields, its type hints the types ``decode_dispatch``
checks, and a field with a default may be left out on the wire. Fields this side does not know are ignored, so a
peer of the same version may send new optional ones. Every number, string and list a peer sends is bounded
(``_RULES``), so that whoever reaches the port cannot make the other side hold much.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from lit_sdk.protocol.codec import MAX_ID_CHARS, VERSION, ProtocolError, decode_map, packb, short_repr

ROLLOUT_STATUSES = ("succeeded", "failed", "timed_out")
MAX_SLOTS = 1024
"""The most rollouts one worker process may say it runs at once (``Hello.slots``)."""
MAX_LISTED = 4 * MAX_SLOTS
"""The most rollout ids one heartbeat may list (its running rollouts and its timed-out calls still running)."""
MAX_HOST_CHARS = 255
"""Characters in a host name (DNS's limit)."""
MAX_ERROR_CHARS = 8192
"""Characters in a ``Done.error``; a worker keeps the end of a longer one."""

# -- worker → trainer ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """A worker introduces itself: when it connects, and again when the trainer asks (``Who``)."""

    TAG: ClassVar[str] = "hello"
    slots: int
    """How many rollouts it runs at once; at least 1."""
    pid: int
    """Its process id (names the worker in the trainer's logs)."""
    host: str
    """Its host name (likewise)."""
    worker_id: str | None = None
    """Stable for the life of the worker process, unlike its ZeroMQ identity, which changes when it reconnects: the
    trainer takes a hello with a known ``worker_id`` as that worker come back, running what it ran."""


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Sent every ``heartbeat_s``: the trainer declares a worker silent for ``worker_timeout_s`` dead."""

    TAG: ClassVar[str] = "hb"
    running: int
    """How many rollouts it is running now."""
    rollouts: list[str] | None = None
    """The ids of the rollouts it runs, from the ``Run`` until its ``Done`` is sent, and of timed-out sync calls
    whose thread has not ended yet (they hold a slot). The trainer fails at once, and retries, an attempt a
    heartbeat stops listing without a ``Done``, and one that three heartbeats in a row never listed (its ``Run``
    was lost). Nil from a worker that does not say: the trainer then relies on ``worker_timeout_s`` alone."""


@dataclass(frozen=True, slots=True)
class Done:
    """One rollout attempt ended; the worker flushed its spans before saying so."""

    TAG: ClassVar[str] = "done"
    rollout_id: str
    """The ``rollout_id`` of the ``Run``."""
    attempt: int
    """The ``attempt`` of the ``Run``."""
    status: str
    """``succeeded`` (the agent returned), ``failed`` (it raised) or ``timed_out`` (it ran past ``timeout_s``)."""
    reward: float | None = None
    """The agent's return value when it was a number: for display only, the trainer reads rewards from spans."""
    error: str | None = None
    """What went wrong, for ``failed`` and ``timed_out``."""


@dataclass(frozen=True, slots=True)
class Bye:
    """A worker leaves before the trainer stopped it (Ctrl-C, SIGTERM, an error of its own): the trainer fails at
    once, and retries elsewhere, the attempts it was running, and hands it nothing more. A worker that leaves
    without a word is found out by ``worker_timeout_s`` of silence instead."""

    TAG: ClassVar[str] = "bye"
    reason: str
    """Why, in words (``Ctrl-C``, ``SIGTERM``, its error)."""


# -- trainer → worker ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Welcome:
    """The answer to ``Hello``: where the worker's agents deliver spans and which LLM endpoints to trace."""

    TAG: ClassVar[str] = "welcome"
    spans_endpoint: str
    """The collector's ZeroMQ endpoint (a wildcard or loopback host means the trainer's host)."""
    llm_base_urls: list[str] = field(default_factory=list)
    """The trainer's OpenAI-compatible base URLs, whose calls are recorded as LLM spans."""


@dataclass(frozen=True, slots=True)
class Run:
    """Run the agent function on one task, as one attempt of a rollout."""

    TAG: ClassVar[str] = "run"
    rollout_id: str
    """The attempt's id, unique in the store (``<request>-a<attempt>``); its spans carry it."""
    task_id: str
    """Which task of the data set."""
    attempt: int
    """1 for the first attempt, counting up on retries."""
    task: Any
    """The task itself, as the data set holds it: the agent function's first argument."""
    llm: dict[str, Any]
    """The ``lit.LLM`` to call, as ``LLM.to_dict()`` writes it: the agent function's second argument."""
    timeout_s: float
    """The worker cancels the attempt after this many seconds and reports it ``timed_out``."""
    weight_version: str | None = None
    """The policy weight version serving this rollout, when the trainer says; recorded on LLM spans."""
    secret: str | None = None
    """The attempt's secret: its root span carries it (``semconv.ROLLOUT_SECRET``), and the trainer stores a root
    only with the secret it handed out with this ``Run``."""


@dataclass(frozen=True, slots=True)
class Who:
    """The trainer does not know this worker (the trainer restarted): the worker answers with ``Hello``."""

    TAG: ClassVar[str] = "who"


@dataclass(frozen=True, slots=True)
class Stop:
    """The trainer is done: the worker cancels what it runs and exits."""

    TAG: ClassVar[str] = "stop"


ToTrainer = Hello | Heartbeat | Done | Bye
ToWorker = Welcome | Run | Who | Stop
DispatchMessage = ToTrainer | ToWorker
TO_TRAINER: tuple[type, ...] = (Hello, Heartbeat, Done, Bye)
TO_WORKER: tuple[type, ...] = (Welcome, Run, Who, Stop)

Rule = tuple[Callable[[Any], bool], str]


def _between(low: int, high: int) -> Rule:
    return (lambda n: low <= n <= high, f"between {low} and {high}")


def _chars(low: int, high: int) -> Rule:
    return (lambda s: low <= len(s) <= high, f"{low} to {high} characters long")


_ID = _chars(1, MAX_ID_CHARS)
_ATTEMPT = _between(1, 2**31 - 1)
_RULES: dict[tuple[type, str], Rule] = {
    (Hello, "slots"): _between(1, MAX_SLOTS),
    (Hello, "pid"): _between(0, 2**32 - 1),
    (Hello, "host"): _chars(0, MAX_HOST_CHARS),
    (Hello, "worker_id"): _ID,
    (Heartbeat, "running"): _between(0, MAX_LISTED),
    (Heartbeat, "rollouts"): (lambda ids: len(ids) <= MAX_LISTED and all(1 <= len(r) <= MAX_ID_CHARS for r in ids),
                              f"at most {MAX_LISTED} ids of 1 to {MAX_ID_CHARS} characters"),
    (Done, "rollout_id"): _ID,
    (Done, "attempt"): _ATTEMPT,
    (Done, "status"): (lambda s: s in ROLLOUT_STATUSES, "one of " + ", ".join(ROLLOUT_STATUSES)),
    (Done, "error"): _chars(0, MAX_ERROR_CHARS),
    (Bye, "reason"): _chars(0, MAX_ERROR_CHARS),
    (Run, "rollout_id"): _ID,
    (Run, "task_id"): _chars(0, MAX_ID_CHARS),
    (Run, "attempt"): _ATTEMPT,
    (Run, "timeout_s"): (lambda t: 0 < t < math.inf, "positive and finite"),
    (Run, "secret"): _chars(1, MAX_ID_CHARS),
}
"""What a field's type does not say: value checks (of a value that is not nil), with the words for a value that
fails them."""

_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7f, 0xa0))}
_ESCAPES_IN_TEXT = {c: e for c, e in _ESCAPES.items() if chr(c) not in "\n\t"}
_PRINTABLE: dict[tuple[type, str], dict[int, str]] = {
    (Hello, "host"): _ESCAPES,
    (Done, "error"): _ESCAPES_IN_TEXT,
    (Bye, "reason"): _ESCAPES_IN_TEXT,
}
"""Texts the trainer logs and stores: their control characters (a terminal's escape sequences, a carriage return
that overwrites a log line) arrive written out as ``\\xNN``; an error keeps its newlines and tabs."""


class _Field(NamedTuple):
    name: str
    type: Any
    required: bool
    to_float: bool
    """A ``float`` field: an integer on the wire (``300``) is taken as a float."""


def _members(tp: Any) -> tuple[Any, ...]:
    return typing.get_args(tp) if typing.get_origin(tp) in (types.UnionType, typing.Union) else (tp,)


def _spec(cls: type) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    missing = dataclasses.MISSING
    return tuple(
        _Field(f.name, hints[f.name], f.default is missing and f.default_factory is missing,
               float in _members(hints[f.name]))
        for f in dataclasses.fields(cls)
    )


_SPECS: dict[type, tuple[_Field, ...]] = {cls: _spec(cls) for cls in TO_TRAINER + TO_WORKER}
_BY_TAG: dict[str, type] = {cls.TAG: cls for cls in _SPECS}


def encode_dispatch(message: DispatchMessage) -> bytes:
    """The wire bytes of one message (every field written, ``None`` as nil)."""
    spec = _SPECS.get(type(message))
    if spec is None:
        raise TypeError(f"not a dispatch message: {type(message).__name__}")
    return packb({"v": VERSION, "t": message.TAG, **{f.name: getattr(message, f.name) for f in spec}})


def decode_dispatch(data: bytes, accept: tuple[type, ...] = TO_TRAINER + TO_WORKER) -> DispatchMessage:
    """Decode and validate one message; raise ProtocolError saying what is wrong. ``accept``: the message types
    this receiver takes (``TO_TRAINER`` or ``TO_WORKER``); another is refused (kind ``type``)."""
    obj = decode_map(data)
    tag = obj.get("t")
    cls = _BY_TAG.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError("type", f"unknown dispatch message type {tag!r} (known: {', '.join(_BY_TAG)})")
    if cls not in accept:
        way = "worker → trainer" if cls in TO_TRAINER else "trainer → worker"
        raise ProtocolError("type", f"a {tag!r} message goes {way}; it is not expected here")
    values = {}
    for f in _SPECS[cls]:
        if f.name not in obj:
            if f.required:
                raise ProtocolError("shape", f"a {tag!r} message lacks its field {f.name!r}")
            continue
        value = obj[f.name]
        if not _conforms(value, f.type):
            raise ProtocolError("shape", f"{tag!r} field {f.name!r} must be {_describe(f.type)}, got {_show(value)}")
        if f.to_float and type(value) is int:
            value = float(value)
        rule = _RULES.get((cls, f.name))
        if rule is not None and value is not None and not rule[0](value):
            raise ProtocolError("shape", f"{tag!r} field {f.name!r} must be {rule[1]}, got {_show(value)}")
        escapes = _PRINTABLE.get((cls, f.name))
        if escapes is not None and value is not None:
            value = value.translate(escapes)
        values[f.name] = value
    return cls(**values)


def _conforms(value: Any, tp: Any) -> bool:
    """Whether a decoded value has the type of a field (a boolean is not a number; binary is not a string)."""
    if tp is Any:
        return True
    members = _members(tp)
    if len(members) > 1:
        return any(_conforms(value, m) for m in members)
    if tp is type(None):
        return value is None
    if tp is int or tp is float:
        number = (int, float) if tp is float else int
        return isinstance(value, number) and not isinstance(value, bool)
    origin = typing.get_origin(tp)
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, typing.get_args(tp)[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, tp)


_WORDS = {int: "an integer", float: "a number", str: "a string", type(None): "nil", bool: "a boolean",
          bytes: "binary", list: "a list", dict: "a map"}
_PLURALS = {int: "integers", float: "numbers", str: "strings"}


def _describe(tp: Any) -> str:
    members = _members(tp)
    if len(members) > 1:
        return " or ".join(_describe(m) for m in members)
    if typing.get_origin(tp) is list:
        return f"a list of {_PLURALS.get(typing.get_args(tp)[0], 'values')}"
    return _WORDS.get(typing.get_origin(tp) or tp, getattr(tp, "__name__", str(tp)))


def _show(value: Any) -> str:
    """A value as an error message shows it: short, with its wire type."""
    text = short_repr(value)
    what = _WORDS.get(type(value), type(value).__name__)
    return what if value is None or isinstance(value, (list, dict)) else f"{text} ({what})"
