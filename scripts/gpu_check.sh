#!/usr/bin/env bash
# shuttle's GPU check: one script, under 10 minutes on one GPU, every stage bounded by its own timeout.
#
#     bash scripts/gpu_wheels.sh              # first, on a machine that reaches PyPI: fills .gpu_carry/
#     bash scripts/gpu_check.sh               # on the GPU machine, from the source tree (carry .gpu_carry)
#     bash scripts/gpu_check.sh --dry-run     # the whole script on a CPU with tiny shapes (tests/e2e/test_gpu_check.py)
#
# Stages (scripts/dev/gpu_check.py, then scripts/dev/bench_compare.py):
#   setup     the carried wheels of whatever the machine lacks, installed into a --target folder on PYTHONPATH
#             (the machine's own torch, triton and transformers stay in use)
#   exact     float32 greedy on CUDA with the flex backend equal to transformers' generate (a random Llama of
#             head_dim 32 on the GPU, stories260K in the dry run)
#   bf16      bfloat16 agreement with transformers' bfloat16 over 32 prompts
#   compiles  dynamo compiles after warm-up (must be 0)
#   graphs    CUDA-graph replay equal to --enforce-eager
#   spec      greedy with n-gram and draft-model speculation equal to none; n-gram's speed-up at concurrency 1
#   bench     a 1B-shape random Llama: shuttle against transformers' static batches and continuous batching
#   roofline  decode steps at batch 1, 16, 64 and 256 of the 1B shape (and the 8B shape when the budget allows)
#             against their floor (bytes / measured bandwidth, FLOPs / measured peak), the largest one profiled
# One table at the end; JSON records and the whole log, the table at its end, go to $OUT (the device tool's folder)
# when set, else bench_results/gpu_check/. Exit status 0 when no stage failed.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
RESULTS="${OUT:-$REPO/bench_results/gpu_check}"
mkdir -p "$RESULTS"
rm -f "$RESULTS"/{exact,bf16,compiles,graphs,spec,roofline,bench}.json
LOG="$RESULTS/gpu_check.log"
: >"$LOG"
CARRY="${SHUTTLE_GPU_CARRY:-$REPO/.gpu_carry}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-570}"  # the whole script, setup to table; each stage gets at most what is left
START_S=$SECONDS
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if [ "$DRY_RUN" = 1 ]; then
    PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
    [ -x "$PYTHON" ] || PYTHON=python3
    DEVICE=cpu
    TEST_MODEL="${SHUTTLE_TEST_MODEL:-$REPO/../shared/models/stories260K}"
    [ -d "$CARRY/models/stories260K" ] && [ -z "${SHUTTLE_TEST_MODEL:-}" ] && TEST_MODEL="$CARRY/models/stories260K"
    TOKENIZER="$CARRY/tokenizers/llama2"
    [ -f "$TOKENIZER/tokenizer.json" ] || TOKENIZER="$REPO/../shared/tokenizers/llama2"
    SCRATCH="$(mktemp -d)"
    trap 'rm -rf "$SCRATCH"' EXIT
    BENCH_MODEL="$SCRATCH/tiny-llama"
    MAKE_MODEL=(--shape tiny --device cpu --dtype float32)
    BENCH=(--device cpu --dtype float32 --num-requests 8 --prompt-len 8 32 --output-len 4 12 --batch-size 8
           --repeats 1 --skip sequential continuous --bare-batch 8 --bare-context 16
           --serve-args "--device cpu --dtype float32 --max-model-len 128 --num-kv-blocks 256")
else
    PYTHON="${PYTHON:-python3}"
    DEVICE=cuda
    # stories260K's head_dim 8 is below the 16 inductor's flex kernels take (flex refuses it on CUDA), so the
    # in-process stages run a random Llama of head_dim 32, built here first
    TEST_MODEL=/tmp/shuttle-models/llama-check
    TOKENIZER="$CARRY/tokenizers/llama2"
    BENCH_MODEL=/tmp/shuttle-models/llama-1b
    MODEL_8B=/tmp/shuttle-models/llama-8b
    MAKE_MODEL=(--shape 1b --device cuda --dtype bfloat16)
    # 64 requests at once (prompts 16-256, outputs 16-128), one round after a warm-up; transformers one at a time
    # is left out (minutes at 1B). shuttle gets half the GPU, so transformers has room beside it.
    BENCH=(--device cuda --dtype bfloat16 --repeats 1 --skip sequential --batch-size 64 --bare-batch 64
           --bare-context 128 --min-ratio 2
           --serve-args "--device cuda --dtype bfloat16 --attention-backend flex --gpu-memory-utilization 0.5
                         --max-model-len 512")
fi

say() { echo "gpu_check: $*" | tee -a "$LOG"; }

# run NAME CAP_SECONDS CMD...: the command under `timeout`, bounded by CAP and by what is left of the budget less
# RESERVE_S (the seconds kept for the stages after it)
RESERVE_S=0
run() {
    local name=$1 cap=$2
    shift 2
    local left=$((BUDGET_S - (SECONDS - START_S) - RESERVE_S))
    local limit=$((cap < left ? cap : left))
    if [ "$limit" -le 5 ]; then
        say "$name: not run, the ${BUDGET_S} s budget is spent"
        return 124
    fi
    say "$name: up to ${limit} s: $*"
    local began=$SECONDS
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    say "$name: exit $rc after $((SECONDS - began)) s"
    [ "$rc" = 124 ] && say "$name: TIMED OUT at ${limit} s"
    return "$rc"
}

# ---- setup: the carried wheels of what this machine lacks ------------------------------------------------------
SITE="${TMPDIR:-/tmp}/shuttle-gpu-site"
setup=("$PYTHON" scripts/dev/install_wheels.py "$CARRY/wheels" "$SITE")

say "$( [ "$DRY_RUN" = 1 ] && echo "DRY RUN on the CPU" || echo "GPU run" ); results in $RESULTS"
if [ "$DRY_RUN" = 0 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
    run setup 90 "${setup[@]}" || { say "setup failed: nothing else can run"; exit 1; }
    export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
elif [ -d "$CARRY/wheels" ]; then
    run setup 60 "${setup[@]}" || say "setup failed (dry run: the venv has everything, carrying on)"
    export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
    say "setup: skipped in the dry run ($CARRY/wheels absent; the venv has every package)"
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi

# ---- the in-process stages ------------------------------------------------------------------------------------
if [ "$DRY_RUN" = 0 ]; then
    run make-test-model 60 "$PYTHON" scripts/dev/make_random_model.py --shape check --device cuda --dtype float32 \
        --out "$TEST_MODEL" --tokenizer "$TOKENIZER"
fi
RESERVE_S=180  # the bench's: slow correctness stages must not leave it too little to start shuttle at 1B
[ -n "${GPU_CHECK_SKIP_BENCH:-}" ] && RESERVE_S=0
STAGE_ARGS=(--device "$DEVICE" --model "$TEST_MODEL")
[ "$DRY_RUN" = 1 ] && STAGE_ARGS+=(--dry-run)
if [ "$DRY_RUN" = 1 ]; then  # one process for all four: on a small CPU each start-up costs seconds
    run stages 200 "$PYTHON" scripts/dev/gpu_check.py exact bf16 compiles graphs spec "${STAGE_ARGS[@]}" \
        --out-dir "$RESULTS"
else  # one process each, so a stage that hangs or breaks the CUDA context leaves the others their run
    for stage in exact:90 bf16:100 compiles:90 graphs:75 spec:60; do
        name=${stage%%:*}
        run "$name" "${stage##*:}" "$PYTHON" scripts/dev/gpu_check.py "$name" "${STAGE_ARGS[@]}" --out-dir "$RESULTS"
    done
fi

# ---- the bench ------------------------------------------------------------------------------------------------
RESERVE_S=0
if [ -n "${GPU_CHECK_SKIP_BENCH:-}" ]; then
    say "bench: skipped (GPU_CHECK_SKIP_BENCH)"
elif run make-model 60 "$PYTHON" scripts/dev/make_random_model.py "${MAKE_MODEL[@]}" --out "$BENCH_MODEL" \
        --tokenizer "$TOKENIZER"; then
    run bench 210 "$PYTHON" scripts/dev/bench_compare.py --model "$BENCH_MODEL" "${BENCH[@]}" \
        --result-json "$RESULTS/bench.json"
fi

# ---- the roofline ---------------------------------------------------------------------------------------------
ROOFLINE_MODELS=("$BENCH_MODEL")
if [ "$DRY_RUN" = 0 ] && [ $((BUDGET_S - (SECONDS - START_S))) -gt 200 ] && run make-model-8b 70 "$PYTHON" \
        scripts/dev/make_random_model.py --shape 8b --device cuda --dtype bfloat16 --out "$MODEL_8B" \
        --tokenizer "$TOKENIZER"; then
    ROOFLINE_MODELS+=("$MODEL_8B")
fi
if [ -d "$BENCH_MODEL" ]; then
    run roofline 150 "$PYTHON" scripts/dev/gpu_check.py roofline "${STAGE_ARGS[@]}" --out-dir "$RESULTS" \
        --roofline-models "${ROOFLINE_MODELS[@]}"
fi

say "done in $((SECONDS - START_S)) s"
"$PYTHON" scripts/dev/gpu_check.py table "$RESULTS" 2>&1 | tee -a "$LOG"  # the log's end: 8 files come back
exit "${PIPESTATUS[0]}"
