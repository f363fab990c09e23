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
# Knobs (environment): TANDEM (command, default tandem), TARGET, NUM_PROMPTS, MAX_NEW_TOKENS,
# GENERATION_BATCH, DATA_MINUTES (answering budget), METHODS (default "eagle3 medusa mtp"),
# TRAIN_MINUTES (per head), EAGLE3_STEPS, MEDUSA_STEPS, MTP_STEPS, EAGLE3_BATCH, EAGLE3_LR, EAGLE3_INIT
# (an exported eagle3 head to fine-tune instead of a fresh one),
# PROMPT_CONTEXT (prompt tokens kept in training batches, 0 = all), CAPTURE_IN_MEMORY (1, or 0
# for disk shards made once; CAPTURE_LAYERS then adds layers to them, mtp's L-1 by default).
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
        eagle3|medusa|mtp) ;;
        *) echo "[train_gpu] unknown method $method (eagle3, medusa, mtp)" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
common=(--target "${TARGET:-smollm2-135m-instruct}" --device cuda --backend transformers
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
eagle3_head=(--draft-vocab-size 8192 --head-option unroll_steps=5)
if [ -n "${EAGLE3_INIT:-}" ]; then  # fine-tune an exported head (it keeps its own options)
    eagle3_head=(--init-from "$EAGLE3_INIT")
fi
pids=()
for method in "${methods[@]}"; do
    case $method in
        eagle3) train eagle3 "${eagle3_head[@]}" --steps "${EAGLE3_STEPS:-4000}" --batch-size "${EAGLE3_BATCH:-32}" \
                    --lr "${EAGLE3_LR:-2e-3}" --eval-every 500 --checkpoint-every 250 & pids+=($!) ;;
        medusa) train medusa --num-heads 3 --steps "${MEDUSA_STEPS:-4000}" --batch-size 32 --lr 3e-3 \
                    --eval-every 500 --checkpoint-every 250 & pids+=($!) ;;
        mtp) train mtp --depth 2 --steps "${MTP_STEPS:-4000}" --batch-size 32 --lr 1e-3 \
                 --eval-every 500 --checkpoint-every 250 & pids+=($!) ;;
    esac
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=1
done
for method in "${methods[@]}"; do
    echo "[train_gpu] $method: $(grep -E 'held-out \(|stopped|finished' "$out/$method.log" | tail -2 | tr '\n' ' ')"
done
exit $status
