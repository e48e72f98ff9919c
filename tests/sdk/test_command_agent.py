"""Agents that are programs (lit_sdk/command_agent.py), with real processes: small Python programs, and the Node.js
calc agent (examples/js_calc) against the vLLM-shaped local server, streamed, beside the Python calc agent it
mirrors; then ``lit worker --command`` with a real dispatcher."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import socket
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from fake_llm import FakeLLM

import lit_sdk as lit
from lit_sdk import _context
from lit_sdk import semconv as sc
from lit_sdk.command_agent import ENV, STDERR_CHARS, AgentProgramError, command_agent, final_reward
from lit_sdk.processes import group_members, start_child
from lit_sdk.worker import main as worker_main
from lit_sdk.worker import spawn

REPO = Path(__file__).parents[2]
JS_AGENT = REPO / "examples" / "js_calc" / "agent.mjs"
LLM = lit.LLM("http://127.0.0.1:9/v1", "policy", api_key="secret-key", temperature=0.5, max_tokens=32)


def program(tmp_path: Path, name: str, source: str) -> list[str]:
    """A Python program in ``tmp_path`` and the command that runs it."""
    path = tmp_path / name
    path.write_text(source)
    return [sys.executable, str(path)]


def wait_for_file(path: Path, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text().endswith("\n"):
        assert time.monotonic() < deadline, f"{path} was not written within {timeout_s:g} s"
        time.sleep(0.02)
    return path.read_text()


def test_the_program_reads_its_task_and_its_endpoint_and_prints_its_reward(tracing, tmp_path, monkeypatch):
    monkeypatch.setenv("LIT_TEST_WORKER_VAR", "kept")
    seen = tmp_path / "seen.json"
    agent = command_agent(program(tmp_path, "echo_agent.py", f"""
import json, os, sys
task = json.loads(sys.stdin.readline())
rest = sys.stdin.read()  # end of file after the one line
names = {list(ENV) + ["LIT_TEST_WORKER_VAR"]!r}
with open({str(seen)!r}, "w") as f:
    json.dump({{"task": task, "rest": rest, "cwd": os.getcwd(), "env": {{n: os.environ.get(n) for n in names}}}}, f)
print("the program's own line")
print(task["weight"] / 4)
print()
"""))
    llm = lit.LLM(tracing.llm.base_url, "policy", api_key="secret-key", temperature=0.5, max_tokens=32)
    task = {"id": "t-7", "weight": 1.0, "text": "ünïcode\nand a newline"}
    with _context.assign("rollout-1", "task-7"):
        assert asyncio.run(agent(task, llm)) == 0.25
    got = json.loads(seen.read_text())
    assert got["task"] == task and got["rest"] == "" and got["cwd"] == os.getcwd()
    assert got["env"] == {
        "OPENAI_BASE_URL": tracing.llm.base_url, "OPENAI_API_KEY": "secret-key",
        "ANTHROPIC_BASE_URL": tracing.llm.base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": "secret-key",
        "LIT_MODEL": "policy", "LIT_TEMPERATURE": "0.5", "LIT_MAX_TOKENS": "32", "LIT_TASK_ID": "task-7",
        "LIT_ROLLOUT_ID": "rollout-1", "LIT_REWARD_URL": tracing.llm.base_url.removesuffix("/v1") + "/reward",
        "LIT_TEST_WORKER_VAR": "kept"}  # fmt: skip
    (root,) = [s for s in tracing.delivered() if s["name"] == sc.ROLLOUT_SPAN]
    assert root["rollout_id"] == "rollout-1" and root["attributes"][sc.ROLLOUT_NAME] == "echo_agent.py"
    assert root["attributes"][sc.ROLLOUT_RETURN_REWARD] == 0.25


@pytest.mark.parametrize(("stdout", "reward"), [
    ("1\n", 1.0), ("-0.5", -0.5), ("3", 3.0), ('{"reward": 0.75, "answer": 12}\n', 0.75),
    ("its own line\n{\"reward\": 1}\n\n  \n", 1.0), ("0.5\nnot a reward", None), ("", None), ("\n\n", None),
    ('{"reward": "1"}', None), ('{"score": 1}', None), ("true", None), ('{"reward": true}', None), ("NaN", None),
    ("Infinity", None), ("1e999", None), ("9" * 400, None), ("[1]", None), ('"1"', None), ("reward: 1", None),
])  # fmt: skip
def test_the_reward_is_the_last_non_empty_line_a_number_or_an_objects_reward(stdout, reward):
    assert final_reward(stdout) == reward


def test_a_last_line_without_a_reward_gives_none_and_one_warning(tmp_path, caplog):
    agent = command_agent(program(tmp_path, "no_reward.py", "print(1)\nprint('done!')\n"))
    with caplog.at_level(logging.WARNING, logger="lit"):
        assert asyncio.run(agent({}, LLM)) is None
        assert asyncio.run(agent({}, LLM)) is None
    said = [r.getMessage() for r in caplog.records if "no reward" in r.getMessage()]
    assert len(said) == 1 and "no_reward.py" in said[0] and "'done!'" in said[0], said


def test_a_crash_fails_the_rollout_with_the_end_of_its_stderr(tmp_path):
    agent = command_agent(program(tmp_path, "crash.py", """
import sys
import urllib.request
for i in range(100):
    print(f"line {i}", file=sys.stderr)
print(1)
sys.exit(3)
"""))
    with pytest.raises(AgentProgramError) as info:
        asyncio.run(agent({}, LLM))
    message = str(info.value)
    assert message.startswith("the agent program crash.py exited with code 3; the end of its stderr:\nline 80\n")
    assert message.endswith("line 99") and message.count("\n") == 20
    long_lines = command_agent(program(tmp_path, "long.py", "import sys\nsys.stderr.write('x' * 10000 + '\\n')\n"
                                                            "sys.exit(1)\n"))
    with pytest.raises(AgentProgramError) as info:
        asyncio.run(long_lines({}, LLM))
    assert str(info.value).startswith("the agent program long.py exited with code 1; the end of its stderr:\nxxx")
    assert len(str(info.value)) <= 100 + STDERR_CHARS  # the worker keeps 2000 characters: the first line stays
    killed = command_agent(program(tmp_path, "killed.py", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"))
    with pytest.raises(AgentProgramError, match=r"^the agent program killed.py was killed by SIGKILL and wrote "
                                                r"nothing to stderr$"):
        asyncio.run(killed({}, LLM))


def test_big_outputs_and_an_unread_task_do_not_block(tmp_path):
    """2 MB on stderr before stdout, 2 MB on stdout, a 2 MB task never read: the pipes are read while it runs."""
    agent = command_agent(program(tmp_path, "loud.py", """
import sys
import urllib.request
sys.stderr.write("e" * 2_000_000)
sys.stdout.write("o" * 2_000_000 + "\\n")
print(2)
"""))
    assert asyncio.run(agent({"blob": "t" * 2_000_000}, LLM)) == 2.0
    no_newline = command_agent(program(tmp_path, "digits.py", "import sys\nsys.stdout.write('1' * 200_000)\n"))
    assert asyncio.run(no_newline({}, LLM)) is None  # the end of one long line is no reward


HANGS = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # in the program's group
with open(sys.argv[1], "w") as f:
    f.write(f"{{os.getpid()}} {{child.pid}}\\n")
{rest}
"""


def test_a_cancelled_rollout_kills_the_programs_whole_process_group(tmp_path):
    """As the worker's timeout does (``asyncio.wait_for`` cancels the rollout): once the program runs, with a child
    of its own."""
    pids = tmp_path / "pids"
    agent = command_agent([*program(tmp_path, "hangs.py", HANGS.format(rest="time.sleep(600)")), str(pids)])

    async def cancel_once_started() -> tuple[int, int]:
        rollout = asyncio.ensure_future(agent({}, LLM))
        while not pids.exists() or not pids.read_text().endswith("\n"):
            assert not rollout.done(), rollout
            await asyncio.sleep(0.02)
        leader, child = map(int, pids.read_text().split())
        assert sorted(group_members(leader)) == sorted([leader, child]) and os.getpgid(child) == leader
        rollout.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rollout
        return leader, child

    leader, child = asyncio.run(cancel_once_started())
    assert group_members(leader) == []  # the program and its child: none left once the cancel is done


def test_what_a_program_leaves_running_is_stopped_when_it_exits(tmp_path):
    pids = tmp_path / "pids"
    agent = command_agent([*program(tmp_path, "leaves.py", HANGS.format(rest="print(1)")), str(pids)])
    assert asyncio.run(agent({}, LLM)) == 1.0
    leader, _ = map(int, pids.read_text().split())
    assert group_members(leader) == [], "the program's child outlived the rollout"


def test_a_program_that_cannot_be_found_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"the program 'no-such-lit-program' is not found on PATH .*: install it, "
                                         r"or give its path"):
        command_agent("no-such-lit-program --flag")
    with pytest.raises(ValueError, match="is empty"):
        command_agent("  ")


# The Node.js calc agent, beside the Python one it mirrors.


@pytest.fixture(scope="module")
def node_agent():
    if not (JS_AGENT.parent / "node_modules" / "openai").is_dir():
        pytest.fail(f"the npm packages of {JS_AGENT.parent} are not installed: run bash run.sh test, which installs "
                    "them (or npm ci in that folder)")
    return command_agent(["node", str(JS_AGENT)])


@pytest.fixture(scope="module")
def calc_task() -> dict:
    from examples.calc.tasks import make_tasks

    return make_tasks("train", 4)[3]  # a two-step problem


REPLIES = {  # the model's reply to a task, and the reward it earns
    "the right calculator call": (lambda task: ("calculator", {"expression": task["expression"]}), 1.0),
    "a wrong calculator call": (lambda task: ("calculator", {"expression": task["expression"] + "+1"}), 0.0),
    "a bad expression": (lambda task: ("calculator", {"expression": "2**3"}), 0.0),
    "a division by zero": (lambda task: ("calculator", {"expression": "7/0"}), 0.0),
    "an unknown tool": (lambda task: ("calc", {"expression": task["expression"]}), 0.0),
    "the right answer in text": (lambda task: f"So the answer is {task['answer']}.", 1.0),
    "the right answer, then another number": (lambda task: f"{task['answer']} or maybe 3", 0.0),
    "no number": (lambda task: "I cannot tell.", 0.0),
}


@pytest.mark.parametrize("reply", list(REPLIES))
def test_the_node_agent_sends_the_python_agents_request_streamed_and_grades_alike(node_agent, calc_task, reply):
    from examples.calc.agent import calc_agent

    make_reply, reward = REPLIES[reply]
    with FakeLLM(script=[make_reply(calc_task)] * 2, streams=True) as engine:  # one call of each agent
        llm = lit.LLM(engine.base_url, "policy", temperature=0.7, max_tokens=48)
        python_reward = asyncio.run(calc_agent(calc_task, llm))
        node_reward = asyncio.run(node_agent(calc_task, llm))
        python_request, node_request = engine.requests
    assert python_reward == reward and node_reward == reward
    assert python_request.pop("stream") is False and node_request.pop("stream") is True
    assert node_request == python_request  # the same prompt, worked examples and tool, byte for byte


def test_the_node_agent_fails_when_its_endpoint_does_not_answer(node_agent, calc_task):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = lit.LLM(f"http://127.0.0.1:{s.getsockname()[1]}/v1", "policy")  # nothing listens there
    said = r"(?s)^the agent program agent.mjs exited with code 1; the end of its stderr:\n.*"
    with pytest.raises(AgentProgramError, match=said + r"\nagent.mjs: Connection error\.: .*ECONNREFUSED[^\n]*$"):
        asyncio.run(node_agent(calc_task, closed))  # the worker reports it failed: the trainer retries it


# lit worker --command


@pytest.mark.parametrize(("argv", "says"), [
    (["--command", "node agent.mjs", "examples.calc.agent:calc_agent"], "exactly one of them"),
    ([], "exactly one of them"),
    (["--command", ""], "exactly one of them"),
])  # fmt: skip
def test_lit_worker_takes_a_function_or_a_command(argv, says, capsys):
    with pytest.raises(SystemExit) as info:
        worker_main(["--connect", "tcp://127.0.0.1:9", *argv])
    assert info.value.code == 2 and says in capsys.readouterr().err


def test_lit_worker_refuses_a_command_it_cannot_find(capsys):
    assert worker_main(["--connect", "tcp://127.0.0.1:9", "--command", "no-such-lit-program x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("lit worker: error: --command 'no-such-lit-program x': the program 'no-such-lit-program' "
                          "is not found on PATH"), err
    with pytest.raises(ValueError, match="exactly one"):
        spawn("examples.calc.agent:calc_agent", "tcp://127.0.0.1:9", 1, command="node agent.mjs")
    with pytest.raises(ValueError, match="exactly one"):
        spawn("", "tcp://127.0.0.1:9", 1)


ROLLOUTS = """
import json, os, sys, time
task = json.loads(sys.stdin.readline())
if task["kind"] == "crash":
    sys.exit("the tool blew up")
if task["kind"] == "hang":
    with open(task["pid_file"], "w") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(600)
print(json.dumps({"reward": task["value"], "rollout": os.environ["LIT_ROLLOUT_ID"]}))
"""


def test_lit_worker_runs_a_command_in_several_processes_for_a_real_dispatcher(tmp_path):
    from lit_trainer.intake.collector import Collector
    from lit_trainer.intake.rows import RolloutStatus
    from lit_trainer.intake.store import SqliteStore
    from lit_trainer.rollouts.attempts import RolloutRequest
    from lit_trainer.rollouts.dispatcher import DispatchConfig, Dispatcher
    from lit_trainer.run.services import stop_workers

    command = shlex.join(program(tmp_path, "rollouts.py", ROLLOUTS))
    pid_file = tmp_path / "hang.pid"
    tasks = [{"kind": "ok", "value": i / 4} for i in range(4)] + [{"kind": "crash"},
                                                                   {"kind": "hang", "pid_file": str(pid_file)}]
    with SqliteStore(tmp_path / "lit.sqlite") as store, \
            Collector(store, "tcp://127.0.0.1:0", open_to_local_users=True) as collector:
        dispatcher = Dispatcher(store, "tcp://127.0.0.1:0", collector.endpoint, [LLM.base_url],
                                DispatchConfig(rollout_timeout_s=8, max_attempts=1), open_to_local_users=True)
        env = {**os.environ, "LIT_SPOOL_DIR": str(tmp_path / "spool")}
        worker = start_child([sys.executable, "-m", "lit_sdk.worker", "--connect", dispatcher.endpoint,
                              "--processes", "2", "--concurrency", "3", "--command", command], env=env)
        try:
            dispatcher.wait_for_workers(2, timeout_s=120)
            outcomes = dispatcher.run([RolloutRequest(f"r{i}", f"t{i}", task, LLM, 0) for i, task in
                                       enumerate(tasks)])
        finally:
            stop_workers(dispatcher, [worker])
    by_key = {o.request.key: o for o in outcomes}
    for i in range(4):
        assert by_key[f"r{i}"].status is RolloutStatus.SUCCEEDED and by_key[f"r{i}"].reward == i / 4
    crash = by_key["r4"]
    assert crash.status is RolloutStatus.FAILED and "exited with code 1" in crash.errors[-1]
    assert crash.errors[-1].endswith("the tool blew up"), crash.errors
    assert by_key["r5"].status is RolloutStatus.TIMED_OUT
    hung = int(wait_for_file(pid_file))
    assert group_members(hung) == [], "the timed-out program outlived its rollout"


@pytest.mark.parametrize("reply", ["The answer is 5.", ("calculator", {"expression": "3*12"})])
def test_the_fake_engine_streams_its_reply_as_vllm_does(reply):
    """tests/fake_llm.py's ``streams``, which the Node agent's tests use: the chunks add up to the whole reply."""
    with FakeLLM(script=[reply], streams=True) as engine:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "stream_options": {"include_usage": True}, "tools": [{"type": "function", "function": {"name": "x"}}]}
        request = urllib.request.Request(f"{engine.base_url}/chat/completions", json.dumps(body).encode(),
                                         {"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            events = [line.removeprefix(b"data: ") for line in answer.read().splitlines() if line]
        (whole,) = engine.responses
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"] and chunks[-1]["usage"] == whole["usage"]
    assert [t for c in choices for t in c["token_ids"]] == whole["choices"][0]["token_ids"]
    assert [p for c in choices for p in c["logprobs"]["content"]] == whole["choices"][0]["logprobs"]["content"]
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + [whole["choices"][0]["finish_reason"]]
    message = whole["choices"][0]["message"]
    assert "".join(c["delta"].get("content") or "" for c in choices) == (message["content"] or "")
    calls = [part for c in choices for part in c["delta"].get("tool_calls", [])]
    if message.get("tool_calls"):
        (call,) = message["tool_calls"]
        assert calls[0]["id"] == call["id"] and calls[0]["function"]["name"] == call["function"]["name"]
        assert "".join(part["function"]["arguments"] for part in calls) == call["function"]["arguments"]
    else:
        assert calls == []
