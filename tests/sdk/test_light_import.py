"""The SDK runs inside agent processes: importing it must not pull in the trainer's heavy stack."""

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "vllm", "accelerate", "lit_trainer")


def test_import_lit_sdk_loads_no_heavy_module():
    code = (
        "import sys, json, lit_sdk\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_the_check_itself_sees_heavy_modules():
    # Guards the test above against passing vacuously: the same probe does see torch once it is imported.
    code = "import sys, torch, lit_sdk\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
