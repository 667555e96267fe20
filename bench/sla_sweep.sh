#!/usr/bin/env bash
# The SLA loop measured from outside (issue 12): the embedded model behind the router, swept with `llmdeploy bench`
# by concurrency and by arrival rate, with a burst drill, first with the cloud off, then with a fake
# OpenAI-compatible cloud on loopback (0.3 s to its first token, 20 ms a token). JSON, charts and the terminal
# tables go to $OUT (default bench/out/sla-<date>); figures for bench/RESULTS.md come from there.
#
#   bench/sla_sweep.sh            # about 12 minutes on a 2-core CPU
#   DURATION=10s bench/sla_sweep.sh
#   CLOUDS=true bench/sla_sweep.sh   # only the cloud-on half
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-bench/out/sla-$(date +%Y%m%d-%H%M)}
DURATION=${DURATION:-20s}
PORT=${PORT:-8790}
CLOUD_PORT=${CLOUD_PORT:-9100}
mkdir -p "$OUT"
export LLMDEPLOY_HOME="$OUT/home" LLMDEPLOY_API_KEY="bench-$(date +%s%N)" FAKE_CLOUD_KEY="cloud-$(date +%s%N)"
export FAKE_CLOUD_EXPECTED_KEY="$FAKE_CLOUD_KEY"
LD=.venv/bin/llmdeploy

spec() {  # $1 = true|false: the cloud
  cat <<EOF
name: sla-bench
model: {path: "builtin:smollm2-135m-instruct", served_alias: chat, max_model_len: 1024}
listen: 127.0.0.1:$PORT
auth: {keys: [{name: bench, key_env: LLMDEPLOY_API_KEY}]}
engine: {kv_cache_gb: 0.5}
sla: {ttft_p99_ms: 1000, tpot_p99_ms: 200}
cloud:
  enabled: $1
  provider: openai-compatible
  base_url: http://127.0.0.1:$CLOUD_PORT/v1
  api_key_env: FAKE_CLOUD_KEY
  model: cloud-model
EOF
}

.venv/bin/python tests/helpers/fake_cloud.py --port "$CLOUD_PORT" >"$OUT/fake_cloud.log" 2>&1 &
CLOUD_PID=$!
trap '$LD down --name sla-bench >/dev/null 2>&1 || true; kill $CLOUD_PID 2>/dev/null || true' EXIT
for _ in $(seq 50); do curl -sf "http://127.0.0.1:$CLOUD_PORT/_stats" >/dev/null && break; sleep 0.2; done
curl -sf -X POST "http://127.0.0.1:$CLOUD_PORT/_control" -H 'Content-Type: application/json' \
  -d '{"delay_s": 0.3, "chunk_delay_s": 0.02}' >/dev/null

lscpu | grep -E 'Model name' | tee "$OUT/cpu.txt"
for cloud in ${CLOUDS:-false true}; do
  name=$([ "$cloud" = true ] && echo cloud-on || echo cloud-off)
  spec "$cloud" >"$OUT/$name.yaml"
  $LD apply "$OUT/$name.yaml" --force | tail -3
  $LD bench --sla-from "$OUT/$name.yaml" --concurrency 1,4,16,32 --duration "$DURATION" \
    --prompt-len 128 --output-len 64 --json "$OUT/$name-concurrency.json" --chart "$OUT/$name-concurrency.png" \
    | tee "$OUT/$name-concurrency.txt" || true
  $LD bench --sla-from "$OUT/$name.yaml" --rate 1,2,4,8 --duration "$DURATION" --burst 3x:20s:30s \
    --prompt-len 128 --output-len 64 --json "$OUT/$name-rate.json" --chart "$OUT/$name-rate.html" \
    | tee "$OUT/$name-rate.txt" || true
done
echo "results in $OUT"
