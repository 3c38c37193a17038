#!/usr/bin/env bash
# Data parallel on one host's CPUs: 1 process against 2 ring ranks (mlx.launch), the same
# global batches, tokens/s = median of the steps after the first two (issue 16).
#
#   bash benchmarks/ring_scaling.sh [WORK_DIR]      # prints one line per setting
#
# The model and pairs come from `pomona bench train --work` (llama, 8 layers, hidden 512,
# float32, 4 pairs of 2 x 256 tokens a step); each rank gets OPENBLAS_NUM_THREADS=1, and the
# single process runs with 1 thread and with every core.
set -euo pipefail
work="${1:-/tmp/ring-scaling}"
py="${PYTHON:-.venv/bin/python}"
launch="$(dirname "$py")/mlx.launch"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
if [ -e "$work" ] && [ ! -f "$work/bench_train.json" ] && [ -n "$(ls -A "$work")" ]; then
  echo "error: $work: not empty and not this benchmark's folder; give an empty or new one" >&2
  exit 2
fi
if [ ! -d "$work/model" ]; then
  "$py" -m benchmarks train --seq 256 --pairs 4 --layers 8 --hidden 512 --heads 8 \
    --kv-heads 4 --intermediate 1408 --vocab 1024 --dtype float32 --steps 1 --warmup 0 \
    --segment-size 1 --head-chunk 128 --work "$work" > /dev/null
fi
args=(-m engine train --model "$work/model" --data "$work/pairs.jsonl" --steps 8
      --batch-size 4 --segment-size 1 --head-chunk 128 --val-every 0 --report-every 1
      --seed 0)
median() {  # tokens/s of steps 3.. in OUT/metrics.jsonl
  "$py" -c "import json,statistics,sys; r=[json.loads(l) for l in open(sys.argv[1])]; \
print(round(statistics.median(x['tokens_per_sec'] for x in r[2:])))" "$1/metrics.jsonl"
}
rm -rf "$work/one-all" "$work/one-1" "$work/ring-2"
"$py" "${args[@]}" --out "$work/one-all" > /dev/null 2>&1
echo "1 process, all cores:       $(median "$work/one-all") tokens/s"
OPENBLAS_NUM_THREADS=1 "$py" "${args[@]}" --out "$work/one-1" > /dev/null 2>&1
echo "1 process, 1 thread:        $(median "$work/one-1") tokens/s"
port=$("$py" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
OPENBLAS_NUM_THREADS=1 "$launch" -n 2 --backend ring --starting-port "$port" \
  "$py" "${args[@]}" --out "$work/ring-2" > /dev/null 2>&1
echo "2 ring ranks, 1 thread each: $(median "$work/ring-2") tokens/s"
