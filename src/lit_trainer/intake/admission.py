"""Which spans the store takes: only those of rollouts the trainer handed out, and only one root per attempt,
carrying the secret handed out with it.

The trainer hands each attempt out with a ``Run`` that carries a random secret (``Run.secret``, 128 bits), and
stores the secret with the rollout. The agent's root span carries it back (``semconv.ROLLOUT_SECRET``). A root
span decides a rollout's reward, so:

    a span of a rollout the store does not know         refused: unknown_rollout
    a root whose secret is not the attempt's            refused: wrong_secret
    a second root of an attempt (another span id)       refused: second_root   (the first one stays)

A peer that learned a rollout id (from a log, or by guessing) therefore cannot add a root of its own, nor a reward
with it. Its other spans may be stored, but they hang under no root: an episode is built from the spans reachable
from the root through their parent ids (intake/episodes.py drops orphans), and span ids are random 64-bit numbers
that travel only from the agent to the collector. So that such spans cannot fill the disk, or the trainer's memory
when it reads a rollout's spans to build its episode, the store takes at most ``MAX_ROLLOUT_SPANS`` spans and
``MAX_ROLLOUT_BYTES`` bytes of attributes and events per rollout attempt, and as much again of the spans outside
any rollout (which no episode uses); a root span is taken even then, being guarded by its secret:

    a span past its rollout's share (or past the share of spans outside rollouts)     refused: too_many_spans

Calls and rewards recorded by lit's own gateway are ``lit.engine.*`` spans that the trainer writes into the store
itself; a peer cannot send one (its token ids would be taken for the engine's, its reward for the rollout's):

    a span named lit.engine.* from a peer                                             refused: engine_span

The refusals are counted by kind in the collector's counts; the frame that carried them is still acknowledged, so
an honest sender does not send it again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lit_sdk import semconv
from lit_sdk.protocol import PackedSpan, codec

EXPLAINED = {
    "unknown_rollout": "a span of a rollout this trainer did not hand out (an agent of another run or trainer "
                       "sends here, or a peer forges spans)",
    "wrong_secret": "a rollout root span without the secret handed out with its attempt (a forged root, or an agent "
                    "run with lit.assign_rollout outside the trainer's workers)",
    "second_root": "a second root span for one rollout attempt (the first one stays)",
    "engine_span": "a span of the kinds only lit's gateway records (lit.engine.*), sent by a peer",
    "too_many_spans": "a span past what the store takes of one rollout, or of the spans outside any rollout "
                      "(admission.MAX_ROLLOUT_SPANS spans, MAX_ROLLOUT_BYTES bytes): a peer floods a rollout id, or "
                      "an agent makes far more calls than one episode can hold",
}
"""The kinds of refused span, in the collector's ``refused_spans`` counts, in words."""


MAX_ROLLOUT_SPANS = 50_000
"""Spans the store takes of one rollout attempt (an honest agent sends a few per LLM or tool call: a thousand-turn
agent some ten thousand)."""
MAX_ROLLOUT_BYTES = 256 * 2**20
"""Bytes of attributes and events the store takes of one rollout attempt: an LLM call with a 32k-token prompt
records some 250 kB (its token ids, its messages as text), so a thousand such calls fit."""


def is_root(span: PackedSpan) -> bool:
    """A rollout's root span: ``lit.rollout`` without a parent, in a rollout."""
    return span.parent_id is None and span.name == semconv.ROLLOUT_SPAN and span.rollout_id is not None


def secret_of(span: PackedSpan) -> object:
    """The secret a root span carries (None when it carries none, or its attributes do not decode as a map)."""
    try:
        attributes = codec.unpackb(span.attributes, strict_map_key=False)
    except ValueError:
        return None
    return attributes.get(semconv.ROLLOUT_SECRET) if isinstance(attributes, dict) else None


def _nothing_stored(rollout_ids: list[str | None]) -> dict[str | None, tuple[int, int]]:
    return {}


@dataclass
class Admission:
    """The admission of one store transaction's spans. ``lookup(rollout_ids)``: for each of those the store
    holds, its stored secret and the span id of its stored root (None: none yet); ``usage(rollout_ids)``: for each
    of those with spans stored (None: the spans outside any rollout), how many and their bytes of attributes and
    events. Each is asked once per rollout, for all of a batch's new rollout ids at once."""

    lookup: Callable[[list[str]], dict[str, tuple[str | None, str | None]]]
    usage: Callable[[list[str | None]], dict[str | None, tuple[int, int]]] = _nothing_stored
    _known: dict[str, tuple[str | None, str | None] | None] = field(default_factory=dict)
    _used: dict[str | None, list[int]] = field(default_factory=dict)
    """Spans and bytes stored so far (and taken in this transaction), by rollout id."""
    _new_roots: list[str] = field(default_factory=list)

    def admit(self, spans: Sequence[PackedSpan]) -> tuple[list[PackedSpan], dict[str, int], list[str]]:
        """The spans the store may take, in order; how many were refused, by kind; and the rollout ids whose root
        is among them for the first time (a root already stored, the same span id again, is a duplicate)."""
        self._new_roots = []
        new = list({s.rollout_id for s in spans if s.rollout_id not in self._used})
        if new:
            known = [rollout_id for rollout_id in new if rollout_id is not None]
            found = self.lookup(known) if known else {}
            self._known.update((rollout_id, found.get(rollout_id)) for rollout_id in known)
            used = self.usage(new)
            self._used.update((rollout_id, list(used.get(rollout_id, (0, 0)))) for rollout_id in new)
        admitted: list[PackedSpan] = []
        refused: dict[str, int] = {}
        known, used, root_name, engine = self._known, self._used, semconv.ROLLOUT_SPAN, semconv.ENGINE_PREFIX
        for span in spans:
            rollout_id = span.rollout_id
            if span.name.startswith(engine):
                kind: str | None = "engine_span"
            elif known.get(rollout_id) is not None and (span.parent_id is not None or span.name != root_name):
                # the common case, decided inline: a non-root span of a known rollout, within its share
                kind = None if _take(used[rollout_id], span) else "too_many_spans"
            else:
                kind = self.refusal(span)
            if kind is None:
                admitted.append(span)
            else:
                refused[kind] = refused.get(kind, 0) + 1
        return admitted, refused, self._new_roots

    def refusal(self, span: PackedSpan) -> str | None:
        """Why ``span`` is refused (a kind of ``EXPLAINED``), or None when the store may take it. A span taken
        here counts as stored for the rest of the transaction."""
        rollout_id = span.rollout_id
        if rollout_id not in self._used:
            self._used[rollout_id] = list(self.usage([rollout_id]).get(rollout_id, (0, 0)))
        if rollout_id is None:  # a span outside any rollout: stored, never part of an episode
            return None if _take(self._used[None], span) else "too_many_spans"
        if rollout_id not in self._known:
            self._known[rollout_id] = self.lookup([rollout_id]).get(rollout_id)
        known = self._known[rollout_id]
        if known is None:
            return "unknown_rollout"
        if not is_root(span):
            return None if _take(self._used[rollout_id], span) else "too_many_spans"
        secret, root = known
        if secret_of(span) != secret:
            return "wrong_secret"
        if root is not None and root != span.span_id:  # the same root again is a duplicate, not a second one
            return "second_root"
        if root is None:
            self._new_roots.append(rollout_id)
        self._known[rollout_id] = (secret, span.span_id)
        _take(self._used[rollout_id], span, always=True)  # guarded by its secret: never crowded out
        return None


def _take(used: list[int], span: PackedSpan, always: bool = False) -> bool:
    """Count ``span`` in ``used`` ([spans, bytes] of its rollout) if it is within the share (or ``always``)."""
    size = len(span.attributes) + len(span.events)
    if not always and (used[0] >= MAX_ROLLOUT_SPANS or used[1] + size > MAX_ROLLOUT_BYTES):
        return False
    used[0] += 1
    used[1] += size
    return True
