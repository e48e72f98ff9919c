"""#27: on a shared host, another local user gets nothing from a run: not its keys, not a task, not vLLM's API
key. ``lit train`` always gives its channels CURVE keys (the run's own, 0700, when ``[security] keys_dir`` names
none: ``services.with_keys``), so loopback is no longer the boundary. The other user is played by uid 65534
(nobody) when the tests run as root, and the test is skipped otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from lit_sdk.protocol import security
from lit_trainer.config import TrainConfig, from_dict
from lit_trainer.intake.collector import Collector
from lit_trainer.intake.store import SqliteStore
from lit_trainer.rollouts.dispatcher import Dispatcher
from lit_trainer.run.services import with_keys

NOBODY = 65534

OTHER_USER = f"""
import os, sys
import zmq
from lit_sdk.protocol.dispatch import Hello, encode_dispatch
os.setgid({NOBODY})
os.setuid({NOBODY})  # from here on this process is another user (what it needs is imported: the interpreter may sit
                  # in root's home, which that user cannot open)
keys, endpoint = sys.argv[1], sys.argv[2]
try:
    open(os.path.join(keys, "client.key_secret")).read()
    print("read the keys")
except PermissionError:
    print("keys: permission denied")
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(endpoint)  # no keys: the trainer's CURVE handshake refuses it
sock.send(encode_dispatch(Hello(slots=4, pid=1, host="elsewhere", worker_id="w-other")))
print("answered" if sock.poll(3000) else "no answer", flush=True)
"""


def other_user(keys: Path, endpoint: str) -> list[str]:
    """What uid 65534 gets: whether it can read the client's secret key, and whether a hello without keys is
    answered."""
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", OTHER_USER, str(keys), endpoint], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


def test_a_run_without_keys_dir_gets_keys_of_its_own(tmp_path):
    cfg = TrainConfig()
    folder, keyed = with_keys(cfg, tmp_path / "run" / "keys")
    assert folder == tmp_path / "run" / "keys" and (folder.stat().st_mode & 0o777) == 0o700
    assert keyed.inference.api_key_file == str(folder / security.API_KEY)
    assert (folder / security.API_KEY).stat().st_mode & 0o777 == 0o600
    again, _ = with_keys(cfg, folder)  # a resumed run keeps them
    assert again == folder and security.load_server_keys(folder)
    named = from_dict({"inference": {"api_key_file": str(tmp_path / "mine")}})
    assert with_keys(named, tmp_path / "other" / "keys")[1].inference.api_key_file == str(tmp_path / "mine")


@pytest.mark.skipif(os.geteuid() != 0, reason="plays another local user with setuid, which needs root")
def test_another_local_user_gets_no_keys_and_no_work(tmp_path):
    """#27's hole: on the default loopback setup any local user could say hello on the dispatch channel and
    receive run messages: the task with its gold answer, the rollout id and vLLM's API key."""
    shared = Path(tempfile.mkdtemp(prefix="lit-shared-"))  # a folder every user may enter, as a home often is
    try:
        os.chmod(shared, 0o755)
        folder, _ = with_keys(TrainConfig(), shared / "run" / "keys")
        os.chmod(shared / "run", 0o755)
        with SqliteStore(tmp_path / "lit.db") as store, \
                Dispatcher(store, "tcp://127.0.0.1:0", "tcp://127.0.0.1:7373", ["http://127.0.0.1:1/v1"],
                           keys=security.load_server_keys(folder)) as dispatcher:
            seen = other_user(folder, dispatcher.endpoint)
            workers, refused = dict(dispatcher.workers), dispatcher.refused_peers
        assert seen == ["keys: permission denied", "no answer"]
        # Refused at the handshake, its hello never came. Which side drops the connection first is a race: the
        # trainer's side reports the mechanism mismatch ("no_key"), or the other side hung up first ("handshake";
        # 2 runs in 6 here).
        assert workers == {} and refused.get("no_key", 0) + refused.get("handshake", 0) >= 1, refused
    finally:
        shutil.rmtree(shared)


def test_the_python_api_without_keys_is_refused_unless_opened_to_local_users(tmp_path):
    """#64: ``Collector(...)`` and ``Dispatcher(...)`` built without keys, as a user of the Python API might, let
    any local user in: the dispatcher handed it tasks, rollout ids with their secrets and vLLM's API key. Now each
    refuses in one line naming the fix, unless its caller says every local user is trusted (the Playground makes
    keys as ``lit train`` does)."""
    with SqliteStore(tmp_path / "lit.db") as store:
        for make in (lambda **kw: Collector(store, "tcp://127.0.0.1:0", **kw),
                     lambda **kw: Dispatcher(store, "tcp://127.0.0.1:0", "tcp://127.0.0.1:7373", [], **kw)):
            with pytest.raises(security.SecurityError) as refused:
                make()
            message = str(refused.value)
            assert "\n" not in message and "any user of this machine" in message, message
            assert "keys=security.load_server_keys(FOLDER)" in message and "lit keys generate" in message, message
            assert "open_to_local_users=True" in message, message
            opened = make(open_to_local_users=True)
            (opened.stop if isinstance(opened, Collector) else opened.close)()
