#!/usr/bin/env bash
# Train draft heads (eagle3, medusa, mtp by default) for one target on one CUDA GPU, in one go.
#
# The answers are made once (transformers backend: batched greedy generation), then each head
# trains on them. By default every training run captures the target's hidden states straight into
# GPU memory (--capture-in-memory: no disk shards to write or read back, and whole prompts in the
# context). Several heads train side by side; a GPU time-slices between processes, so list only
# the heads you need in METHODS when one of them matters most.
#
# Usage: scripts/train_gpu.sh OUT_DIR [more `tandem train` options for every run]
# Knobs (environment): TANDEM (command, default tandem), TARGET, DEVICE (cuda; cpu for a smoke
# run), NUM_PROMPTS, MAX_NEW_TOKENS, GENERATION_BATCH, DATA_MINUTES (answering budget), METHODS
# (default "eagle3 medusa mtp"; also dflash, dspark, draft_model), TRAIN_MINUTES (per head),
# PROMPT_CONTEXT (prompt tokens kept in training batches, 0 = all), CAPTURE_IN_MEMORY (1, or 0
# for disk shards made once; CAPTURE_LAYERS then adds layers to them, mtp's L-1 by default).
# Per method, with its name in capitals (EAGLE3, MEDUSA, MTP, DFLASH, DSPARK, DRAFT_MODEL):
# <NAME>_STEPS, <NAME>_BATCH, <NAME>_LR, and <NAME>_INIT (an exported head of that method to
# fine-tune instead of a fresh one; it keeps its own options).
# Each head lands in OUT_DIR/<method> (loadable by --speculative-draft-model-path), its log in
# OUT_DIR/<method>.log.
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 OUT_DIR [tandem train options...]" >&2
    exit 2
fi
out=$1
shift
read -r -a tandem <<< "${TANDEM:-tandem}"
read -r -a methods <<< "${METHODS:-eagle3 medusa mtp}"
for method in "${methods[@]}"; do  # before any GPU time is spent
    case $method in
        eagle3|medusa|mtp|dflash|dspark|draft_model) ;;
        *) echo "[train_gpu] unknown method $method (eagle3, medusa, mtp, dflash, dspark, draft_model)" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
common=(--target "${TARGET:-smollm2-135m-instruct}" --device "${DEVICE:-cuda}" --backend transformers
        --num-prompts "${NUM_PROMPTS:-30000}" --held-out 48 --max-new-tokens "${MAX_NEW_TOKENS:-192}"
        --generation-batch "${GENERATION_BATCH:-512}" --max-prompt-context "${PROMPT_CONTEXT:-0}" "$@")
capture=()
if [ "${CAPTURE_IN_MEMORY:-1}" = 1 ]; then
    capture=(--capture-in-memory)
fi

echo "[train_gpu] data: answers${capture:+ (hidden states: in memory, per run)}"
"${tandem[@]}" -v train --method eagle3 --out "$out/eagle3" "${common[@]}" "${capture[@]}" --draft-vocab-size 8192 \
    --capture-layers ${CAPTURE_LAYERS:-29} --data-only --max-data-minutes "${DATA_MINUTES:-10}" 2>&1 | tee "$out/data.log"

echo "[train_gpu] training ${methods[*]} side by side"
train() {
    local method=$1
    shift
    "${tandem[@]}" -v train --method "$method" --out "$out/$method" "${common[@]}" "${capture[@]}" \
        --max-data-minutes 0 --max-minutes "${TRAIN_MINUTES:-30}" "$@" > "$out/$method.log" 2>&1
}
# A method's knob: knob METHOD NAME DEFAULT reads e.g. DSPARK_STEPS, else the default.
knob() {
    local var
    var="$(echo "$1" | tr '[:lower:]' '[:upper:]')_$2"
    echo "${!var:-$3}"
}
# The head each method trains when it does not start from an exported one (<NAME>_INIT).
head_options() {
    case $1 in
        eagle3) echo "--draft-vocab-size 8192 --head-option unroll_steps=5" ;;
        medusa) echo "--num-heads 3" ;;
        mtp) echo "--depth 2" ;;
        dflash|dspark) echo "--draft-vocab-size 8192 --head-option block_size=8 --head-option anchors_per_sequence=16" ;;
        draft_model) echo "--num-layers 2" ;;
    esac
}
pids=()
for method in "${methods[@]}"; do
    case $method in
        eagle3) steps=4000 batch=32 lr=2e-3 ;;
        medusa) steps=4000 batch=32 lr=3e-3 ;;
        mtp) steps=4000 batch=32 lr=1e-3 ;;
        dflash|dspark) steps=4000 batch=32 lr=1e-3 ;;
        draft_model) steps=2000 batch=16 lr=1e-3 ;;
    esac
    init=$(knob "$method" INIT "")
    if [ -n "$init" ]; then
        head=(--init-from "$init")
    else
        read -r -a head <<< "$(head_options "$method")"
    fi
    train "$method" "${head[@]}" --steps "$(knob "$method" STEPS $steps)" --batch-size "$(knob "$method" BATCH $batch)" \
        --lr "$(knob "$method" LR $lr)" --eval-every 500 --checkpoint-every 250 & pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=1
done
for method in "${methods[@]}"; do
    echo "[train_gpu] $method: $(grep -E 'held-out \(|stopped|finished' "$out/$method.log" | tail -2 | tr '\n' ' ')"
done
exit $status
