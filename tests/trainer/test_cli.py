import subprocess
import sys
from pathlib import Path


def test_help_lists_the_subcommands_without_importing_torch():
    code = (
        "import sys\n"
        "from lit_trainer.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    for name in ("model", "train", "eval", "worker"):
        assert f"\n    {name} " in out.stdout, out.stdout
    assert out.stdout.strip().endswith("NO-TORCH")


def test_lit_console_script_is_installed():
    lit = Path(sys.executable).parent / "lit"
    out = subprocess.run([str(lit), "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("lit ")


def test_unfinished_command_says_so_and_fails():
    out = subprocess.run([sys.executable, "-m", "lit_trainer.cli", "train"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "not available" in out.stderr
