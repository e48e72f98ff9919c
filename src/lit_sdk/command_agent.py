"""Agents that are programs, in any language: each rollout runs the program once, its task on stdin, its reward
the last line of its stdout.

    agent = command_agent("node examples/js_calc/agent.mjs")     # lit worker --command "node ..." does this
    reward = await agent(task, llm)                              # a @lit.trace function, as a Python agent is

Per rollout, the program starts in the worker's folder, in a process group of its own that dies with the worker
(``processes.start_child``), with the worker's environment plus what every LLM client reads (``ENV``). It reads
the task as one JSON line on its stdin (then end of file), calls the model at ``OPENAI_BASE_URL`` (or
``ANTHROPIC_BASE_URL``), where the trainer records each call whatever the client, and prints its reward as the
last non-empty line of its stdout: a number, or a JSON object with a numeric ``"reward"`` (its other keys are
ignored). Anything else there gives the rollout no final reward; the lines before it are the program's own. A
reward along the way (after a step, a test run) goes to ``LIT_REWARD_URL`` (``POST {"value": 0.5, "name": "..."}``:
lit's gateway records it where it arrives among the calls).

A program that exits with a non-zero code or dies of a signal fails the rollout: the error names the code or the
signal and quotes the end of its stderr. When the rollout is cancelled (the worker's ``rollout_timeout_s``), its
whole process group is killed at once. Whatever it leaves running when it exits is stopped too. Only the ends of
stdout and stderr are kept in memory, and both are read while the program runs, so that neither pipe fills up.

Light like the rest of lit_sdk: standard library only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import shlex
import shutil
import signal
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lit_sdk import _context
from lit_sdk.processes import group_members, start_child, stop_child
from lit_sdk.resources import LLM
from lit_sdk.trace import trace

__all__ = ["ENV", "AgentProgramError", "check_command", "command_agent", "final_reward", "program_env", "program_name"]

log = logging.getLogger("lit")

ENV = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "LIT_MODEL",
       "LIT_TEMPERATURE", "LIT_MAX_TOKENS", "LIT_TASK_ID", "LIT_ROLLOUT_ID", "LIT_REWARD_URL")
"""The variables a program gets on top of the worker's environment (``program_env``)."""
STDOUT_KEEP = 64 * 1024
"""Bytes of the end of stdout kept: the reward line is in them."""
STDERR_KEEP = 16 * 1024
"""Bytes of the end of stderr kept, for the error of a program that failed."""
STDERR_LINES = 20
STDERR_CHARS = 1500
"""The error quotes the last ``STDERR_LINES`` lines of stderr, at most this many characters of them: the worker
keeps the last 2000 characters of an error, and the line that names the program and its exit code must stay."""
STOP_GRACE_S = 5.0
"""How long what a program left running gets between SIGTERM and SIGKILL."""
READ_AFTER_EXIT_S = 2.0
"""Once the program and its group are gone, how long its pipes may take to reach their end (a process that
left the group may hold them open)."""
_POLL_MAX_S = 0.05


class AgentProgramError(RuntimeError):
    """The agent program exited with a non-zero code, or was killed by a signal."""


def check_command(command: str | Sequence[str], setting: str = "the agent command") -> list[str]:
    """The program's arguments (``command`` split as a shell would, when a string); ValueError naming ``setting``
    and the fix when it is empty or its program cannot be found (``shutil.which``: on PATH, or a path)."""
    argv = shlex.split(command) if isinstance(command, str) else [str(arg) for arg in command]
    if not argv:
        raise ValueError(f"{setting} is empty: give the program to run per rollout, e.g. \"node agent.mjs\"")
    if shutil.which(argv[0]) is None:
        where = "no such executable file" if os.sep in argv[0] else "not found on PATH"
        raise ValueError(f"{setting} {shlex.join(argv)!r}: the program {argv[0]!r} is {where} (from {os.getcwd()}"
                         "): install it, or give its path")
    return argv


def command_agent(command: str | Sequence[str]) -> Callable[[Any, LLM], Any]:
    """An async ``@lit.trace`` agent ``(task, llm) -> reward | None`` that runs ``command`` once per rollout (see
    the module's doc); the rollout is named after the program (``program_name``). ValueError when the command is
    empty or its program is not found."""
    argv = check_command(command)
    name = program_name(argv)
    said_no_reward = False

    @trace(name=name)
    async def run_program(task: Any, llm: LLM) -> float | None:
        nonlocal said_no_reward
        line = json.dumps(task).encode() + b"\n"
        code, stdout, stderr = await _run(argv, line, program_env(task, llm))
        if code != 0:
            raise AgentProgramError(_failure(name, code, stderr))
        reward = final_reward(stdout)
        if reward is None and not said_no_reward:
            said_no_reward = True
            last = next((s for s in reversed(stdout.splitlines()) if s.strip()), "")
            log.warning("lit: the agent program %s printed no reward as the last line of its stdout (a number, or "
                        "{\"reward\": <number>}); it printed %r: its rollouts carry no final reward", name, last[:200])
        return reward

    return run_program


def program_name(argv: Sequence[str]) -> str:
    """What the rollouts are named: the file name of the first argument that is a file (the script: ``agent.mjs``
    of ``node examples/js_calc/agent.mjs``), else of the program."""
    script = next((arg for arg in argv[1:] if not arg.startswith("-") and os.path.isfile(arg)), argv[0])
    return Path(script).name


def program_env(task: Any, llm: LLM) -> dict[str, str]:
    """The worker's environment plus ``ENV``: the rollout's LLM endpoint for OpenAI's and Anthropic's clients (whose
    base URL has no ``/v1``: they add ``/v1/messages``), how to sample, and which rollout this is."""
    rollout = _context.current_rollout()  # None when lit.instrument() is off: the rollout is not recorded
    task_id = rollout.task_id if rollout is not None else ""
    if not task_id and isinstance(task, dict):
        task_id = str(task.get("id", ""))
    base_url = llm.base_url.rstrip("/")
    return {
        **os.environ,
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": llm.api_key,
        "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
        "ANTHROPIC_API_KEY": llm.api_key,
        "LIT_MODEL": llm.model,
        "LIT_TEMPERATURE": str(llm.temperature),
        "LIT_MAX_TOKENS": str(llm.max_tokens),
        "LIT_TASK_ID": task_id,
        "LIT_ROLLOUT_ID": rollout.rollout_id if rollout else "",
        "LIT_REWARD_URL": base_url.removesuffix("/v1") + "/reward",
    }


def final_reward(stdout: str) -> float | None:
    """The reward in the last non-empty line of ``stdout``: a finite number, or an object's numeric ``"reward"``;
    None for anything else."""
    last = next((line for line in reversed(stdout.splitlines()) if line.strip()), "")
    try:
        value = json.loads(last)
        if isinstance(value, dict):
            value = value.get("reward")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        value = float(value)
    except (ValueError, OverflowError):  # not JSON; an integer too large for a float
        return None
    return value if math.isfinite(value) else None


def _failure(name: str, code: int, stderr: str) -> str:
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    tail = "\n".join(stderr.rstrip().splitlines()[-STDERR_LINES:])[-STDERR_CHARS:]
    return f"the agent program {name} {how}" + (f"; the end of its stderr:\n{tail}" if tail.strip() else
                                                " and wrote nothing to stderr")


class _Tail(asyncio.Protocol):
    """Reads a pipe, keeping the last ``keep`` bytes of it; ``ended`` is done at its end."""

    def __init__(self, keep: int):
        self.keep = keep
        self.data = bytearray()
        self.cut = False
        self.ended = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.data += data
        if len(self.data) > 2 * self.keep:  # trimmed now and then, not at every read
            del self.data[: -self.keep]
            self.cut = True

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ended.done():
            self.ended.set_result(None)

    def text(self) -> str:
        cut = self.cut or len(self.data) > self.keep
        text = bytes(self.data[-self.keep :]).decode(errors="replace")
        return text.partition("\n")[2] if cut else text  # the first line kept is a piece of a line


async def _run(argv: list[str], line: bytes, env: dict[str, str]) -> tuple[int, str, str]:
    """Run the program to its end, ``line`` on its stdin: its exit code (negative: the signal that killed it) and
    the ends of its stdout and stderr. Cancelled, it kills the program's process group before it re-raises."""
    loop = asyncio.get_running_loop()
    proc = start_child(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = _Tail(STDOUT_KEEP), _Tail(STDERR_KEEP)
    transports: list[asyncio.BaseTransport] = []
    try:
        for pipe, tail in ((proc.stdout, out), (proc.stderr, err)):
            transports.append((await loop.connect_read_pipe(lambda tail=tail: tail, pipe))[0])
        stdin = (await loop.connect_write_pipe(asyncio.Protocol, proc.stdin))[0]
        transports.append(stdin)
        stdin.write(line)
        stdin.close()  # once written; a program that exits without reading it is fine
        code = await _exit_code(proc)
        await _stop_group(proc)  # what it left running
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(out.ended, err.ended), READ_AFTER_EXIT_S)
    except BaseException:  # cancelled (the rollout's timeout), or failed: nothing of the program may outlive it
        if proc.poll() is None:  # not reaped: its pid is still the id of its group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.shield(_stop_group(proc))
        raise
    finally:
        for transport in transports:
            if transport.is_closing():
                continue
            if isinstance(transport, asyncio.WriteTransport):
                transport.abort()  # drops what the program did not read
            else:
                transport.close()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if not any(t.get_extra_info("pipe") is pipe for t in transports):
                pipe.close()  # never handed to a transport
    return code, out.text(), err.text()


async def _exit_code(proc: subprocess.Popen) -> int:
    delay = 0.002
    while (code := proc.poll()) is None:
        await asyncio.sleep(delay)
        delay = min(2 * delay, _POLL_MAX_S)
    return code


async def _stop_group(proc: subprocess.Popen) -> None:
    """Stop what is left of the program's process group, and reap the program, in a thread (it may take up to
    ``STOP_GRACE_S``): nothing when the program has exited alone."""
    if proc.poll() is None or group_members(proc.pid):
        await asyncio.to_thread(stop_child, proc, STOP_GRACE_S, name=f"the agent program {shlex.join(proc.args)}")
