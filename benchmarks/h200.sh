#!/usr/bin/env bash
# The GPU issue's measurements on one NVIDIA GPU, Pomona and TRL in the same run.
#
#   bash benchmarks/cuda_wheels.sh                # once, here: MLX's CUDA build into .whl/
#   # TRL's pure-Python wheels into .trlwhl/ (the GPU machine has torch, transformers, peft):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .trlwhl trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 mlx-lm-lora==5.10.2  # the GPU host runs 3.12 (multiprocess is per version)
#   bash benchmarks/h200.sh SECTION... OUT_DIR   # on the GPU machine, .whl and .trlwhl carried
#   # (through the device tool, whose $OUT returns 8 files: OUT_DIR=/tmp/r, then
#   #  tar czf $OUT/results.tgz -C /tmp/r .)
#
# Sections: ops (attention block by op, 4k and 8k), batch (split layouts of 1-8 pairs a
# micro-batch against two forwards), profile-2k, engine-8k|engine-4k|engine-2k (memory
# rows and prefix rows at segment sizes 0/1/2/4), q4 (a 4-bit base), gemma4 (Gemma 4 E4B's
# text decoder at 8k, 4-bit and bf16: plain, checkpoint, seg1, seg2, seg1p), train (the real
# trainer end to end beside TRL and mlx-lm-lora: pomona bench train --trl --peer mlx-lm-lora), e4b-train (the trainer on the
# E4B shape, levers against plain, and under a memory limit: bench train --preset e4b), timeline (the 4k trainer's and
# engine's steps kernel by kernel, text), trl (ORPOTrainer + PEFT, with and without
# gradient checkpointing, 4k and 8k). Every other result is one JSON file in OUT_DIR. Model: 16 layers, hidden 2048, GQA 32/8, intermediate 5632, vocab 32000, bf16.
set -euo pipefail
out="${*: -1}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
B="--layers 16 --hidden 2048 --heads 32 --kv-heads 8 --intermediate 5632 --vocab 32000
   --dtype bfloat16 --head-chunk 512"

mlx() { (source .whl/activate.sh && python3 -m benchmarks "$@"); }

engine() {  # engine SEQ REPEATS
  local seq=$1 n=$2
  mlx memory $B --seq "$seq" --repeats "$n" --json \
    --rows plain,checkpoint,seg1,seg2,seg4,seg1d,head_dense,head_bounded > "$out/memory_$seq.json"
  for k in 0 1 2 4; do
    mlx prefix $B --seq "$seq" --repeats "$n" --segment-size "$k" --json \
      --rows "two_forward@4:1,shared@4:1" > "$out/prefix_${seq}_seg$k.json"
  done
}

for section in "${@:1:$#-1}"; do
  echo "== $section $(date -u +%FT%TZ)"
  case "$section" in
    ops) for s in 4096 8192; do mlx ops $B --seq $s --repeats 10 --json > "$out/ops_$s.json"; done ;;
    engine-8k) engine 8192 3 ;;
    engine-4k) engine 4096 5 ;;
    engine-2k) engine 2048 5 ;;
    q4) for s in 2048 4096 8192; do
          mlx memory $B --seq $s --repeats 3 --quantize 4 --json --rows plain,seg1,seg2 \
            > "$out/q4_$s.json"
          mlx prefix $B --seq $s --repeats 3 --quantize 4 --segment-size 1 --json \
            --rows "two_forward@4:1,shared@4:1" > "$out/q4_prefix_$s.json"
        done ;;
    gemma4)  # Gemma 4 E4B's text decoder (issue 13): one 8k pair, 4-bit then bf16, and a
             # 2k bf16 anchor where plain fits; a row per file (a crash loses one row)
      g4() {  # g4 QUANT SEQ ROW...   (LIMIT=GiB: MLX's memory limit, the engine's
        local q=$1 s=$2; shift 2       # memory_limit_gb)
        for row in "$@"; do
          mlx memory --preset e4b --dtype bfloat16 --quantize "$q" --seq "$s" --repeats 2 \
            --head-chunk 256 --mlp-chunk "${MLP_CHUNK:-1024}" --memory-limit-gb "${LIMIT:-0}" \
            --json --rows "$row" > "$out/gemma4_e4b_q${q}_${s}_${row/:/-}_lim${LIMIT:-0}.json" \
            || echo "row $row (q$q, $s) failed" >&2
        done
      }
      LIMIT=9.3 g4 4 8192 seg1p:1 seg1p
      LIMIT=8 g4 4 8192 seg1p:1
      g4 4 8192 seg1p seg1p:1 seg1 seg2 checkpoint plain
      g4 0 8192 seg1p seg1 seg2 checkpoint plain
      g4 0 2048 plain checkpoint seg1 seg1p ;;
    e4b-train)  # issue 27: the trainer a user runs on the E4B shape, rows side by side in
                # one run (bench train --preset); the last line of each file is its JSON. A
                # memory_limit_gb row runs in its own process with MLX's queue capped, as
                # pomona train starts one (engine/host/command_queue.py)
      mlx train --preset e4b --seq 2048 --warmup 2 --steps 6 --segment-size 1 --head-chunk 256 \
        --mlp-chunk 0 --row plain --row levers --profile --work /tmp/e4b-bf16 --json \
        > "$out/e4b_train_2k_bf16.json" || echo "e4b-train 2k failed" >&2
      mlx train --preset e4b --quantize 4 --seq 8192 --warmup 2 --steps 3 --segment-size 1 \
        --head-chunk 256 --mlp-chunk 1024 --row levers --row levers,memory_limit_gb=9.3 \
        --work /tmp/e4b-q4 --json > "$out/e4b_train_8k_q4.json" || echo "e4b-train 8k failed" >&2 ;;
    batch)  # split layouts of several pairs a micro-batch against two forwards (issue 15)
      for shape in "1024 8" "1024 4" "2048 2" "2048 1" "4096 1"; do
        set -- $shape
        mlx prefix $B --seq "$1" --pairs "$2" --repeats 5 --segment-size 1 --json \
          --rows "two_forward@4:1,shared@4:1" > "$out/batch_$1x$2.json" \
          || echo "batch $1x$2 failed" >&2
      done ;;
    timeline)  # where the trainer's 4k step idles, kernel by kernel (issue 15)
      mlx timeline --seq 4096 --out /tmp/timeline > "$out/timeline_4096x1.txt" ;;
    profile-2k)  # where the 2k split step's time goes, against two forwards (issue 15)
      mlx profile $B --seq 2048 --segment-size 1 --repeats 5 --json > "$out/profile_2k_two.json"
      mlx profile $B --seq 2048 --segment-size 1 --repeats 5 --prefix --json \
        > "$out/profile_2k_split.json" ;;
    train)  # the real trainer end to end beside TRL (issue 15): one pair at 2k/4k/8k, 8 x 1k
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/trl .trlwhl/*.whl
      for shape in "2048 1" "4096 1" "8192 1" "1024 8"; do
        set -- $shape
        (source .whl/activate.sh && PYTHONPATH="/tmp/trl:$PYTHONPATH" python3 -m \
          benchmarks train --seq "$1" --pairs "$2" --trl --peer mlx-lm-lora --peak-tflops 681 \
          --json) \
          > "$out/train_$1x$2.json" || echo "bench train $1x$2 failed" >&2
      done ;;
    trl)  # torch only: MLX stays off the path (transformers imports mlx when it can)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/trl .trlwhl/*.whl
      for s in 4096 8192; do
        for gc in "" --gradient-checkpointing; do
          PYTHONPATH=/tmp/trl python3 benchmarks/trl_orpo.py --seq $s $gc \
            --out "$out/trl.jsonl" >>"$out/trl.log" 2>&1
        done
      done ;;
    *) echo "unknown section $section" >&2; exit 2 ;;
  esac
done
python3 benchmarks/summary.py "$out" | tee "$out/summary.md"
