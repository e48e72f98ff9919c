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


def test_keys_generate_writes_private_keys_and_never_overwrites(tmp_path):
    folder = tmp_path / "keys"
    out = subprocess.run([sys.executable, "-m", "lit_trainer.cli", "keys", "generate", str(folder)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert sorted(Path(p).name for p in out.stdout.split()) == ["api_key", "client.key", "client.key_secret",
                                                               "server.key", "server.key_secret"]
    assert "client.key_secret and server.key" in out.stderr and f'keys_dir = "{folder}"' in out.stderr
    assert (folder.stat().st_mode & 0o777) == 0o700 and (folder / "server.key_secret").stat().st_mode & 0o077 == 0
    secret = (folder / "server.key_secret").read_bytes()
    again = subprocess.run([sys.executable, "-m", "lit_trainer.cli", "keys", "generate", str(folder)],
                           capture_output=True, text=True)
    assert again.returncode == 1 and "never overwrites" in again.stderr and "Traceback" not in again.stderr
    assert (folder / "server.key_secret").read_bytes() == secret


def test_train_refuses_a_public_collector_without_keys_and_says_how_to_make_them(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[agent]\nfunction = "m:f"\n[collector]\nendpoint = "tcp://0.0.0.0:7373"\n')
    out = subprocess.run([sys.executable, "-m", "lit_trainer.cli", "train", str(config)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "[collector] endpoint" in out.stderr and "lit keys generate" in out.stderr
