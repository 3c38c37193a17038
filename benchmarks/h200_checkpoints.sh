#!/usr/bin/env bash
# Real checkpoints and published shapes in their shipping dtype, through the trainer a user
# runs (`python -m engine train`, load check on, no bypass), on one NVIDIA GPU (issue 24).
#
#   bash benchmarks/cuda_wheels.sh              # once, here: MLX's CUDA build into .whl/
#   pip download --no-deps -d .devwhl gguf==0.19.0 transformers==5.24.0   # import needs
#   bash benchmarks/h200_checkpoints.sh SECTION... OUT_DIR   # on the GPU machine
#
# Sections: shapes (Gemma 4 E4B's text decoder in bf16 and 4-bit, Gemma 3 4B in bf16:
# random weights, `python -m benchmarks shape`), e4b (an 8k pair a step: bf16, and 4-bit
# under memory_limit_gb 9.3), gemma3-4b (2k pairs, bf16), mutate (the load check on each
# shape with its sliding windows dropped: must refuse), real (SmolLM2-135M and Gemma 3
# 270M, each in bf16 and 4-bit, imported from their PyPI GGUFs in $GGUF_DIR, trained on the
# reverse task tokenized in $DATA_DIR for each: `pomona data tokenize` with the import),
# dpo (issue 25: the E4B shape in bf16, one 4k pair a step, ORPO against DPO with its
# reference cached, the levers on; the one-off reference pass timed per pair). Each run
# leaves its log and summary in OUT_DIR.
set -euo pipefail
out="${*: -1}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
M=${MODELS:-/tmp/m} D=${PAIRS:-/tmp/d}
GGUF_DIR=${GGUF_DIR:-/tmp/gguf} DATA_DIR=${DATA_DIR:-.gpu/data}

py() { (source .whl/activate.sh && PYTHONPATH="/tmp/site2:$PYTHONPATH" python3 "$@"); }

setup() {
  [ -d /tmp/site2/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --target /tmp/site2 .devwhl/*.whl
}

pairs() {  # pairs NAME N PROMPT RESPONSE: random-id pairs (the shapes' data)
  py - "$D/$1.jsonl" "$2" "$3" "$4" <<'PY'
import json, sys
import numpy as np
path, n, p, r = sys.argv[1], *map(int, sys.argv[2:])
rng = np.random.default_rng(0)
ids = lambda k: rng.integers(10, 262000, k).tolist()
with open(path, "w") as f:
    for i in range(n):
        f.write(json.dumps({"id": f"p{i}", "split": "train", "prompt_ids": ids(p),
                            "chosen_ids": ids(r), "rejected_ids": ids(r)}) + "\n")
PY
}

train() {  # train NAME ARGS...: one run, its log and summary kept
  local name=$1; shift
  echo "-- $name: python -m engine train $*" | tee "$out/$name.log"
  local t0=$SECONDS
  py -m engine train --out "/tmp/runs/$name" "$@" >> "$out/$name.log" 2>&1 \
    || echo "run $name failed (rc $?)" | tee -a "$out/$name.log"
  echo "-- $name: $((SECONDS - t0)) s wall" | tee -a "$out/$name.log"
  cp "/tmp/runs/$name/summary.json" "$out/$name.summary.json" 2>/dev/null || true
  cp "/tmp/runs/$name/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null || true
}

LEVERS="--segment-size 1 --head-chunk 256 --mlp-chunk 1024 --val-every 0 --report-every 1"

for section in "${@:1:$#-1}"; do
  echo "== $section $(date -u +%FT%TZ)"
  setup
  mkdir -p "$M" "$D" /tmp/runs
  case "$section" in
    shapes)  # SHAPES="e4b-bf16 e4b-q4" writes those only
      for spec in "e4b bfloat16 e4b-bf16" "e4b bfloat16 e4b-q4 4" "gemma3-4b bfloat16 g34b-bf16"; do
        set -- $spec
        case " ${SHAPES:-e4b-bf16 e4b-q4 g34b-bf16} " in *" $3 "*) ;; *) continue ;; esac
        [ -f "$M/$3/config.json" ] || py -m benchmarks shape --preset "$1" --dtype "$2" \
          ${4:+--quantize $4} --out "$M/$3" 2>&1 | tee -a "$out/shapes.log"
      done ;;
    e4b)  # E4B_BF16=0 skips the bf16 run
      pairs e4b-8k 3 6554 1638
      [ "${E4B_BF16:-1}" = 0 ] || train e4b-bf16-8k --model "$M/e4b-bf16" \
        --data "$D/e4b-8k.jsonl" --steps 3 --batch-size 1 $LEVERS
      train e4b-q4-8k-lim9.3 --model "$M/e4b-q4" --data "$D/e4b-8k.jsonl" --steps 3 \
        --batch-size 1 --memory-limit-gb 9.3 $LEVERS ;;
    gemma3-4b)
      pairs g34b-2k 8 1639 410
      train g34b-bf16-2k --model "$M/g34b-bf16" --data "$D/g34b-2k.jsonl" --steps 3 \
        --batch-size 2 $LEVERS ;;
    mutate)  # MUTATE="e4b-bf16 e4b-q4" checks those only
      for m in ${MUTATE:-e4b-bf16 e4b-q4 g34b-bf16}; do
        py -m benchmarks check --model "$M/$m" --mutate drop-window --json \
          > "$out/check_$m.json" 2> "$out/check_$m.log" || echo "check $m: not refused" >&2
      done ;;
    real)
      for spec in "smollm2 SmolLM2-135M-Instruct.Q4_1.gguf bfloat16" \
                  "smollm2 SmolLM2-135M-Instruct.Q4_1.gguf bfloat16 4" \
                  "gemma3-270m gemma-3-270m-q4_k_m.gguf bfloat16" \
                  "gemma3-270m gemma-3-270m-q4_k_m.gguf bfloat16 4"; do
        set -- $spec
        local_dir="$M/$1-$3${4:+-q$4}"
        [ -f "$local_dir/config.json" ] || py -m cli.main model import "$GGUF_DIR/$2" \
          --out "$local_dir" --dtype "$3" ${4:+--quantize $4} 2>&1 | tee -a "$out/import.log"
        train "$(basename "$local_dir")" --model "$local_dir" --data "$DATA_DIR/$1-reverse" \
          --steps 20 --batch-size 8 --learning-rate 5e-4 --segment-size 4 --head-chunk 256 \
          --nll-span response --orpo-lambda 1.0 --val-every 10 --report-every 5
      done ;;
    dpo)  # order: orpo (warms the JIT), dpo (makes the reference), dpo and orpo again
      pairs e4b-4k 8 3277 819
      export XDG_CACHE_HOME=/tmp/dpo-cache
      for run in ${RUNS:-orpo dpo-ref dpo orpo-again}; do  # RUNS: some of them, in order
        train "e4b-4k-$run" --model "$M/e4b-bf16" --data "$D/e4b-4k.jsonl" --steps 8 \
          --batch-size 1 --loss "${run%%-*}" $LEVERS
      done
      [ -f "$out/e4b-4k-orpo-again.metrics.jsonl" ] || continue  # the figures need all four
      py benchmarks/step_times.py "$out"/e4b-4k-{orpo,dpo-ref,dpo,orpo-again}.metrics.jsonl \
        | tee "$out/dpo-vs-orpo.txt"
      grep -h "reference log-probs: .* pairs in" "$out"/e4b-4k-dpo-ref.log \
        | tee -a "$out/dpo-vs-orpo.txt" ;;
    *) echo "unknown section $section" >&2; exit 2 ;;
  esac
done
