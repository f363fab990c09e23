#!/usr/bin/env bash
# Train eagle3, medusa and mtp heads for one target on one CUDA GPU, in one go.
#
# The data stages run once (transformers backend: batched greedy answers, then the hidden states of
# every layer the three heads read), then the three heads train side by side on the cached data: a
# small head leaves a GPU mostly idle, so three processes cost about what one does.
#
# Usage: scripts/train_gpu.sh OUT_DIR [more `tandem train` options for every run]
# Knobs (environment): TANDEM (command, default tandem), TARGET, NUM_PROMPTS, MAX_NEW_TOKENS,
# GENERATION_BATCH, CAPTURE_LAYERS (extra layers: mtp's L-1), DATA_MINUTES (answering budget),
# TRAIN_MINUTES (per head), EAGLE3_STEPS, MEDUSA_STEPS, MTP_STEPS.
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
mkdir -p "$out"
common=(--target "${TARGET:-smollm2-135m-instruct}" --device cuda --backend transformers
        --num-prompts "${NUM_PROMPTS:-20000}" --held-out 48 --max-new-tokens "${MAX_NEW_TOKENS:-192}"
        --generation-batch "${GENERATION_BATCH:-512}" "$@")

echo "[train_gpu] data: answers and hidden states"
"${tandem[@]}" -v train --method eagle3 --out "$out/eagle3" "${common[@]}" --draft-vocab-size 8192 \
    --capture-layers ${CAPTURE_LAYERS:-29} --data-only --max-data-minutes "${DATA_MINUTES:-10}" 2>&1 | tee "$out/data.log"

echo "[train_gpu] training eagle3, medusa and mtp side by side"
train() {
    local method=$1
    shift
    "${tandem[@]}" -v train --method "$method" --out "$out/$method" "${common[@]}" --max-data-minutes 0 \
        --max-minutes "${TRAIN_MINUTES:-30}" "$@" > "$out/$method.log" 2>&1
}
pids=()
train eagle3 --draft-vocab-size 8192 --head-option unroll_steps=5 --steps "${EAGLE3_STEPS:-4000}" \
    --batch-size 32 --lr 2e-3 --eval-every 500 --checkpoint-every 250 & pids+=($!)
train medusa --num-heads 3 --steps "${MEDUSA_STEPS:-4000}" --batch-size 32 --lr 3e-3 \
    --eval-every 500 --checkpoint-every 250 & pids+=($!)
train mtp --depth 2 --steps "${MTP_STEPS:-4000}" --batch-size 32 --lr 1e-3 \
    --eval-every 500 --checkpoint-every 250 & pids+=($!)
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=1
done
for method in eagle3 medusa mtp; do
    echo "[train_gpu] $method: $(grep -E 'held-out \(|stopped|finished' "$out/$method.log" | tail -2 | tr '\n' ' ')"
done
exit $status
