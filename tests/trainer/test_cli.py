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


def test_train_with_a_missing_config_fails_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lit_trainer.cli", "train", str(tmp_path / "nope.toml")],
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stderr.strip() == f"lit: error: no config file at {tmp_path / 'nope.toml'}"


def test_train_with_a_bad_override_names_the_key(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[agent]\nfunction = "m:f"\n')
    out = subprocess.run([sys.executable, "-m", "lit_trainer.cli", "train", str(config), "train.stepz=3"],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "unknown key(s) ['stepz']" in out.stderr and "Traceback" not in out.stderr
