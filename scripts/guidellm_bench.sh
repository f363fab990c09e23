#!/usr/bin/env bash
# guidellm (PyPI, vLLM's load generator) against `tandem serve`, offline and on loopback only,
# then `tandem bench serve` against the same server at the same concurrency levels, so the two
# clients' figures sit side by side (docs/serving.md, "A load generator nobody here wrote").
#
#   bash scripts/guidellm_bench.sh                          # the default server
#   SERVER_FLAGS="--speculative-algorithm none" LEVELS=1,8 SECONDS_PER_LEVEL=20 bash scripts/guidellm_bench.sh
#
# guidellm gets its own virtual environment (.venv-guidellm: it pins click, datasets and others
# that tandem's does not need) and reads the model's tokenizer from tandem's local cache, so
# nothing is fetched from a model hub. Each level runs for SECONDS_PER_LEVEL (bounded in time).
set -euo pipefail
cd "$(dirname "$0")/.."
LEVELS=${LEVELS:-1,8,32}
SECONDS_PER_LEVEL=${SECONDS_PER_LEVEL:-30}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-64}
MODEL=${MODEL:-smollm2-135m-instruct}
OUT=${OUT:-results/serve}
PORT=${PORT:-$(.venv/bin/python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")}
mkdir -p "$OUT" results/tmp

if [ ! -x .venv-guidellm/bin/guidellm ]; then
  python3 -m venv .venv-guidellm
  .venv-guidellm/bin/python -m pip install --quiet torch==2.13.0   # from local disk, as in setup.sh
  .venv-guidellm/bin/python -m pip install --quiet guidellm==0.8.1
fi
TOKENIZER=$(.venv/bin/python -c "from tandem.model.catalogue import resolve_model; print(resolve_model('$MODEL').hf_dir)")

# shellcheck disable=SC2086
.venv/bin/tandem serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" --log-level warning ${SERVER_FLAGS:-} \
  > results/tmp/guidellm-server.log 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "the server exited; see results/tmp/guidellm-server.log" >&2; exit 1; }
  sleep 1
done

HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 timeout $(( (${#LEVELS} + 2) * (SECONDS_PER_LEVEL + 60) )) \
  .venv-guidellm/bin/guidellm run \
  --backend "kind=openai_http,target=http://127.0.0.1:$PORT,model=$MODEL" \
  --profile kind=concurrent,streams=1 --override profile.streams "$LEVELS" \
  --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
  --tokenizer "kind=huggingface_auto,model=$TOKENIZER" \
  --constraint "kind=max_duration,seconds=$SECONDS_PER_LEVEL" \
  --output kind=json,path=results/tmp/guidellm.json --output kind=console --disable-progress

.venv/bin/python - "$OUT/guidellm_summary.json" "$MODEL" "${SERVER_FLAGS:-}" <<'PY'
"""The per-level headline figures of guidellm's report (results/tmp/guidellm.json, 1+ MB)."""
import json, sys
from tandem.bench.spec import machine_info
report = json.load(open("results/tmp/guidellm.json"))
levels = []
for b in report["benchmarks"]:
    m = b["metrics"]
    def stat(name, key="median"):
        s = m[name]["successful"]
        return s["percentiles"][key] if key.startswith("p") else s[key]
    levels.append({
        "concurrency": b["config"]["strategy"]["streams"], "requests": m["request_totals"]["successful"],
        "errored": m["request_totals"]["errored"], "output_tokens_per_second": stat("output_tokens_per_second", "mean"),
        "ttft_p50_ms": stat("time_to_first_token_ms", "p50"), "ttft_p95_ms": stat("time_to_first_token_ms", "p95"),
        "itl_p50_ms": stat("inter_token_latency_ms", "p50"), "itl_p95_ms": stat("inter_token_latency_ms", "p95"),
    })
out = {"tool": "guidellm", "model": sys.argv[2], "server_flags": sys.argv[3], "machine": machine_info(), "levels": levels}
json.dump(out, open(sys.argv[1], "w"), indent=2)
print(f"wrote {sys.argv[1]}")
PY

# The same server, the same levels, tandem's own client (Spec-Bench chat prompts, greedy).
# shellcheck disable=SC2046
.venv/bin/tandem bench serve --model "$MODEL" --url "adaptive=http://127.0.0.1:$PORT/v1" --modes adaptive \
  --concurrency $(echo "$LEVELS" | tr ',' ' ') --requests-per-user 2 --max-tokens "$OUTPUT_TOKENS" \
  --out "$OUT/bench_serve_beside_guidellm.json" --plot ""
