"""Fixtures shared by all test folders: the prepared default model, its trainer-side copy, and ONE vLLM server for
the whole session (start-up takes about a minute on 2 cores); and how ``bash run.sh test``'s two pytest-xdist
workers share the suite (``--dist loadfile``, changed below: every file with a vLLM test on one worker)."""

import os
import tempfile
from pathlib import Path

import pytest

OVERLAP_FILES = ("tests/e2e/test_broken_agent.py", "tests/e2e/test_readme_api.py",
                 "tests/e2e/test_teacher_demonstrations.py", "tests/test_notebooks.py")
"""Files that start a vLLM of their own (not the session's server) and run outside the vLLM unit, each a unit of its
own queued last: the worker done with the quick files runs them beside the vLLM unit's tail (below)."""
HEAVY_FILES = ("tests/e2e/test_train_options.py", "tests/e2e/test_remote_server.py", "tests/e2e/test_chaos.py")
"""The vLLM unit's files that hold the most memory (two vLLM servers, or two trainer processes), run first: beside
the quick files, not beside ``OVERLAP_FILES``. In the other order, the two-process run of test_train_options.py
beside the quickstart notebook had 22.6 of 23 GB in use (2026-12-06, fresh clone)."""
VLLM_FILES_ENV = "LIT_TEST_VLLM_FILES"
"""Where the workers write the test files that start vLLM (marker ``vllm``), for the scheduler in the main process,
which collects nothing itself."""

def _file_of(nodeid: str) -> str:
    """The test file of a node id: ``tests/e2e/test_chaos.py`` of ``tests/e2e/test_chaos.py::test_sigkill...``."""
    return nodeid.split("::", 1)[0]


def pytest_configure(config: pytest.Config) -> None:
    """In the main process of an xdist run: a file for the workers (started after this, with its environment) to
    name the test files that start vLLM."""
    main = config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput")
    if main and config.getoption("dist") != "no":
        fd, path = tempfile.mkstemp(prefix="lit-vllm-tests-", suffix=".txt")
        os.close(fd)
        os.environ[VLLM_FILES_ENV] = path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker: the files that hold a ``vllm`` test written down (both workers collect the same tests, in
    the same order, and write the same lines; each its own file)."""
    path = os.environ.get(VLLM_FILES_ENV)
    if path and hasattr(config, "workerinput"):
        files = sorted({_file_of(item.nodeid) for item in items if item.get_closest_marker("vllm")})
        Path(f"{path}.{config.workerinput['workerid']}").write_text("".join(f"{f}\n" for f in files))
        # The heavy files first and the files that use the session's server after the others (both workers reorder
        # alike: their collections must be the same), so that it starts after the long runs of the vLLM unit and
        # does not hold its memory during them.
        session = {_file_of(item.nodeid) for item in items if "vllm_server" in getattr(item, "fixturenames", ())}
        items.sort(key=lambda item: _rank(_file_of(item.nodeid), session))


def _rank(file: str, session: set[str]) -> tuple[bool, bool, int]:
    """Where a test file's tests go in a worker's collection: ``OVERLAP_FILES`` last, then the files that use the
    session's server, and ``HEAVY_FILES`` first, in their order."""
    heavy = HEAVY_FILES.index(file) if file in HEAVY_FILES else len(HEAVY_FILES)
    return file in OVERLAP_FILES, file in session, heavy


@pytest.hookimpl(tryfirst=True)  # before xdist's own choice of scheduler
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` (a file's tests run in order on one worker, as they were written to), but with every
    file that starts vLLM in one unit of work, taken first: those tests run one after another on one worker, so the
    session's server starts once, the tests that kill a vLLM (and then free the shared memory that no process maps)
    never run beside another vLLM test, and no two runs of trainer + vLLM share the machine's memory. The other
    worker takes the quick files, a file at a time. On 2 cores the tests compete for the cores: with every vLLM test
    on one worker the suite took 2,339 s (2,299 s from a fresh clone, 14.6 GB in use at most); with the two longest
    vLLM files as units of their own beside it, longer (2,384 s, 18 of 24 GB in use); with test_train_options.py as a
    unit of its own, last, 2,449 s, and on CI its two-process run (2 trainers and a vLLM, beside a test of the vLLM
    unit and the session's server) had a trainer process SIGKILLed, as the kernel's out-of-memory killer does. With
    the README snippet's and the notebooks' files (their own vLLM each, no session server) as units queued last, so
    that the worker done with the quick files ran them beside the vLLM unit's tail (which it had run alone for 1,081
    s of a 2,216 s run), the suite took no less (2026-11-29, fresh clone: both sides of the overlap ran 1.6-1.8x
    slower, the vLLM tests keep both cores busy) and 17.6 GB were in use at once instead of 11.8. That was with
    OpenMP threads spinning while they wait; since they sleep (``run.sh test``, OMP_WAIT_POLICY), an e2e test keeps
    1.2 of the 2 cores busy on average (the README snippet's: 95 s user + 25 s system in 98 s), so those files
    (``OVERLAP_FILES``) are units of their own, queued last again: CI was 30:30 with them in the vLLM unit
    (2026-12-06)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class VLLMFilesTogether(LoadScopeScheduling):
        vllm_files: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.vllm_files is None:  # called once every worker has collected
                path = os.environ[VLLM_FILES_ENV]
                written = [Path(p) for p in Path(path).parent.glob(f"{Path(path).name}.*")]
                self.vllm_files = {line for p in written for line in p.read_text().splitlines()}
                for p in [Path(path), *written]:
                    p.unlink(missing_ok=True)
            file = _file_of(nodeid)
            return "vllm" if file in self.vllm_files and file not in OVERLAP_FILES else file

    config.option.loadscopereorder = False  # collection order: tests/e2e (vLLM) first
    return VLLMFilesTogether(config, log)


@pytest.fixture(scope="session")
def prepared_model():
    """The default model's folder, prepared once in the user's cache (later runs find it ready)."""
    from lit_trainer.models.embedded import prepare_default_model

    return prepare_default_model().path


@pytest.fixture(scope="session")
def trainer_model(prepared_model: Path):
    """The default model loaded with transformers in float32, as the trainer holds it."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(prepared_model, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def vllm_server(prepared_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """A running lit-managed vLLM server on the default model; gone (whole process group) after the session."""
    from lit_trainer.engine.config import InferenceConfig
    from lit_trainer.engine.server import InferenceServer

    # 1 GiB of KV cache (23k tokens) is plenty here, and this server lives through tests that start a vLLM of their
    # own: on a 24 GB machine the default 2 GiB for each got one of them OOM-killed
    config = InferenceConfig(model=str(prepared_model), log_dir=str(tmp_path_factory.mktemp("vllm-logs")),
                             cpu_kv_cache_gb=1)
    with InferenceServer(config) as server:
        pgid, private_dir = server.process.pid, server._private_dir
        yield server
    from lit_sdk.processes import group_members

    assert group_members(pgid) == [], f"vLLM processes survived the fixture: {group_members(pgid)}"
    assert not private_dir.exists(), f"the server's private folder (vLLM's sockets) survived it: {private_dir}"
    assert os.path.exists(server.log_path)


@pytest.fixture
def short_temp():
    """A temporary directory for a trainer's processes (their ``TMPDIR``), removed after the test: vLLM's IPC sockets
    go under it, and a socket's path holds 107 bytes at most (pytest's ``tmp_path`` is deeper than that allows)."""
    import shutil

    folder = Path(tempfile.mkdtemp(prefix="lit-test-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def vllm_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's Python modules importable in this process, for the few tests of lit code that runs beside vLLM's own
    classes (its middleware, its GPU weight-transfer engines). lit keeps vLLM in an environment of its own
    (``vllm_python``: run.sh's ``.venv/vllm``), so its site-packages go at the END of ``sys.path``: this
    environment's packages win wherever both have one. Fails, never skips, when no vLLM can be found."""
    import importlib.util
    import subprocess
    import sys

    from lit_trainer.engine.config import InferenceConfig
    from lit_trainer.engine.launch import vllm_python

    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin:  # installed here, or imported by an earlier test from vLLM's environment
        site = str(Path(spec.origin).parents[1])  # whose site-packages (fastapi...) that test's monkeypatch took away
        if site not in sys.path:
            monkeypatch.setattr(sys, "path", [*sys.path, site])
        return
    python = vllm_python(InferenceConfig())
    probe = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    site = out.stdout.strip()
    if out.returncode != 0 or not Path(site, "vllm").is_dir():
        pytest.fail(f"vLLM is not installed for {python} (run.sh installs it in .venv/vllm)")
    monkeypatch.setattr(sys, "path", [*sys.path, site])
