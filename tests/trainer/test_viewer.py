"""The rollout viewer: real spans in a real SQLite store, rendered to HTML and read back with an HTML parser, and
the advantages that the update pipeline keeps for it."""

from __future__ import annotations

import html
import json
import math
from html.parser import HTMLParser
from pathlib import Path

import pytest

from lit_sdk import semconv as sc
from lit_sdk.protocol import STATUS_ERROR, STATUS_OK, SpanRecord
from lit_trainer.algorithm.advantages import episode_advantages
from lit_trainer.cli import main
from lit_trainer.config import TrainConfig
from lit_trainer.intake.episodes import Episode, Transition, build_episode
from lit_trainer.intake.rows import AdvantageRow, RolloutRow, RolloutStatus
from lit_trainer.intake.store import SqliteStore
from lit_trainer.results import viewer
from lit_trainer.results.runs import Run, RunFolder
from lit_trainer.run.pipeline import prepare

TRACE = "ab" * 16
SCRIPT = "<script>alert(1)</script>"


class Rollout:
    """One rollout's spans, built like lit's span processor stamps them; times in ticks."""

    def __init__(self, rollout_id: str, task_id: str = "t1") -> None:
        self.rollout_id, self.task_id = rollout_id, task_id
        self.spans: list[SpanRecord] = []

    def add(self, name: str, parent: str | None, start: int, status: int = STATUS_OK, message: str = "",
            **attrs: object) -> str:
        span_id = format(len(self.spans) + 1, "016x")
        self.spans.append(SpanRecord(TRACE, span_id, parent, name, start, start + 5, status, message,
                                     self.rollout_id, {sc.ROLLOUT_ID: self.rollout_id, sc.TASK_ID: self.task_id,
                                                       sc.ATTEMPT: 1, **attrs}))
        return span_id

    def call(self, parent: str, start: int, agent: str, prompt: list[int], response: list[int]) -> str:
        logprobs = [-0.05 * (i + 1) for i in range(len(response))]
        return self.add(sc.LLM_SPAN, parent, start, **{
            sc.AGENT_NAME: agent, sc.LLM_PROMPT_TOKEN_IDS: prompt, sc.LLM_RESPONSE_TOKEN_IDS: response,
            sc.LLM_RESPONSE_LOGPROBS: logprobs, sc.LLM_FINISH_REASON: "stop", sc.LLM_TEMPERATURE: 0.7})

    def store(self, store: SqliteStore, step: int = 0) -> Episode:
        """Store the spans, the rollout row and the episode, as a training step does."""
        store.add_spans(self.spans)
        store.add_rollouts([RolloutRow(self.rollout_id, self.task_id, step, status=RolloutStatus.RUNNING)])
        store.set_rollout_status(self.rollout_id, RolloutStatus.SUCCEEDED)
        episode = build_episode(self.spans)
        assert isinstance(episode, Episode)
        store.save_episode(self.rollout_id, episode.to_dict(), episode.episode_return)
        return episode


class Tokens(HTMLParser):
    """Every token span of a page: (call number or 0, part, text, attributes); the parts are "legend", "prompt",
    "prompt-tail" (the end of the prompt, shown while it is folded) and "response"."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[tuple[int, str, str, dict[str, str | None]]] = []
        self.call, self.part, self.open = 0, "legend", None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if "call" in classes:
            self.call = int((a["id"] or "").rpartition("c")[2])
        for part in ("prompt", "prompt-tail", "response"):
            if part in classes:
                self.part = part
        if tag == "span" and "tok" in classes:
            self.open = [self.call, self.part, "", a]

    def handle_data(self, data: str) -> None:
        if self.open is not None:
            self.open[2] += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "span" and self.open is not None:
            self.tokens.append(tuple(self.open))
            self.open = None

    def of(self, call: int, part: str) -> list[tuple[str, dict[str, str | None]]]:
        return [(text, attrs) for c, p, text, attrs in self.tokens if c == call and p == part]


def tokens_of(page: str) -> Tokens:
    parser = Tokens()
    parser.feed(page)
    return parser


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"model": "smollm2-135m"}))
    return tmp_path


@pytest.fixture(scope="module")
def tokenizer(prepared_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(prepared_model)


def test_one_call_rollout_shows_its_tokens_decoded_coloured_and_escaped(run_dir, tokenizer):
    prompt = tokenizer(f"What is 2+3? {SCRIPT}")["input_ids"]
    response = tokenizer(" The answer is 5.\nDone")["input_ids"]
    r = Rollout("s0-t1-g0")
    root = r.add(sc.ROLLOUT_SPAN, None, 0, **{sc.ROLLOUT_NAME: "calc_agent", sc.ROLLOUT_RETURN_REWARD: 1.0,
                                              sc.ROLLOUT_INPUT: json.dumps({"question": SCRIPT})})
    r.call(root, 1, "calc", prompt, response)
    with SqliteStore(run_dir / "lit.sqlite") as store:
        r.store(store)
        store.save_advantages([AdvantageRow(r.rollout_id, 0, 1, 0.75)])
    with Run(run_dir) as run:  # the run's store, and its model's tokenizer
        page = run.show(r.rollout_id)._repr_html_()

    assert "<script" not in page
    assert html.escape(json.dumps({"question": SCRIPT})) in page  # the rollout's input, in the header
    parsed = tokens_of(page)
    prompt_tokens, response_tokens = parsed.of(1, "prompt"), parsed.of(1, "response")
    assert [text for text, _ in prompt_tokens] == [tokenizer.decode([i]) for i in prompt]
    assert "".join(text for text, _ in prompt_tokens).endswith(SCRIPT)  # shown as text, not run
    assert [text for text, _ in response_tokens] == [tokenizer.decode([i]).replace("\n", "↵\n") for i in response]
    for k, (_, attrs) in enumerate(response_tokens):
        assert attrs["data-adv"] == "0.7500"
        assert attrs["data-lp"] == f"{-0.05 * (k + 1):.4f}"
        assert "--a:rgba(26,127,55,0.475)" in (attrs["style"] or "")  # green, 0.1 + 0.5 * 0.75
        assert f"id {response[k]} " in (attrs["title"] or "")
    assert all("data-adv" not in attrs and "style" not in attrs for _, attrs in prompt_tokens)
    for text in ("lit.rollout", "lit.llm", "calc_agent", "returned +1", "advantage +0.7500", "agent calc",
                 "final reward</td><td>+1", "succeeded"):
        assert text in page


def test_multi_call_rollout_shows_each_call_its_advantage_and_where_rewards_attach(tmp_path):
    r = Rollout("s0-t7-g1", task_id="t7")
    root = r.add(sc.ROLLOUT_SPAN, None, 0, **{sc.ROLLOUT_NAME: "sql_agent", sc.ROLLOUT_RETURN_REWARD: 0.5})
    node = r.add("writer_node", root, 1, **{sc.OI_SPAN_KIND: "CHAIN", sc.OI_GRAPH_NODE_ID: "writer"})
    r.call(node, 2, "writer", [1, 2, 3], [10, 11, 12])
    r.add("run_query", node, 10, status=STATUS_ERROR, message=f"no such table {SCRIPT}",
          **{sc.OI_SPAN_KIND: "TOOL"})
    r.add(sc.REWARD_SPAN, node, 11, **{sc.REWARD_VALUE: 0.25, sc.REWARD_NAME: "<b>format</b>"})
    r.call(root, 20, "checker", [1, 2, 3, 10, 11, 12, 4], [20, 21])
    with SqliteStore(tmp_path / "lit.sqlite") as store:
        episode = r.store(store)
        store.save_advantages([AdvantageRow(r.rollout_id, 0, 1, 0.5), AdvantageRow(r.rollout_id, 1, 1, -1.25)])
        store.save_trainer_logprobs([(r.rollout_id, 0, [-0.05, -0.12, -0.35])])  # call 2: not trained on
        page = viewer.view_rollout(store, r.rollout_id).html()

    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "<b>format" not in page
    assert "http://" not in page and "https://" not in page and "src=" not in page  # self-contained
    parsed = tokens_of(page)
    for call, prompt, response, advantage in ((1, [1, 2, 3], [10, 11, 12], "0.5000"),
                                              (2, [1, 2, 3, 10, 11, 12, 4], [20, 21], "-1.2500")):
        assert [text for text, _ in parsed.of(call, "prompt")] == [f"[{i}]" for i in prompt]  # no tokenizer: ids
        assert [text for text, _ in parsed.of(call, "response")] == [f"[{i}]" for i in response]
        assert {attrs["data-adv"] for _, attrs in parsed.of(call, "response")} == {advantage}
    assert "--a:rgba(207,34,46,0.600)" in page  # red at full colour: |-1.25| >= 1
    # the trainer-vs-engine gap: trainer minus engine logprob (engine: -0.05, -0.10, -0.15), where the update kept it
    assert [attrs["data-gap"] for _, attrs in parsed.of(1, "response")] == ["0.000e+00", "-2.000e-02", "-2.000e-01"]
    assert all("data-gap" not in attrs for _, attrs in parsed.of(2, "response"))
    assert "--g:rgba(130,80,223,0.700)" in page and "colour by trainer − engine logprob gap" in page
    assert [t.reward for t in episode.transitions] == [0.25, None]
    assert "&#x27;&lt;b&gt;format&lt;/b&gt;&#x27; +0.25</span> → <a href=" in page  # the reward, in the tree
    assert "reward +0.25 attached" in page  # on call #1's card
    for text in ("lit.rollout", "lit.llm", "lit.reward", "writer_node", "run_query", "agent writer",
                 "agent checker", "TOOL", f"error: no such table {SCRIPT.replace('<', '&lt;').replace('>', '&gt;')}",
                 "transition 1", "advantage -1.2500", "tokens</td><td>shown as ids"):
        assert text in page


def test_a_rollout_without_saved_advantages_or_episode_says_so(tmp_path):
    r = Rollout("s0-t2-g0")
    root = r.add(sc.ROLLOUT_SPAN, None, 0, status=STATUS_ERROR, message="agent crashed")
    r.call(root, 1, "calc", [1, 2], [3])
    with SqliteStore(tmp_path / "lit.sqlite") as store:
        store.add_spans(r.spans)
        page = viewer.view_rollout(store, r.rollout_id)._repr_html_()
        with pytest.raises(ValueError, match="no rollout 'nope'"):
            viewer.view_rollout(store, "nope")
    assert "unusable: the rollout failed" in page and "agent crashed" in page
    assert "not trained on" in page and "data-adv" not in page and "data-lp" in page


@pytest.mark.parametrize(("status", "attempt", "says"), [
    (RolloutStatus.TIMED_OUT, 1, "never trained: its attempt ended timed_out"),
    (RolloutStatus.FAILED, 1, "never trained: its attempt ended failed"),
    (RolloutStatus.SUCCEEDED, 2, "unusable: the root span's task id or attempt is not the one the trainer handed "
                                 "out with the rollout (task 't1' attempt 1; handed out: task 't1' attempt 2)"),
    (RolloutStatus.SUCCEEDED, 1, None),
], ids=["timed out", "failed", "another attempt", "its own attempt"])
def test_a_root_the_trainer_refused_to_train_is_shown_as_refused(tmp_path, status, attempt, says):
    """#64: a root stored for an attempt that had timed out (a slow agent's, or a forged one from a peer holding
    the attempt's secret) was never trained, yet the page rebuilt its episode and showed its return as the
    rollout's. Now the page says why the trainer refused it, as it does for a root naming another attempt; the
    spans stay on the page, every call marked as not trained on."""
    r = Rollout("s0-t1-g0-a1")
    root = r.add(sc.ROLLOUT_SPAN, None, 0, **{sc.ROLLOUT_RETURN_REWARD: 1.0})
    r.call(root, 1, "calc", [1, 2], [3])
    with SqliteStore(tmp_path / "lit.sqlite") as store:
        store.add_spans(r.spans)
        store.add_rollouts([RolloutRow(r.rollout_id, "t1", 0, attempt, status=RolloutStatus.RUNNING)])
        store.set_rollout_status(r.rollout_id, status, None if status == RolloutStatus.SUCCEEDED else "late")
        page = viewer.view_rollout(store, r.rollout_id)._repr_html_()
    if says is None:
        assert "+1 (not stored by the trainer: rebuilt from the spans for this page)" in page
    else:
        assert html.escape(says, quote=True) in page and '<td class="k">return</td>' not in page
        assert "not trained on: agent not selected" in page and "data-adv" not in page


SESSION = "0a1b2c3d"
"""A run's session: rollout ids start with it, then the label of what they ran for (steps.py)."""


def fill_run(store: SqliteStore, rollouts: list[tuple[str, int, int]]) -> list[str]:
    """Store one rollout per (label, recorded step, reward) with the id the rollout runner gives it; the ids."""
    ids = []
    for k, (label, recorded, reward) in enumerate(rollouts):
        r = Rollout(f"{SESSION}-{label}-t1-g{k}-a1")
        root = r.add(sc.ROLLOUT_SPAN, None, 0, **{sc.ROLLOUT_RETURN_REWARD: float(reward)})
        r.call(root, 1, "calc", [1, 2], [3, 4])
        r.store(store, recorded)
        ids.append(r.rollout_id)
    return ids


def listed(capsys) -> tuple[str, list[list[str]]]:
    """What the last ``lit show --run`` printed: its line on stderr, and the table's rows."""
    captured = capsys.readouterr()
    return captured.err, [line.split() for line in captured.out.splitlines()[1:]]


def test_lit_show_writes_the_page_and_lists_the_last_training_steps_rollouts(run_dir, capsys):
    """Recorded as a 2-step run records them: the validation before training and training step 1 under store step
    0, step 2 under 1, the final validation under 2. ``lit show`` counts as the console does."""
    with SqliteStore(run_dir / "lit.sqlite") as store:
        val0, step1, step2_a, step2_b, val2 = fill_run(store, [("val0", 0, 0), ("s0", 0, 0), ("s1", 1, 0),
                                                               ("s1", 1, 1), ("val2", 2, 1)])
    assert main(["show", step2_b, "--run", str(run_dir)]) == 0
    written = run_dir / "rollouts" / f"{step2_b}.html"
    assert capsys.readouterr().out.strip() == str(written)
    page = written.read_text()
    assert f"Rollout {step2_b}" in page and "training step 2, attempt 1" in page and "from 0" not in page
    assert main(["show", val2, "--run", str(run_dir), "--output", str(run_dir / "x.html")]) == 0
    assert "validation after step 2, attempt 1" in (run_dir / "x.html").read_text()
    capsys.readouterr()

    assert main(["show", "--run", str(run_dir)]) == 0  # the last training step, not the final validation
    err, rows = listed(capsys)
    assert rows == [[step2_a, "t1", "succeeded", "+0.000"], [step2_b, "t1", "succeeded", "+1.000"]]
    assert err.startswith(f"rollouts of training step 2 in {run_dir}") and "--validation" in err
    assert main(["show", "--run", str(run_dir), "--step", "1"]) == 0
    assert [row[0] for row in listed(capsys)[1]] == [step1]  # not the validation recorded beside it
    assert main(["show", "--run", str(run_dir), "--validation"]) == 0
    err, rows = listed(capsys)
    assert [row[0] for row in rows] == [val2] and err.startswith("rollouts of validation after step 2")
    assert main(["show", "--run", str(run_dir), "--validation", "--step", "0"]) == 0
    assert [row[0] for row in listed(capsys)[1]] == [val0]

    assert main(["show", "--run", str(run_dir), "--step", "3"]) == 1
    assert "no rollouts of training step 3" in capsys.readouterr().err  # and which is the last
    assert main(["show", "missing", "--run", str(run_dir)]) == 1
    assert main(["show", "--run", str(run_dir / "nowhere")]) == 1
    assert "no lit.sqlite" in capsys.readouterr().err


def test_lit_show_lists_a_steps_own_rollouts_and_names_those_a_resumed_run_superseded(run_dir, capsys):
    """A run stopped during training step 2 (no checkpoint of it), resumed from step 1, ran step 2 again: the
    listing of step 2 is the resumed run's, and says how many of the stopped run's it left out; each of those
    still opens, its page saying it was superseded."""
    with SqliteStore(run_dir / "lit.sqlite") as store:
        _, _, old_a, old_b = fill_run(store, [("val0", 0, 0), ("s0", 0, 1), ("s1", 1, 0), ("s1", 1, 1)])
        assert RunFolder(run_dir).supersede(store, 1) == (0, 2)
        (new,) = fill_run(store, [("s1", 1, 1)])
    assert main(["show", "--run", str(run_dir)]) == 0
    err, rows = listed(capsys)
    assert rows == [[new, "t1", "succeeded", "+1.000"]]
    assert "left out: 2 superseded rollout(s) of this step" in err and old_a in err
    assert main(["show", old_b, "--run", str(run_dir)]) == 0
    page = (run_dir / "rollouts" / f"{old_b}.html").read_text()
    assert "superseded" in page and "the run resumed from step 1 trained this step anew" in page
    assert main(["show", new, "--run", str(run_dir)]) == 0
    assert "superseded" not in (run_dir / "rollouts" / f"{new}.html").read_text()
    capsys.readouterr()
    with SqliteStore(run_dir / "lit.sqlite") as store:
        store.supersede([new], 1)  # as if that run stopped too before its checkpoint of step 2
    assert main(["show", "--run", str(run_dir), "--step", "2"]) == 1
    assert "no rollouts of training step 2" in (err := capsys.readouterr().err) and "(3 superseded" in err


def test_lit_show_opens_the_folder_lit_eval_wrote(tmp_path, capsys):
    """``lit eval`` of step 4 writes eval.sqlite and eval.jsonl (and config.json) beside the run: ``lit show --run``
    lists its rollouts without --validation (it has no training step) and writes their pages."""
    folder = tmp_path / "runs" / "calc" / "eval" / "step-000004"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model": "smollm2-135m"}))
    (folder / "eval.jsonl").write_text(json.dumps({"kind": "validation", "step": 4, "accuracy": 0.5}) + "\n")
    with SqliteStore(folder / "eval.sqlite") as store:
        ids = fill_run(store, [("val4", 4, 0), ("val4", 4, 1)])
    assert main(["show", "--run", str(folder)]) == 0
    err, rows = listed(capsys)
    assert [row[0] for row in rows] == ids and err.startswith(f"rollouts of validation after step 4 in {folder}")
    assert main(["show", ids[1], "--run", str(folder)]) == 0
    assert "validation after step 4" in (folder / "rollouts" / f"{ids[1]}.html").read_text()
    with Run(folder) as run:
        assert run.evaluation and [r["accuracy"] for r in run.validations()] == [0.5]
        assert run.last_step() is None and run.last_step(validation=True) == 4


def transition(rollout_id: str, task_id: str, index: int, reward: float | None = None) -> Transition:
    return Transition(prompt_ids=[1, 2], response_ids=[3], logprobs=None, reward=reward, agent="a",
                      rollout_id=rollout_id, task_id=task_id, index=index, span_id=f"{index:016x}")


def test_the_advantages_of_transitions_the_update_skips_are_kept_too(tmp_path):
    rollouts = [("t1", "r1", 1.0, 2), ("t1", "r2", 0.0, 1), ("t1", "r3", 0.5, 3), ("t2", "r4", 0.2, 1),
                ("t2", "r5", 0.9, 2), ("t3", "r6", 1.0, 1)]  # t3: a group of one, dropped before the advantages
    episodes = [Episode(rid, task, 1, [transition(rid, task, i) for i in range(n)], ret, ret)
                for task, rid, ret, n in rollouts]
    cfg = TrainConfig()
    # No behaviour logprobs: every transition is skipped after its advantage is computed: nothing to train on.
    work = prepare(episodes, cfg, step=3)
    assert not work.trains
    metrics = work.metrics
    with SqliteStore(tmp_path / "lit.sqlite") as store:
        store.save_advantages(work.advantages)
        saved = {e.rollout_id: store.advantages_of_rollout(e.rollout_id) for e in episodes}
    kept = episodes[:5]
    assert metrics["update/skipped_no_logprobs"] == sum(len(e.transitions) for e in kept) == 9
    assert saved["r6"] == {}
    expected, _ = episode_advantages(kept, cfg.credit, cfg.advantages)
    assert any(abs(float(a)) > 0.1 for adv in expected for a in adv)
    for e, adv in zip(kept, expected, strict=True):
        assert saved[e.rollout_id].keys() == {t.index for t in e.transitions}
        for t, a in zip(e.transitions, adv.tolist(), strict=True):
            assert math.isclose(saved[e.rollout_id][t.index], a, rel_tol=0, abs_tol=1e-12)


# -- hostile and broken values: shown as text, never run, never a crash (#27) ----------------------------------------

BREAKOUTS = ('"><script>alert(1)</script>', '" onmouseover="x', "' onmouseover='x")
"""Strings that end an attribute value or open an element where they are written into the page unescaped."""


class Elements(HTMLParser):
    """Every element's tag and attributes, and all the text, of a page; html.parser unescapes both."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str | None]]] = []
        self.text = ""
        self.feed(page)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text += data


def assert_inert(page: str) -> Elements:
    """No script element and no event-handler attribute in ``page``: what an agent wrote stayed text."""
    parsed = Elements(page)
    assert [tag for tag, _ in parsed.elements if tag == "script"] == []
    assert [(tag, name) for tag, attrs in parsed.elements for name in attrs if name.startswith("on")] == []
    return parsed


def test_hostile_strings_in_spans_reach_the_page_only_as_escaped_text(tmp_path):
    p0, p1, p2 = BREAKOUTS
    r = Rollout("s0-t1-g0")
    root = r.add(sc.ROLLOUT_SPAN, None, 0, **{sc.ROLLOUT_NAME: p0, sc.ROLLOUT_INPUT: p1, sc.ROLLOUT_OUTPUT: p2,
                                              sc.ROLLOUT_RETURN_REWARD: 1.0})
    node = r.add(p0, root, 1, status=STATUS_ERROR, message=p1, **{sc.OI_SPAN_KIND: p1, sc.OI_GRAPH_NODE_ID: p2})
    r.add(sc.LLM_SPAN, node, 2, **{sc.AGENT_NAME: p0, sc.LLM_PROMPT_TOKEN_IDS: [1, 2],
                                   sc.LLM_RESPONSE_TOKEN_IDS: [3, 4], sc.LLM_RESPONSE_LOGPROBS: [-0.1, -0.2],
                                   sc.LLM_FINISH_REASON: p1, sc.LLM_TEMPERATURE: 0.7, "hostile.text": p2})
    r.add(sc.REWARD_SPAN, node, 3, **{sc.REWARD_VALUE: p0, sc.REWARD_NAME: p1})
    # A failed call is not trained on, so its token ids reach the page as the agent sent them.
    r.add(sc.LLM_SPAN, root, 4, status=STATUS_ERROR, message=p2, **{
        sc.AGENT_NAME: p2, sc.LLM_PROMPT_TOKEN_IDS: [*BREAKOUTS, 7], sc.LLM_RESPONSE_TOKEN_IDS: [*BREAKOUTS, 8],
        sc.LLM_RESPONSE_LOGPROBS: [-0.1, -0.2, -0.3, -0.4]})
    with SqliteStore(tmp_path / "lit.sqlite") as store:
        r.store(store)
        store.save_advantages([AdvantageRow(r.rollout_id, 0, 1, 0.5)])
        page = viewer.view_rollout(store, r.rollout_id).html()

    parsed = assert_inert(page)
    for breakout in BREAKOUTS:  # each is on the page, as text
        assert parsed.text.count(breakout) >= 3
    tokens = tokens_of(page)
    assert [text for text, _ in tokens.of(2, "response")] == [f"[{b}]" for b in BREAKOUTS] + ["[8]"]
    ids_and_logprobs = zip((*BREAKOUTS, 8), (-0.1, -0.2, -0.3, -0.4), strict=True)
    assert [attrs["title"] for _, attrs in tokens.of(2, "response")] == [
        f"id {i} · engine logprob {lp:.4f} (p {math.exp(lp):.3f})" for i, lp in ids_and_logprobs]
    assert [text for text, _ in tokens.of(2, "prompt")] == [f"[{b}]" for b in BREAKOUTS] + ["[7]"]
    assert {attrs["data-adv"] for _, attrs in tokens.of(1, "response")} == {"0.5000"}  # the trained call, intact
    assert f"'{p1}' '{p0}'" in parsed.text  # the reward's name and its value (no number: its repr)


def test_values_of_the_wrong_type_render_as_text_in_lit_show(run_dir, tokenizer, capsys):
    odd_ids = [tokenizer("Hi")["input_ids"][0], "x", None, -1, 2**64 - 1, 1.5, True, len(tokenizer)]
    odd_logprobs = ["-0.5", None, math.nan, math.inf, 1e308, 2**64 - 1, {"lp": -1.0}, [-1.0]]
    odd = {sc.AGENT_NAME: None, sc.LLM_PROMPT_TOKEN_IDS: odd_ids, sc.LLM_RESPONSE_TOKEN_IDS: odd_ids,
           sc.LLM_RESPONSE_LOGPROBS: odd_logprobs, sc.LLM_FINISH_REASON: [BREAKOUTS[0]], sc.LLM_TEMPERATURE: math.nan}
    unstored = Rollout("s0-t1-g0")  # the trainer stored no episode: the page rebuilds it from these spans
    root = unstored.add(sc.ROLLOUT_SPAN, None, 0, **{sc.ROLLOUT_RETURN_REWARD: "1.0"})
    unstored.add(sc.LLM_SPAN, root, 1, **odd)
    unstored.add(sc.REWARD_SPAN, root, 2, **{sc.REWARD_VALUE: math.nan, sc.REWARD_NAME: 5})
    stored = Rollout("s0-t1-g1")  # the trainer stored its episode of call 1; call 2 failed, with the odd values
    root = stored.add(sc.ROLLOUT_SPAN, None, 0, **{sc.ROLLOUT_RETURN_REWARD: 1.0})
    stored.call(root, 1, "calc", [1, 2], [3, 4])
    stored.add(sc.LLM_SPAN, root, 2, status=STATUS_ERROR, message="boom", **odd)
    with SqliteStore(run_dir / "lit.sqlite") as store:
        store.add_spans(unstored.spans)
        stored.store(store)
        store.save_advantages([AdvantageRow(stored.rollout_id, 0, 1, -0.5)])

    for rollout, call in ((unstored, 1), (stored, 2)):
        assert main(["show", rollout.rollout_id, "--run", str(run_dir)]) == 0, capsys.readouterr().err
        page = (run_dir / "rollouts" / f"{rollout.rollout_id}.html").read_text()
        parsed, tokens = assert_inert(page), tokens_of(page)
        response = tokens.of(call, "response")
        assert [text for text, _ in response] == [tokenizer.decode([odd_ids[0]])] + [
            f"[{i}]" for i in odd_ids[1:]]  # the ids the tokenizer cannot decode, as ids
        assert [attrs.get("data-lp") for _, attrs in response] == [
            "'-0.5'", None, "nan", "inf", f"{1e308:.4f}", f"{2**64 - 1:.4f}", "{'lp': -1.0}", "[-1.0]"]
        # a colour only where the engine's logprob is a finite number
        assert ["--l:" in (attrs.get("style") or "") for _, attrs in response] == [
            False, False, False, False, True, True, False, False]
        assert f"finish ['{BREAKOUTS[0]}']" in parsed.text and "temperature nan" in parsed.text
    unstored_page = Elements((run_dir / "rollouts" / "s0-t1-g0.html").read_text()).text
    # its header row: the intake refuses the episode with its reason (#27), where it crashed before
    assert "episodeunusable: a " in unstored_page
    assert "returned '1.0'" in unstored_page and "'5' +nan" in unstored_page  # the root's return, the reward


def test_a_programs_rollout_shows_the_calls_lit_recorded_at_the_engine(tmp_path):
    """An agent without lit in its process: its calls are the gateway's records (``lit.engine.call``), shown as the
    rollout's calls, with their tokens, under its root; a call the SDK saw too is shown once."""
    r = Rollout("s0-t3-g0")
    root = r.add(sc.ROLLOUT_SPAN, None, 0, **{sc.ROLLOUT_RETURN_REWARD: 1.0})
    sdk = r.add(sc.LLM_SPAN, root, 1, **{sc.AGENT_NAME: "writer", sc.LLM_STREAMED: True})
    engine = {sc.LLM_PROMPT_TOKEN_IDS: [1, 2], sc.LLM_RESPONSE_TOKEN_IDS: [3], sc.LLM_RESPONSE_LOGPROBS: [-0.5]}
    r.add(sc.ENGINE_CALL_SPAN, None, 2, **engine, **{sc.LLM_CALL_ID: sdk, sc.LLM_MODEL: "policy-writer"})
    r.add(sc.ENGINE_CALL_SPAN, None, 8, **engine, **{sc.AGENT_NAME: "checker"})
    with SqliteStore(tmp_path / "lit.sqlite") as store:
        r.store(store)
        page = viewer.view_rollout(store, r.rollout_id)._repr_html_()
    assert "LLM calls (2)" in page and "lit.engine.call" not in page
    assert "agent writer" in page and "agent checker" in page
    assert page.count("served by") == 1 and "served by policy-writer" in page  # the adapter the engine named
    assert "not trained on: agent not selected" not in page  # both calls are the episode's transitions
    assert [text for text, _ in tokens_of(page).of(2, "response")] == ["[3]"]  # no tokenizer: ids
