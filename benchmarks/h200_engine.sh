#!/usr/bin/env bash
# The engine-on-the-GPU measurements (issues 16 and 17), in two device calls of < 10 minutes each.
# Run on the H200 after `source .gpu2/install.sh` (see the developers' guide); results go to $OUT.
#
#   bash benchmarks/h200_engine.sh a   # llama-1B and gemma3-270m: served table with the HTTP column, default sizing
#   bash benchmarks/h200_engine.sh b   # llama-8B served table; a joining request's TTFT; host time per step;
#                                      # llama-1B at 64/128 streams with the old default's 119.5 GiB pool
#   bash benchmarks/h200_engine.sh c1  # the chunk-step CUDA probe; host time per step; the products probe (issue 17)
#   bash benchmarks/h200_engine.sh c2  # fused vs unfused projections; qwen3-moe vs mlx-lm
#   bash benchmarks/h200_engine.sh d1  # after the RoPE fix: chunk probe, host step; Nsight profile of a 32-stream step
#
# Not yet run (session 30's plan for the next device time, in order): s30e (or its long form s30d: the paged-attention
# merge change's CUDA tests and A/Bs), s31q (the quantized products), s30g (the activation ceiling's layers), s30f
# (issue 23's one-rank baseline). Session 31 ran those and s31r's kernel part; not yet run: s32a then s32b (the
# dequantizing GEMV's CUDA tests; its served A/B and the tensor-core form's device times).
#
# Every command has its own timeout so a phase ends inside the call's limit and keeps what finished.
set -uo pipefail
out=${OUT:-/tmp/h200-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
run() {  # run SECONDS NAME COMMAND...: log to $out/NAME.log
  local secs=$1 name=$2; shift 2
  echo "== $(date +%T) $name: $*" | tee -a "$out/phase.log"
  timeout "$secs" "$@" > "$out/$name.log" 2>&1; echo "== $(date +%T) $name rc=$?" | tee -a "$out/phase.log"
}
kernel_profile() {  # kernel_profile SECS NAME ENGINE [VAR=V...]: 4 of llama-8B's 1-stream decode steps, each kernel
  # timed by Nsight Compute with caches and clocks as they run, into $out/NAME.csv (kernel_times.py --summarize reads it)
  local secs=$1 name=$2 eng=$3; shift 3
  local ncu_bin; ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  run "$secs" "kt-$name" env "$@" "${ncu_bin:-ncu}" --csv --profile-from-start off --cache-control none \
    --clock-control none --metrics gpu__time_duration.sum --log-file "$out/$name.csv" \
    python benchmarks/kernel_times.py --shape llama-8b --engine "$eng" --steps 4
}
arm_name() {  # arm_name VAR=V|default: a file name for an A/B arm (MLX_INFER_PAGED_ATTN_UNROLL=4 -> unroll-4)
  echo "${1#MLX_INFER_PAGED_ATTN_}" | tr 'A-Z=' 'a-z-'
}
arm_env() {  # arm_env VAR=V|default: the arm's assignment, nothing for the default
  [ "$1" = default ] || echo "$1"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$out/phase.log" 2>&1
python -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__)" >> "$out/phase.log"
served="python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 1,8,32,64,128"
case "${1:-a}" in
  a)
    run 270 llama-1b $served --shape llama-1b --http --json "$out/h200-served-llama-1b.json"
    run 240 gemma3-270m $served --shape gemma3-270m --http --json "$out/h200-served-gemma3-270m.json"
    ;;
  b)
    run 330 llama-8b $served --shape llama-8b --streams 1,8,32,64 --json "$out/h200-served-llama-8b.json"
    run 120 join-ttft python benchmarks/join_ttft.py --shape llama-1b -p 512 -n 3
    run 60 host-step python benchmarks/host_step.py --streams 32,64
    # Long prompts: chunk rows attend row by row through the tables (no flash prefill); TTFT at 4096 tokens.
    run 100 llama-1b-p4096 python benchmarks/served.py --shape llama-1b -p 4096 -g 32 -r 1 -n 2 --no-text \
      --streams 1,8 --json "$out/h200-served-llama-1b-p4096.json"
    # The pool of the old 0.9 default (119.5 GiB = 0.8 x 149): do its slow trials come back?
    run 150 llama-1b-pool119 $served --shape llama-1b --streams 64,128 --memory-budget 149 \
      --json "$out/h200-served-llama-1b-pool119.json"
    ;;
  c1)
    # Where the tiny-shape chunk-step failure of session 5 comes from; the host time per step; issue 17's probe.
    { command -v nvcc; ls -d /usr/local/cuda*/include/cublas_v2.h; python -m pip list 2>/dev/null | grep -i nvidia; } \
      > "$out/toolchain.log" 2>&1
    run 150 chunk-probe python benchmarks/gpu_chunk_probe.py
    run 60 host-step python benchmarks/host_step.py --streams 32,64
    run 170 products python benchmarks/products.py --json "$out/h200-products.json" --plot "$out/h200-products.png"
    ;;
  c2)
    # The fused-in-place projections against one product each (the compiled step, batch 1 and 32), and the
    # Qwen3-MoE shape against mlx-lm.
    run 260 fused python benchmarks/gpu_decode.py --models llama-8b,llama-1b,gemma3-270m --batches 1,32 \
      --engines mlx-lm,step,step-unfused -n 2 --json "$out/h200-decode-fused.json"
    run 230 moe python benchmarks/gpu_decode.py --models qwen3-moe-a3b-24l --batches 1,32 --engines mlx-lm,step -n 2 \
      --json "$out/h200-decode-qwen3-moe.json"
    ;;
  prof)
    # Only the kernel-by-kernel profile of a 32-stream engine decode step (CUPTI through torch.profiler).
    for shape in llama-1b gemma3-270m; do
      run 150 "profile-$shape" python benchmarks/gpu_engine_profile.py --shape "$shape" --streams 32 --steps 64 \
        --torch-profiler "$out/prof-$shape-kernels.csv"
    done
    ;;
  d1)
    # After the RoPE fix: the chunk-step probe's engine cases and the host time per step (tiny llama); then
    # where an engine decode step's GPU time goes at 32 streams (Nsight Systems, kernel by kernel).
    run 120 chunk-probe python benchmarks/gpu_chunk_probe.py --engine
    run 60 host-step python benchmarks/host_step.py --streams 32,64
    nsys=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
    echo "nsys: ${nsys:-none}" | tee -a "$out/phase.log"
    if [ -n "$nsys" ]; then
      for shape in llama-1b gemma3-270m; do
        run 150 "profile-$shape" "$nsys" profile --trace=cuda --cuda-graph-trace=node \
          --capture-range=cudaProfilerApi --capture-range-end=stop -o "$out/prof-$shape" -f true \
          python benchmarks/gpu_engine_profile.py --shape "$shape" --streams 32 --steps 64
        "$nsys" stats --report cuda_gpu_kern_sum --format csv -o "$out/prof-$shape" "$out/prof-$shape.nsys-rep" \
          > /dev/null 2>&1
        python benchmarks/gpu_engine_profile.py --summarize "$out/prof-${shape}_cuda_gpu_kern_sum.csv" --steps 64 \
          > "$out/profile-$shape-summary.txt" 2>&1
        rm -f "$out/prof-$shape.nsys-rep" "$out/prof-$shape.sqlite"
      done
    else  # CUPTI through torch.profiler: every kernel of the process, MLX's CUDA graphs' nodes included
      for shape in llama-1b gemma3-270m; do
        run 150 "profile-$shape" python benchmarks/gpu_engine_profile.py --shape "$shape" --streams 32 --steps 64 \
          --torch-profiler "$out/prof-$shape-kernels.csv"
      done
    fi
    ;;
  e)
    # Session 6's last call: the GPU checks of what landed (adapters on fused products, Gemma 2's soft cap and
    # gpt-oss's sinks in the CUDA kernel, the tuned cuBLASLt product), then tuned vs MLX's products in the
    # compiled step (llama-8B), then the served table (llama-1B) with the growing pool and own peak memory.
    python -c "from mlx_infer import _fast; print('tuned products available:', _fast.tuned_products_available())" \
      | tee -a "$out/phase.log"
    run 80 gpu-tests python -m pytest -q -p no:cacheprovider tests/test_lora_fused.py \
      tests/test_gemma2_decode_step.py tests/test_gpt_oss_decode_step.py tests/test_pool_growth.py -k "not cpu"
    run 60 paged-attention python benchmarks/gpu_paged_attention.py --json "$out/h200-paged-attention.json"
    MLX_INFER_TUNED_PRODUCTS_LOG=1 run 90 tuned python benchmarks/gpu_tuned_products.py \
      --json "$out/h200-tuned-products.json"
    if ! tail -3 "$out/tuned.log" | grep -q PASS; then
      export MLX_INFER_TUNED_PRODUCTS=0; echo "tuned products off for the rest (check failed)" | tee -a "$out/phase.log"
    fi
    run 110 decode-tuned python benchmarks/gpu_decode.py --models llama-8b --batches 1,32 \
      --engines mlx-lm,step,step-untuned -n 2 --json "$out/h200-decode-tuned.json"
    run 160 served-llama-1b python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 1,32,64 \
      --shape llama-1b --json "$out/h200-served-llama-1b.json"
    ;;
  next)
    # For the next session (not run in session 6): where the tuned products crash (a build with them:
    # `sed -i 's/^option(MLX_INFER_CUBLAS \(.*\) OFF)/option(MLX_INFER_CUBLAS \1 ON)/' CMakeLists.txt` before
    # `source .gpu2/install.sh`), then the served table of the three shapes at every stream count of issue 16.
    run 120 tuned-gdb gdb -batch -ex run -ex bt --args python benchmarks/gpu_tuned_products.py --shapes llama-1b \
      --ms 8
    run 280 served-llama-1b python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 1,8,32,64,128 \
      --shape llama-1b --http --json "$out/h200-served-llama-1b.json"
    run 100 memory-llama-1b python benchmarks/gpu_engine_profile.py --shape llama-1b --streams 64 --steps 64
    run 280 served-gemma3 python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 1,8,32,64,128 \
      --shape gemma3-270m --json "$out/h200-served-gemma3-270m.json"
    ;;
  s7a)
    # Session 7, call 1: where the tuned cuBLASLt products crash (a second build with them), then the llama-1B
    # served table at every stream count with the activation-bound A/B column (engine/activations.py).
    t=$(date +%s)
    (cd /tmp/proj && CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-build-isolation --no-deps \
      --no-compile -Ccmake.define.MLX_INFER_LTO=OFF -Ccmake.define.MLX_INFER_CUBLAS=ON --target /tmp/site-cublas . \
      > "$out/build-cublas.log" 2>&1) && echo "built the cuBLAS copy in $(( $(date +%s) - t )) s" | tee -a "$out/phase.log"
    tuned="benchmarks/gpu_tuned_products.py --shapes llama-1b --ms 8 --iters 5 --rounds 1"
    if command -v gdb > /dev/null; then
      PYTHONPATH=/tmp/site-cublas:/tmp/site MLX_INFER_TUNED_PRODUCTS_LOG=1 run 150 tuned-gdb gdb -batch -ex run \
        -ex bt -ex "info registers rip" -ex "x/6i \$pc" --args python $tuned
    else
      PYTHONPATH=/tmp/site-cublas:/tmp/site MLX_INFER_TUNED_PRODUCTS_LOG=1 run 100 tuned-fh python -X faulthandler $tuned
    fi
    run 420 served-llama-1b $served --shape llama-1b --unbounded --json "$out/h200-served-llama-1b.json"
    ;;
  s7b)
    # Session 7, call 2: gemma3-270m's table, the HTTP column at 32 streams, a joining request's TTFT, host time.
    run 260 served-gemma3 $served --shape gemma3-270m --json "$out/h200-served-gemma3-270m.json"
    run 120 http-llama-1b python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 32 \
      --shape llama-1b --http --json "$out/h200-served-llama-1b-http.json"
    run 120 join-ttft python benchmarks/join_ttft.py --shape llama-1b -p 512 -n 3
    run 60 host-step python benchmarks/host_step.py --streams 32,64
    ;;
  s7c)
    # Session 7, call 3: llama-8B's table at every stream count.
    run 560 served-llama-8b $served --shape llama-8b --json "$out/h200-served-llama-8b.json"
    ;;
  s8a)
    # Next session, call 1: where the tuned products crash (session 7 found it is inside the first tuned_linear
    # evaluation, before its first log line: faulthandler's Python stack only), now with the native stack and
    # each stage logged; then the A/B of the activation bound as it is now (prompt steps only, one step's reserve).
    t=$(date +%s)
    (cd /tmp/proj && CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-build-isolation --no-deps \
      --no-compile -Ccmake.define.MLX_INFER_LTO=OFF -Ccmake.define.MLX_INFER_CUBLAS=ON --target /tmp/site-cublas . \
      > "$out/build-cublas.log" 2>&1) && echo "built the cuBLAS copy in $(( $(date +%s) - t )) s" | tee -a "$out/phase.log"
    PYTHONPATH=/tmp/site-cublas:/tmp/site MLX_INFER_TUNED_PRODUCTS_LOG=2 run 100 tuned-trace python \
      benchmarks/gpu_tuned_products.py --shapes llama-1b --ms 8 --iters 5 --rounds 1 --backtrace
    run 420 served-llama-1b $served --shape llama-1b --unbounded --json "$out/h200-served-llama-1b.json"
    ;;
  s8b)
    # Next session, call 2: gemma3-270m and llama-8B with the A/B column; the HTTP column at 32 streams.
    run 260 served-gemma3 $served --shape gemma3-270m --unbounded --json "$out/h200-served-gemma3-270m.json"
    run 200 http-llama-1b python benchmarks/served.py -p 512 -g 128 -r 1 -n 3 --no-text --streams 32 \
      --shape llama-1b --http --json "$out/h200-served-llama-1b-http.json"
    ;;
  s8c)
    # Next session, call 3: the pure plain step (issue 20: the caches own the KV) against mlx-lm at batch 1 / 32
    # (session 6: llama-8B b1 1.35x), and its tests on CUDA (the in-place check reads buffer addresses).
    run 300 plain-step python benchmarks/gpu_decode.py --models llama-8b,llama-1b,gemma3-270m --batches 1,32 \
      --engines mlx-lm,step -n 2 --json "$out/h200-decode-plain-step.json"
    run 250 plain-tests python -m pytest -q -p no:cacheprovider tests/test_decode_step.py -k "not slow"
    ;;
  s9a)
    # Session 9, call 1: the two CUDA-only test failures of session 7's s8c with the native stack and the K/V
    # difference; the tuned products with the choice log (describe() now formats with snprintf); the compiled
    # step with tuned vs MLX's products (llama-8B); the 64-stream A/B of the activation bound with 3 trials.
    MLX_INFER_CRASH_BACKTRACE=1 run 100 step-tests python -X faulthandler -m pytest -q -p no:cacheprovider \
      tests/test_decode_step.py -k "eager_kv_after_compiled or falls_back or poisoned"
    t=$(date +%s)
    (cd /tmp/proj && CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-build-isolation --no-deps \
      --no-compile -Ccmake.define.MLX_INFER_LTO=OFF -Ccmake.define.MLX_INFER_CUBLAS=ON --target /tmp/site-cublas . \
      > "$out/build-cublas.log" 2>&1) && echo "built the cuBLAS copy in $(( $(date +%s) - t )) s" | tee -a "$out/phase.log"
    PYTHONPATH=/tmp/site-cublas:/tmp/site MLX_INFER_TUNED_PRODUCTS_LOG=1 run 110 tuned python \
      benchmarks/gpu_tuned_products.py --ms 1,8,32,128 --backtrace --json "$out/h200-tuned-products.json"
    PYTHONPATH=/tmp/site-cublas:/tmp/site run 150 decode-tuned python benchmarks/gpu_decode.py --models llama-8b \
      --batches 1,32 --engines mlx-lm,step,step-untuned -n 2 --json "$out/h200-decode-tuned.json"
    run 150 served-64 python benchmarks/served.py -p 512 -g 128 -r 1 -n 3 --no-text --streams 64 --shape llama-1b \
      --unbounded --json "$out/h200-served-llama-1b-64.json"
    ;;
  s9b)
    # Session 9, call 2: the CUDA-only test crash with the native stack (printed); 1-stream peaks after the
    # reserve counts at most defaults.CEILING_LAYERS layers; the HTTP column at 32 streams after the engine
    # waits for tokens without the GIL; gemma3-270m at 32-128 streams.
    MLX_INFER_CRASH_BACKTRACE=1 run 100 step-tests python -X faulthandler -m pytest -q -p no:cacheprovider \
      tests/test_decode_step.py -k "eager_kv_after_compiled or falls_back"
    grep -v '^  File "/opt' "$out/step-tests.log" | tail -45 | cut -c1-300; rm -f "$out/step-tests.log"
    for shape in gemma3-270m llama-1b llama-8b; do
      run 120 "one-$shape" python benchmarks/served.py -p 512 -g 128 -r 1 -n 3 --no-text --streams 1 \
        --shape "$shape" --json "$out/h200-served-$shape-1.json"
    done
    run 200 http-llama-1b python benchmarks/served.py -p 512 -g 128 -r 1 -n 3 --streams 32 --shape llama-1b \
      --http --json "$out/h200-served-llama-1b-http.json"
    run 170 served-gemma3 python benchmarks/served.py -p 512 -g 128 -r 1 -n 3 --no-text --streams 32,64,128 \
      --shape gemma3-270m --json "$out/h200-served-gemma3-270m.json"
    ;;
  s9c)
    # Session 9, call 3: the CUDA-only test crash with our native stack (pytest's faulthandler off: it replaces
    # our handler) and the gemma3 K/V difference; the HTTP column at 32 streams with coalesced chunks (against
    # the detokenizing in-process column); llama-1B at 8/32 and llama-8B at 32 streams (session 7's misses).
    MLX_INFER_CRASH_BACKTRACE=1 run 60 crash python -m pytest -q -p no:cacheprovider -p no:faulthandler \
      tests/test_decode_step.py -k "falls_back_to_eager and llama"
    head -c 3500 "$out/crash.log"; rm -f "$out/crash.log"
    run 60 kv-diff python -m pytest -q -p no:cacheprovider --tb=line tests/test_decode_step.py \
      -k "eager_kv_after_compiled and gemma3"
    grep -h 'differ\|passed\|failed' "$out/kv-diff.log" | cut -c1-400; rm -f "$out/kv-diff.log"
    run 160 http python benchmarks/served.py -p 512 -g 128 -r 1 -n 3 --streams 32 --shape llama-1b --http \
      --no-ids --json "$out/h200-served-llama-1b-http.json"
    run 120 llama-1b python benchmarks/served.py -p 512 -g 128 -r 1 -n 3 --no-text --streams 8,32 \
      --shape llama-1b --json "$out/h200-served-llama-1b-8-32.json"
    run 140 llama-8b python benchmarks/served.py -p 512 -g 128 -r 1 -n 3 --no-text --streams 32 \
      --shape llama-8b --json "$out/h200-served-llama-8b-32.json"
    grep -h '^| ' "$out"/http.log "$out"/llama-1b.log "$out"/llama-8b.log
    ;;
  s10a)
    # Next session, call 1: issue 16's whole table at the final code, three trials: llama-1B and gemma3-270m.
    run 270 served-llama-1b python benchmarks/served.py -p 512 -g 128 -r 1 -n 3 --no-text --streams 1,8,32,64,128 \
      --shape llama-1b --json "$out/h200-served-llama-1b.json"
    run 270 served-gemma3 python benchmarks/served.py -p 512 -g 128 -r 1 -n 3 --no-text --streams 1,8,32,64,128 \
      --shape gemma3-270m --json "$out/h200-served-gemma3-270m.json"
    grep -h '^| ' "$out"/served-*.log
    ;;
  s10b)
    # Next session, call 2: llama-8B's table (three trials), then the HTTP column at 32 streams.
    run 400 served-llama-8b python benchmarks/served.py -p 512 -g 128 -r 1 -n 3 --no-text --streams 1,8,32,64,128 \
      --shape llama-8b --json "$out/h200-served-llama-8b.json"
    run 150 http python benchmarks/served.py -p 512 -g 128 -r 1 -n 3 --streams 32 --shape llama-1b --http \
      --no-ids --json "$out/h200-served-llama-1b-http.json"
    grep -h '^| ' "$out"/served-*.log "$out"/http.log
    ;;
  s10c)
    # Next session, call 3: the compiled-step tests on CUDA after the iostream fix (session 9 ran two of them).
    MLX_INFER_CRASH_BACKTRACE=1 run 300 step-tests python -m pytest -q -p no:cacheprovider -p no:faulthandler \
      --tb=line tests/test_decode_step.py tests/test_activation_ceiling.py tests/test_engine_exit.py -k "not slow"
    tail -c 3000 "$out/step-tests.log"
    ;;
  s11)
    # Session 11, last call: the HTTP column at 32 streams after the server runs httptools and its streams
    # wait without a watcher task per chunk (4 requests a stream: trials of ~4 s, not ~1 s); llama-1B at 1 and
    # 8 streams likewise (their 1-s trials spread 1.09-1.59x); the activation-ceiling tests on CUDA.
    python -c "import httptools, uvloop; print('httptools', httptools.__version__, 'uvloop', uvloop.__version__)" \
      | tee -a "$out/phase.log"
    run 270 http python benchmarks/served.py -p 512 -g 128 -r 4 -n 3 --streams 32 --shape llama-1b --http \
      --no-ids --json "$out/h200-served-llama-1b-http.json"
    run 150 served-llama-1b python benchmarks/served.py -p 512 -g 128 -r 4 -n 3 --no-text --streams 1,8 \
      --shape llama-1b --json "$out/h200-served-llama-1b-1-8.json"
    run 60 ceiling python -m pytest -q -p no:cacheprovider --tb=line tests/test_activation_ceiling.py
    tail -5 "$out/ceiling.log"
    grep -h '^| ' "$out"/http.log "$out"/served-*.log
    ;;
  s12a)
    # Next session: llama-1B's table with trials ~3x longer (-r 3): its 8/32-stream ratios moved 1.07-1.59x /
    # 1.34-1.57x between session 11's runs of 1-s trials. Then gemma3-270m at 8-128 likewise.
    run 300 served-llama-1b python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-text --streams 1,8,32,64,128 \
      --shape llama-1b --json "$out/h200-served-llama-1b.json"
    run 230 served-gemma3 python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-text --streams 8,32,64,128 \
      --shape gemma3-270m --json "$out/h200-served-gemma3-270m.json"
    grep -h '^| ' "$out"/served-*.log
    ;;
  s12b)
    # Next session: llama-8B at 8-64 streams with -r 2, then HTTP at 32 streams (-r 4) with the in-process column.
    run 330 served-llama-8b python benchmarks/served.py -p 512 -g 128 -r 2 -n 3 --no-text --streams 8,32,64 \
      --shape llama-8b --json "$out/h200-served-llama-8b.json"
    run 230 http python benchmarks/served.py -p 512 -g 128 -r 4 -n 3 --streams 32 --shape llama-1b --http \
      --no-ids --json "$out/h200-served-llama-1b-http.json"
    grep -h '^| ' "$out"/served-*.log "$out"/http.log
    ;;
  s13a)
    # Session 13: where an engine decode step's GPU time goes now (8 and 32 streams, llama-1B, CUPTI through
    # torch.profiler), then llama-1B's table with trials ~3x longer (-r 3) than session 11's.
    for n in 8 32; do
      run 120 "profile-llama-1b-$n" python benchmarks/gpu_engine_profile.py --shape llama-1b --streams "$n" \
        --steps 64 --torch-profiler "$out/prof-llama-1b-$n-kernels.csv"
    done
    run 300 served-llama-1b python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-text --streams 1,8,32,64,128 \
      --shape llama-1b --json "$out/h200-served-llama-1b.json"
    grep -h '^| ' "$out"/served-*.log
    ;;
  s13b)
    # Session 13: the host's share of an engine decode step on a real shape (Python + plan, MLX's submission,
    # the wait), with MLX's CUDA graph limits as shipped, raised (one graph a step), and CUDA graphs off.
    hs="python benchmarks/host_step.py --shape llama-1b --streams 1,8,32"
    run 100 host-llama-1b $hs
    MLX_MAX_OPS_PER_BUFFER=4000 MLX_MAX_MB_PER_BUFFER=1000000 run 100 host-llama-1b-onegraph $hs
    MLX_USE_CUDA_GRAPHS=0 run 100 host-llama-1b-nographs $hs
    run 100 host-gemma3 python benchmarks/host_step.py --shape gemma3-270m --streams 1,8,32
    grep -h "^streams\|^==" "$out"/host-*.log "$out"/phase.log
    ;;
  s13c)
    # Session 13, after qkv_rope (one kernel for the fused product's split and RoPE): the kernel against MLX's
    # RoPE, the paged step's parity tests on CUDA, the kernel profile at 8 and 32 streams, the host split.
    run 200 gpu-tests python -m pytest -q -p no:cacheprovider -s tests/test_qkv_rope.py tests/test_paged_decode_step.py \
      -k "not real"
    grep -h "max |diff|\|passed\|failed" "$out/gpu-tests.log" | tail -20
    for n in 8 32; do
      run 100 "profile-llama-1b-$n" python benchmarks/gpu_engine_profile.py --shape llama-1b --streams "$n" \
        --steps 64 --torch-profiler "$out/prof-llama-1b-$n-kernels.csv"
    done
    run 100 host-llama-1b python benchmarks/host_step.py --shape llama-1b --streams 1,8,32
    grep -h "^streams\|ms/step\|GPU kernel time" "$out"/host-*.log "$out"/profile-*.log
    ;;
  s13d)
    # Session 13, after qkv_rope: llama-1B's and llama-8B's tables (-r 3 / -r 2), then MLX's graph limits A/B.
    run 260 served-llama-1b python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-text --streams 1,8,32,64,128 \
      --shape llama-1b --json "$out/h200-served-llama-1b.json"
    run 230 served-llama-8b python benchmarks/served.py -p 512 -g 128 -r 2 -n 3 --no-text --streams 1,8,32,64 \
      --shape llama-8b --json "$out/h200-served-llama-8b.json"
    grep -h '^| ' "$out"/served-*.log
    ;;
  s13e)
    # Session 13, one call: qkv_rope's CUDA checks, the 8-stream kernel profile, llama-1B's table (-r 3).
    # (Session 13's run: the paged-step tests need more than 150 s on the H200; 6 of 25 had passed.)
    run 150 gpu-tests python -m pytest -q -p no:cacheprovider -s tests/test_qkv_rope.py tests/test_paged_decode_step.py \
      -k "not real"
    grep -h "max |diff|\|passed\|failed" "$out/gpu-tests.log" | tail -20
    run 90 profile-llama-1b-8 python benchmarks/gpu_engine_profile.py --shape llama-1b --streams 8 \
      --steps 64 --torch-profiler "$out/prof-llama-1b-8-kernels.csv"
    run 270 served-llama-1b python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-text --streams 1,8,32,64,128 \
      --shape llama-1b --json "$out/h200-served-llama-1b.json"
    grep -h "ms/step\|GPU kernel time\|^| " "$out"/profile-*.log "$out"/served-*.log
    ;;
  s13f)
    # Session 13, second call: llama-8B's table (-r 2), the host split, the 32-stream profile.
    run 230 served-llama-8b python benchmarks/served.py -p 512 -g 128 -r 2 -n 3 --no-text --streams 1,8,32,64 \
      --shape llama-8b --json "$out/h200-served-llama-8b.json"
    run 100 host-llama-1b python benchmarks/host_step.py --shape llama-1b --streams 1,8,32
    MLX_MAX_OPS_PER_BUFFER=4000 MLX_MAX_MB_PER_BUFFER=1000000 run 100 host-llama-1b-onegraph \
      python benchmarks/host_step.py --shape llama-1b --streams 8,32
    run 90 profile-llama-1b-32 python benchmarks/gpu_engine_profile.py --shape llama-1b --streams 32 \
      --steps 64 --torch-profiler "$out/prof-llama-1b-32-kernels.csv"
    grep -h "^streams\|ms/step\|GPU kernel time\|^| " "$out"/host-*.log "$out"/profile-*.log "$out"/served-*.log
    ;;
  s14a)
    # Session 14, one call: the paged step's CUDA parity with qkv_rope on (llama, fused q|k|v), then qkv_rope off
    # (MLX_INFER_QKV_ROPE=0) against on, llama-1B at 8/32/64 streams, engines alternating inside each run
    # (session 13's s13g, after the parity case).
    run 90 gpu-tests python -m pytest -q -p no:cacheprovider tests/test_paged_decode_step.py \
      -k "compiled_paged_equals and llama"
    tail -3 "$out/gpu-tests.log"
    MLX_INFER_QKV_ROPE=0 run 200 served-llama-1b-off python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-text \
      --streams 8,32,64 --shape llama-1b --json "$out/h200-served-llama-1b-off.json"
    run 200 served-llama-1b-on python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-text \
      --streams 8,32,64 --shape llama-1b --json "$out/h200-served-llama-1b-on.json"
    grep -h '^| \|^==' "$out"/served-*.log
    ;;
  s14b)
    # Session 14: the paged step's 8-row llama case on CUDA (it failed in s14a) as shipped before this session's
    # kernel change and without qkv_rope, then with both; pass 1's key pipelines swept at serving shapes; then
    # llama-1B's table with the sweep's best pipeline.
    t="tests/test_paged_decode_step.py::test_engine_greedy_compiled_paged_equals_eager_and_plain[8-llama]"
    MLX_INFER_QKV_ROPE=0 MLX_INFER_PAGED_ATTN_UNROLL=1 MLX_INFER_PAGED_ATTN_PREFETCH=1 \
      run 70 test-8-llama-old python -m pytest -q -p no:cacheprovider -x --tb=short "$t"
    run 70 test-8-llama-new python -m pytest -q -p no:cacheprovider -x --tb=short "$t"
    tail -n 25 "$out"/test-8-llama-*.log
    run 90 sweep python benchmarks/gpu_paged_attention.py --sweep 1p,2,2p,4,4p,8 \
      --json "$out/h200-paged-attn-sweep.json" --best-file "$out/best.env"
    best=$(cat "$out/best.env" 2>/dev/null); echo "best pipeline: $best" | tee -a "$out/phase.log"
    [ -n "$best" ] && export $best
    run 250 served-llama-1b python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-text --streams 8,32,64,128 \
      --shape llama-1b --json "$out/h200-served-llama-1b.json"
    grep -h '^| \|^==\|best' "$out"/sweep.log "$out"/served-*.log
    ;;
  s14c)
    # Session 14, after the 2-set key pipeline became the default: the paged step's CUDA cases with float32
    # products exact (tests/conftest.py: MLX_ENABLE_TF32=0), then llama-8B's and gemma3-270m's tables.
    run 150 gpu-tests python -m pytest -q -p no:cacheprovider -rf --tb=line tests/test_paged_decode_step.py -k "not real"
    tail -n 15 "$out/gpu-tests.log"
    run 200 served-llama-8b python benchmarks/served.py -p 512 -g 128 -r 1 -n 3 --no-text --streams 1,8,32,64,128 \
      --shape llama-8b --json "$out/h200-served-llama-8b.json"
    run 150 served-gemma3 python benchmarks/served.py -p 512 -g 128 -r 1 -n 3 --no-text --streams 1,8,32,64,128 \
      --shape gemma3-270m --json "$out/h200-served-gemma3-270m.json"
    grep -h '^| \|^==' "$out"/served-*.log
    ;;
  s15a)
    # Session 15: the GEMV kernel (cpp/matmul/gemv_cuda.cpp, dense products of 1..8 rows) on the device: its
    # routing test and the paged step's CUDA parity with it; the tiling sweep against MLX's products; then the
    # served A/B (the GEMV column against MLX_INFER_GEMV_ROWS=0, engines alternating) for llama-8B and llama-1B.
    run 100 gpu-tests python -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_gemv_cuda_text.py \
      tests/test_paged_decode_step.py -k "routing or cuda_skinny or (compiled_paged_equals and llama and not q4)"
    tail -n 8 "$out/gpu-tests.log"
    run 110 gemv-probe python benchmarks/gpu_gemv_probe.py --ms 1,2,8,32 --json "$out/h200-gemv-probe.json"
    grep -h "step products" "$out/gemv-probe.log"
    export MLX_INFER_GEMV_ROWS=32  # the A/B at 32 streams too (the no-GEMV column sets 0 while it runs)
    run 230 served-llama-8b python benchmarks/served.py -p 512 -g 128 -r 2 -n 3 --no-text --no-gemv \
      --streams 1,8,32 --shape llama-8b --json "$out/h200-served-llama-8b.json"
    run 100 served-llama-1b python benchmarks/served.py -p 512 -g 128 -r 2 -n 3 --no-text --no-gemv --streams 1,32 \
      --shape llama-1b --json "$out/h200-served-llama-1b.json"
    unset MLX_INFER_GEMV_ROWS
    grep -h '^| \|^==' "$out"/served-*.log
    ;;
  s15b)
    # Session 15, the GEMV kernel off by default after s15a: where a step's time goes with it and without
    # (CUPTI kernel table per step, one engine per MLX_INFER_GEMV_ROWS value in one process), llama-8B at 1 and
    # 32 streams; then llama-8B's table with 3 requests per stream and the HTTP column at 32 streams (llama-1B).
    run 120 prof-8b-s1 python benchmarks/gpu_engine_profile.py --shape llama-8b --streams 1 --steps 48 \
      --gemv-rows 0,1 --torch-profiler /tmp/prof-8b-s1.csv
    run 120 prof-8b-s32 python benchmarks/gpu_engine_profile.py --shape llama-8b --streams 32 --steps 48 \
      --gemv-rows 0,32 --torch-profiler /tmp/prof-8b-s32.csv
    grep -h "^==\|ms/step\|GPU kernel time\|products" "$out"/prof-*.log
    run 210 served-llama-8b python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-text --streams 1,8,32,64 \
      --shape llama-8b --json "$out/h200-served-llama-8b.json"
    run 90 served-llama-1b-http python benchmarks/served.py -p 512 -g 128 -r 2 -n 3 --no-text --http \
      --streams 32 --shape llama-1b --json "$out/h200-served-llama-1b-http.json"
    grep -h '^| \|^==' "$out"/served-*.log
    ;;
  s15c)
    # Session 15: gemma3-270m's table and llama-1B's 8/64/128 rows with the GEMV default.
    run 160 served-gemma3 python benchmarks/served.py -p 512 -g 128 -r 2 -n 3 --no-text --streams 1,8,32,64,128 \
      --shape gemma3-270m --json "$out/h200-served-gemma3-270m.json"
    run 170 served-llama-1b python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-text --streams 8,64,128 \
      --shape llama-1b --json "$out/h200-served-llama-1b.json"
    grep -h '^| \|^==' "$out"/served-*.log
    ;;
  s15d)
    # Session 15, the last device minutes: the GEMV tilings timed by the device's kernel durations (CUPTI),
    # llama-8B's products at 1 and 32 rows (s15a's host-timed probe measured MLX's per-op host cost instead).
    run 100 gemv-probe python benchmarks/gpu_gemv_probe.py --shapes llama-8b --ms 1,32 --products qkv,o,gate_up,down \
      --json "$out/h200-gemv-probe.json"
    ;;
  s16a)
    # Session 16: the kernels' scale constants as template constants (no 8-byte host array read by every thread):
    # the CUDA tests of the changed kernels, what a kernel pays for host-made arrays (probe), llama-8B's step
    # kernels at 1 and 32 streams (against s15b's table), then the HTTP server beside the in-process engines.
    run 100 gpu-tests python -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_qkv_rope.py \
      tests/test_paged_attention.py tests/test_paged_step_kernel.py
    tail -n 6 "$out/gpu-tests.log"
    run 60 host-arrays python benchmarks/gpu_host_arrays.py --json "$out/h200-host-arrays.json"
    cat "$out/host-arrays.log"
    run 90 prof-8b-s1 python benchmarks/gpu_engine_profile.py --shape llama-8b --streams 1 --steps 48 \
      --torch-profiler /tmp/prof-8b-s1.csv
    run 90 prof-8b-s32 python benchmarks/gpu_engine_profile.py --shape llama-8b --streams 32 --steps 48 \
      --torch-profiler /tmp/prof-8b-s32.csv
    grep -h "ms/step\|GPU kernel time\|products\|rope\|paged attention" "$out"/prof-*.log
    run 170 served-llama-1b-http python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-ids --http --http-beside \
      --streams 32 --shape llama-1b --json "$out/h200-served-llama-1b-http.json"
    grep -h '^| \|^==' "$out"/served-*.log
    ;;
  s16b)
    # Session 16, after the template-constant kernels (s16a): llama-8B's whole table, 3 requests per stream.
    run 500 served-llama-8b python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-text --streams 1,8,32,64,128 \
      --shape llama-8b --json "$out/h200-served-llama-8b.json"
    grep -h '^| \|^==' "$out"/served-*.log
    ;;
  s16c)
    # Session 16: llama-1B's and gemma3-270m's tables; the CUDA step parity of the changed kernels; the HTTP server
    # beside the in-process detokenizing engine with a py-spy profile of its GIL holder.
    run 230 served-llama-1b python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-text --streams 1,8,32,64,128 \
      --shape llama-1b --json "$out/h200-served-llama-1b.json"
    run 150 served-gemma3 python benchmarks/served.py -p 512 -g 128 -r 2 -n 3 --no-text --streams 1,8,32,64,128 \
      --shape gemma3-270m --json "$out/h200-served-gemma3-270m.json"
    run 80 gpu-tests python -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_paged_step_kernel.py \
      tests/test_paged_attention.py -k "kernel_logits or kernel_and_gather"
    tail -n 4 "$out/gpu-tests.log"
    run 90 served-llama-1b-http python benchmarks/served.py -p 512 -g 128 -r 2 -n 2 --no-ids --http --http-beside \
      --streams 32 --shape llama-1b --http-pyspy "$out/http-gil.txt" --json "$out/h200-served-llama-1b-http.json"
    grep -h '^| \|^==' "$out"/served-*.log
    ;;
  s17a)
    # Next: the HTTP server beside the engine after the GIL release (10da9a6) and the async release task, with its
    # GIL profile; the paged step's kernel cases on CUDA (NVRTC compiles each new variant: give them time); then
    # session 16's four misses again with more requests per stream.
    run 150 served-llama-1b-http python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-ids --http --http-beside \
      --streams 32 --shape llama-1b --http-pyspy "$out/http-gil.txt" --json "$out/h200-served-llama-1b-http.json"
    run 200 gpu-tests python -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_paged_step_kernel.py
    tail -n 4 "$out/gpu-tests.log"
    run 120 served-llama-1b python benchmarks/served.py -p 512 -g 128 -r 4 -n 3 --no-text --streams 1,64 \
      --shape llama-1b --json "$out/h200-served-llama-1b.json"
    grep -h '^| \|^==' "$out"/served-*.log
    ;;
  s17b)
    run 200 served-llama-8b python benchmarks/served.py -p 512 -g 128 -r 4 -n 3 --no-text --streams 32 \
      --shape llama-8b --json "$out/h200-served-llama-8b.json"
    run 200 served-gemma3 python benchmarks/served.py -p 512 -g 128 -r 4 -n 3 --no-text --streams 128 \
      --shape gemma3-270m --json "$out/h200-served-gemma3-270m.json"
    grep -h '^| \|^==' "$out"/served-*.log
    ;;
  s18a)
    # Session 18: the one C++ forward (ab263fd, gemma4 folded into cpp/decode/forward.cpp) on the device: the
    # CUDA cases of the changed step; the plain step before (f67da1d, built from .before/ beside the main
    # build) and after, batch 1, each run with mlx-lm as its anchor; then the HTTP server beside the engine
    # after the GIL release (10da9a6) and the async release task, with its GIL profile.
    (rm -rf /tmp/before && cp -r .before /tmp/before && cd /tmp/before && CMAKE_BUILD_PARALLEL_LEVEL=12 \
      python3 -m pip install -q --no-build-isolation --no-deps --no-compile -Ccmake.define.MLX_INFER_LTO=OFF \
      --target /tmp/site-before . > "$out/build-before.log" 2>&1; echo "before build rc=$?" >> "$out/phase.log") &
    BEFORE_BUILD=$!
    run 100 gpu-tests python -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_step_coverage.py \
      tests/test_gemma4_decode_step.py -k "not refused"
    tail -n 4 "$out/gpu-tests.log"
    decode="python benchmarks/gpu_decode.py --models llama-8b,llama-1b,gemma3-270m --batches 1 --engines mlx-lm,step -n 2 -g 64"
    run 110 decode-after $decode --json "$out/h200-decode-after.json"
    if wait "${BEFORE_BUILD:-0}" 2>/dev/null && [ -d /tmp/site-before/mlx_infer ]; then
      PYTHONPATH=/tmp/site-before:/tmp/site run 110 decode-before $decode --json "$out/h200-decode-before.json"
    else echo "before build missing" | tee -a "$out/phase.log"; fi
    grep -h "tok/s\|^|" "$out"/decode-*.log | head -40
    run 150 served-llama-1b-http python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-ids --http --http-beside \
      --streams 32 --shape llama-1b --http-pyspy "$out/http-gil.txt" --json "$out/h200-served-llama-1b-http.json"
    grep -h '^| \|^==' "$out"/served-*.log
    ;;
  s18b)
    # Carry .before (git-ignored; make it first, here: echo /.before/ >> .git/info/exclude; mkdir .before &&
    # git archive f67da1d CMakeLists.txt pyproject.toml README.md cpp python tools | tar -x -C .before) for s18c.
    # Session 18: the server's engine in its own process (engine/process.py) against the same server with the
    # engine as a thread (--no-engine-process) and the in-process engine, all beside one another, alternating
    # (llama-1B and gemma3-270m at 32 streams); then the 1-stream rows against mlx-lm's generate_step too.
    run 220 served-llama-1b-http python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-ids --http --http-beside \
      --http-thread --streams 32 --shape llama-1b --json "$out/h200-served-llama-1b-http.json"
    run 130 served-gemma3-http python benchmarks/served.py -p 512 -g 128 -r 3 -n 2 --no-ids --http --http-beside \
      --http-thread --streams 32 --shape gemma3-270m --json "$out/h200-served-gemma3-270m-http.json"
    run 75 served-llama-1b-1 python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-text --mlx-lm-step \
      --streams 1 --shape llama-1b --json "$out/h200-served-llama-1b-1.json"
    grep -h '^| \|^==' "$out"/served-*.log
    # s18c's "before" build, after the measurements (a build beside them would perturb them); setsid: it
    # outlives this command on the warm machine
    rm -rf /tmp/before && cp -r .before /tmp/before
    (cd /tmp/before && setsid nohup bash -c "CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q \
      --no-build-isolation --no-deps --no-compile -Ccmake.define.MLX_INFER_LTO=OFF --target /tmp/site-before . \
      > /tmp/build-before.log 2>&1" > /dev/null 2>&1 &)
    ;;
  s18c)
    # Session 18, right after s18b on the same machine: the plain step before (f67da1d, built by s18b in
    # /tmp/site-before) and after the one forward, batch 1, each run with mlx-lm as its anchor.
    decode="python benchmarks/gpu_decode.py --models llama-8b,llama-1b,gemma3-270m --batches 1 --engines mlx-lm,step -n 2 -g 64"
    for _ in $(seq 60); do [ -d /tmp/site-before/mlx_infer ] && break; sleep 1; done  # the build s18b started
    if [ -d /tmp/site-before/mlx_infer ]; then
      PYTHONPATH=/tmp/site-before:/tmp/site run 100 decode-before $decode --json "$out/h200-decode-before.json"
      run 100 decode-after $decode --json "$out/h200-decode-after.json"
    else echo "before build missing" | tee -a "$out/phase.log"; tail -20 /tmp/build-before.log; fi
    grep -h "trial" "$out"/decode-*.log
    ;;
  s18d)
    # Session 18's last device minutes (failed starts spent the rest): s18b's llama-1B HTTP A/B and 1-stream row.
    run 210 served-llama-1b-http python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-ids --http --http-beside \
      --http-thread --streams 32 --shape llama-1b --json "$out/h200-served-llama-1b-http.json"
    run 75 served-llama-1b-1 python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-text --mlx-lm-step \
      --streams 1 --shape llama-1b --json "$out/h200-served-llama-1b-1.json"
    grep -h '^| \|^==' "$out"/served-*.log
    ;;
  s18e)
    # Session 18's last minutes of device time: the HTTP A/B alone (engine process vs thread vs in process).
    run 170 served-llama-1b-http python benchmarks/served.py -p 512 -g 128 -r 2 -n 2 --no-ids --http --http-beside \
      --http-thread --streams 32 --shape llama-1b --json "$out/h200-served-llama-1b-http.json"
    grep -h '^| \|^==\|^streams' "$out"/served-*.log
    ;;
  s19a)
    # Session 19: the step plan prefetched to the GPU (cpp/kv/prefetch.cpp) — the probe's new case, then the
    # engine with and without it (--no-prefetch, alternating) at 1 and 32 streams, the 1-stream row against
    # mlx-lm's generate_step too; then session 18's HTTP A/B (engine process vs thread vs in process).
    run 60 plan-tests python -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_step_plan.py
    tail -n 3 "$out/plan-tests.log"
    run 60 host-arrays python benchmarks/gpu_host_arrays.py --json "$out/h200-host-arrays.json"
    grep -h "rows)" "$out/host-arrays.log"
    run 90 served-llama-1b-1 python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-text --mlx-lm-step \
      --no-prefetch --streams 1 --shape llama-1b --json "$out/h200-served-llama-1b-1.json"
    run 100 served-llama-1b-32 python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-text --no-prefetch \
      --streams 32 --shape llama-1b --json "$out/h200-served-llama-1b-32.json"
    grep -h '^| \|^==' "$out"/served-*.log
    run 220 served-llama-1b-http python benchmarks/served.py -p 512 -g 128 -r 3 -n 3 --no-ids --http --http-beside \
      --http-thread --streams 32 --shape llama-1b --json "$out/h200-served-llama-1b-http.json"
    grep -h '^| \|^==' "$out"/served-llama-1b-http.log
    ;;
  s19b)
    # Session 19, second call: the HTTP A/B on gemma3-270m (engine process vs in process, 32 streams); the
    # llama-1B 1-stream row with 4x longer decodes (s19a's 1-second trials spread 208-409 tok/s) against
    # generate_step, and its kernels (host- or GPU-bound?); gpt-oss-20b's layer (12 of 24 layers) against mlx-lm,
    # batch 1 and 32 (issue 20).
    run 45 deepseek-tests python -m pytest -q -p no:cacheprovider -rf --tb=short -x tests/test_deepseek_decode_step.py
    tail -n 3 "$out/deepseek-tests.log"
    run 80 served-gemma3-http python benchmarks/served.py -p 512 -g 128 -r 2 -n 2 --no-ids --http --http-beside \
      --streams 32 --shape gemma3-270m --json "$out/h200-served-gemma3-270m-http.json"
    run 120 served-llama-1b-1 python benchmarks/served.py -p 512 -g 512 -r 2 -n 3 --no-text --mlx-lm-step \
      --streams 1 --shape llama-1b --json "$out/h200-served-llama-1b-1.json"
    grep -h '^| \|^==' "$out"/served-*.log
    run 60 prof-1b-s1 python benchmarks/gpu_engine_profile.py --shape llama-1b --streams 1 --steps 48 \
      --torch-profiler /tmp/prof-1b-s1.csv
    grep -h "ms/step\|GPU kernel time\|products\|rope\|paged attention\|other\|norm" "$out/prof-1b-s1.log"
    run 210 gpt-oss python benchmarks/gpu_decode.py --models gpt-oss-20b-12l --batches 1,32 --engines mlx-lm,step \
      -n 2 -g 64 --json "$out/h200-decode-gpt-oss.json"
    grep -h "gpt-oss" "$out/gpt-oss.log" | tail -8
    ;;
  s19c)
    # Session 19's last device minutes: DeepSeek V3's step tests on CUDA (s19b failed one on a name the GPU's
    # fused gate|up changes), the gemma3-270m HTTP A/B with the time s19b's 80 s lacked.
    run 45 deepseek-tests python -m pytest -q -p no:cacheprovider -rf --tb=short -x tests/test_deepseek_decode_step.py
    tail -n 3 "$out/deepseek-tests.log"
    run 150 served-gemma3-http python benchmarks/served.py -p 512 -g 128 -r 2 -n 2 --no-ids --http --http-beside \
      --streams 32 --shape gemma3-270m --json "$out/h200-served-gemma3-270m-http.json"
    grep -h '^| \|^==' "$out"/served-*.log
    ;;
  s20a)
    # The next device call (carry .gpu2 and .before: make .before as s18b says). Session 19's new steps on CUDA
    # (DeepSeek V3's MLA, Phi-3's LongRoPE: tested on the CPU only), the gemma3-270m HTTP A/B that s19b's 80 s
    # cut, then issue 20's before/after of the plain step (s18c: f67da1d against this tree, batch 1).
    (rm -rf /tmp/before && cp -r .before /tmp/before && cd /tmp/before && CMAKE_BUILD_PARALLEL_LEVEL=4 \
      python3 -m pip install -q --no-build-isolation --no-deps --no-compile -Ccmake.define.MLX_INFER_LTO=OFF \
      --target /tmp/site-before . > "$out/build-before.log" 2>&1; echo "before build rc=$?" >> "$out/phase.log") &
    BEFORE_BUILD=$!
    run 75 new-step-tests python -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_deepseek_decode_step.py \
      tests/test_longrope_step.py
    tail -n 3 "$out/new-step-tests.log"
    wait "$BEFORE_BUILD"
    run 150 served-gemma3-http python benchmarks/served.py -p 512 -g 128 -r 2 -n 2 --no-ids --http --http-beside \
      --streams 32 --shape gemma3-270m --json "$out/h200-served-gemma3-270m-http.json"
    grep -h '^| \|^==' "$out"/served-*.log
    decode="python benchmarks/gpu_decode.py --models llama-8b,llama-1b,gemma3-270m --batches 1 --engines mlx-lm,step -n 2 -g 64"
    if [ -d /tmp/site-before/mlx_infer ]; then
      PYTHONPATH=/tmp/site-before:/tmp/site run 110 decode-before $decode --json "$out/h200-decode-before.json"
      run 110 decode-after $decode --json "$out/h200-decode-after.json"
    else echo "before build missing" | tee -a "$out/phase.log"; tail -20 "$out/build-before.log"; fi
    grep -h "trial" "$out"/decode-*.log
    ;;
  s20b)
    # Session 20's second call: s20a's step tests again, in parallel (pytest-xdist in .gpu2: one case took ~35 s of
    # NVRTC on one core), then where a 1-stream engine step's host time goes (host/submit/wait and the step graph's
    # nodes by primitive), and qwen3-moe's 24-layer shape against mlx-lm (issue 20).
    run 200 new-step-tests python -m pytest -q -p no:cacheprovider -rf --tb=short -n 12 tests/test_deepseek_decode_step.py \
      tests/test_longrope_step.py
    tail -n 3 "$out/new-step-tests.log"
    run 90 host-step-1b python benchmarks/host_step.py --shape llama-1b --streams 1,8 --census
    run 90 host-step-8b python benchmarks/host_step.py --shape llama-8b --streams 1 --census
    grep -h "streams\|step graph" "$out"/host-step-*.log
    run 170 qwen3-moe python benchmarks/gpu_decode.py --models qwen3-moe-a3b-24l --batches 1,32 --engines mlx-lm,step \
      -n 2 -g 64 --json "$out/h200-decode-qwen3-moe.json"
    grep -h "trial" "$out/qwen3-moe.log"
    ;;
  s20c)
    # The lean step graph (session 20: the hidden state (B, E), weights' transposes made once at load, the paged
    # path's K/V written by one Scatter each with no views): CUDA tests of the paths it touches, then before
    # (.before = the tree without it, carried) and after in one call: host time and the step graph's nodes at 1
    # and 8 streams, the plain step at batch 1; the 1-stream engine against generate_step.
    (rm -rf /tmp/before && cp -r .before /tmp/before && cd /tmp/before && CMAKE_BUILD_PARALLEL_LEVEL=4 \
      python3 -m pip install -q --no-build-isolation --no-deps --no-compile -Ccmake.define.MLX_INFER_LTO=OFF \
      --target /tmp/site-before . > "$out/build-before.log" 2>&1; echo "before build rc=$?" >> "$out/phase.log") &
    BEFORE_BUILD=$!
    run 170 step-tests python -m pytest -q -p no:cacheprovider -rf --tb=short -n 12 tests/test_paged_decode_step.py \
      tests/test_gpt_oss_decode_step.py tests/test_deepseek_decode_step.py
    tail -n 3 "$out/step-tests.log"
    wait "$BEFORE_BUILD"
    hs="python benchmarks/host_step.py --shape llama-1b --streams 1,8 --census"
    PYTHONPATH=/tmp/site-before:/tmp/site run 45 host-step-before $hs
    run 45 host-step-after $hs
    grep -h "streams\|step graph" "$out"/host-step-*.log
    run 110 served-1b-1 python benchmarks/served.py -p 512 -g 512 -r 2 -n 3 --no-text --mlx-lm-step --streams 1 \
      --shape llama-1b --json "$out/h200-served-llama-1b-1.json"
    grep -h '^| ' "$out/served-1b-1.log"
    decode="python benchmarks/gpu_decode.py --models llama-8b,llama-1b --batches 1 --engines mlx-lm,step -n 2 -g 64"
    PYTHONPATH=/tmp/site-before:/tmp/site run 75 decode-before $decode --json "$out/h200-decode-before.json"
    run 75 decode-after $decode --json "$out/h200-decode-after.json"
    grep -h "trial" "$out"/decode-*.log
    ;;
  s21a)
    # Next session's first call (carry .gpu2 and .before = 534e78e, the tree before the lean step graph): s20c's
    # last test run, whose 4 failures went unidentified (its limit cut pytest's summary), with the summary kept —
    # on the tree before too if any fail; then the fused residual add + RMS norm (MLX_INFER_ADD_NORM=1) under the
    # step tests and its own device test. At most 8 files come back.
    (rm -rf /tmp/before && cp -r .before /tmp/before && cd /tmp/before && CMAKE_BUILD_PARALLEL_LEVEL=4 \
      python3 -m pip install -q --no-build-isolation --no-deps --no-compile -Ccmake.define.MLX_INFER_LTO=OFF \
      --target /tmp/site-before . > /tmp/build-before.log 2>&1; echo "before build rc=$?" >> "$out/phase.log") &
    BEFORE_BUILD=$!
    t="python -m pytest -q -p no:cacheprovider -rfE --tb=line -n 12 tests/test_gemma2_decode_step.py \
      tests/test_gemma4_decode_step.py tests/test_step_coverage.py"
    run 200 tests-after $t
    wait "$BEFORE_BUILD"
    if grep -q "FAILED" "$out/tests-after.log"; then PYTHONPATH=/tmp/site-before:/tmp/site run 120 tests-before $t; fi
    grep -h "FAILED\|ERROR\|passed\|failed" "$out"/tests-*.log | tail -30
    MLX_INFER_ADD_NORM=1 run 150 tests-addnorm python -m pytest -q -p no:cacheprovider -rfE --tb=short -n 12 \
      tests/test_add_rms_norm_cuda_text.py tests/test_paged_decode_step.py tests/test_mixed_steps.py \
      tests/test_decode_step.py
    grep -h "FAILED\|ERROR\|passed\|failed" "$out/tests-addnorm.log" | tail -20
    ;;
  s21b)
    # The fused residual add + RMS norm's A/B (off by default until this shows it faster): host time and graph
    # nodes, then the served engine with it as its own column, engines alternating.
    hs="python benchmarks/host_step.py --shape llama-1b --streams 1,8,64 --census"
    run 60 host-step-off $hs
    MLX_INFER_ADD_NORM=1 run 60 host-step-on $hs
    grep -h "streams\|step graph" "$out"/host-step-*.log
    run 150 served-1b-1 python benchmarks/served.py -p 512 -g 512 -r 2 -n 3 --no-text --mlx-lm-step --add-norm \
      --streams 1 --shape llama-1b --json "$out/h200-served-llama-1b-1.json"
    run 150 served-1b-32 python benchmarks/served.py -p 512 -g 128 -r 2 -n 3 --no-text --add-norm --streams 32 \
      --shape llama-1b --json "$out/h200-served-llama-1b-32.json"
    run 120 served-g3-32 python benchmarks/served.py -p 512 -g 128 -r 2 -n 3 --no-text --add-norm --streams 32 \
      --shape gemma3-270m --json "$out/h200-served-gemma3-32.json"
    grep -h '^| ' "$out"/served-*.log
    ;;
  s21c)
    # Where the gemma3-270m HTTP column's time goes (s20a: the server 0.74x the in-process engine at 32 streams,
    # llama-1B's 0.98x): py-spy (in .gpu2) over the whole process tree, folded per process.
    run 200 http-profile py-spy record -r 100 -f raw --subprocesses -o /tmp/http-gemma3.txt -- python \
      benchmarks/served.py -p 512 -g 256 -r 1 -n 2 --no-ids --http --http-beside --streams 32 --shape gemma3-270m \
      --json "$out/h200-served-gemma3-http-profiled.json"
    grep -h '^| ' "$out/http-profile.log"
    python benchmarks/profile_tree.py /tmp/http-gemma3.txt --top 20 --processes 6 > "$out/http-profile-tree.txt"
    head -150 "$out/http-profile-tree.txt"
    ;;
  s21d)
    # Session 21, first call after s21a-c: what one graph node costs MLX's host by kind (is a CustomKernel dearer
    # than a built-in op?), the fused add + norm's A/B alternating in one process, the CUDA-only test fixes, then
    # llama-1B's served table (HTTP column beside) at this code state.
    run 60 submit-cost python benchmarks/submit_cost.py --rows 1,32 --nodes 64 --rounds 3 --json "$out/submit-cost.json"
    run 120 host-ab python benchmarks/host_step.py --shape llama-1b --streams 1,8 --ab MLX_INFER_ADD_NORM=1 --rounds 4
    grep -h "median\|us/node" "$out"/submit-cost.log "$out"/host-ab.log
    run 120 tests python -m pytest -q -p no:cacheprovider -rfE --tb=short -n 12 tests/test_gemma4_decode_step.py \
      tests/test_gemma2_decode_step.py tests/test_step_coverage.py
    MLX_INFER_ADD_NORM=1 run 60 tests-addnorm python -m pytest -q -p no:cacheprovider -rfE --tb=short -n 8 \
      tests/test_decode_step.py -k caches_hold
    grep -h "FAILED\|ERROR\|passed\|failed" "$out"/tests*.log | tail -12
    ;;
  s21e)
    # Session 21, on the warm s21d machine: llama-1B's and gemma3-270m's served tables (HTTP column beside) at
    # this code state.
    run 280 llama-1b $served --shape llama-1b --http --http-beside --json "$out/h200-served-llama-1b.json"
    run 250 gemma3-270m $served --shape gemma3-270m --http --http-beside --json "$out/h200-served-gemma3-270m.json"
    grep -h '^| ' "$out"/llama-1b.log "$out"/gemma3-270m.log
    ;;
  s22a)
    # Next session's first call (the tree after session 21): this session's changes on CUDA — the step and kernel
    # tests with the reused primitives and the GEMV rule; the reused primitives' A/B (host_step --ab, set = off);
    # the capped GEMV rule against MLX's products (set = MLX_INFER_GEMV_ROWS=0) where it counts: llama-1B at 1/8
    # streams, llama-8B at 8 (the rule keeps its MLP and head on cuBLAS).
    run 170 tests python -m pytest -q -p no:cacheprovider -rfE --tb=short -n 14 tests/test_reused_kernel.py \
      tests/test_gemv_cuda_text.py tests/test_qkv_rope.py tests/test_paged_decode_step.py tests/test_mixed_steps.py \
      tests/test_decode_step.py tests/test_gemma4_decode_step.py
    grep -h "FAILED\|ERROR\|passed\|failed" "$out/tests.log" | tail -14
    run 90 reuse-ab python benchmarks/host_step.py --shape llama-1b --streams 1,8 --ab MLX_INFER_REUSE_KERNELS=0 \
      --rounds 3
    run 90 gemv-ab-1b python benchmarks/host_step.py --shape llama-1b --streams 1,8 --ab MLX_INFER_GEMV_ROWS=0 \
      --rounds 3
    run 120 gemv-ab-8b python benchmarks/host_step.py --shape llama-8b --streams 8 --ab MLX_INFER_GEMV_ROWS=0 \
      --rounds 2
    grep -h "median" "$out"/reuse-ab.log "$out"/gemv-ab-*.log
    ;;
  s22b)
    # The served tables at the new code state, the GEMV rule as its own column (--no-gemv: MLX's products), and the
    # HTTP column's TTFT split (served.py's JSON: engine_ttft_mean_ms beside ttft_mean_ms).
    run 280 llama-8b $served --shape llama-8b --streams 1,8,32 --no-gemv --json "$out/h200-served-llama-8b.json"
    run 270 llama-1b python benchmarks/served.py -p 512 -g 128 -r 2 -n 2 --no-text --streams 1,8,32 --no-gemv \
      --http --http-beside --shape llama-1b --json "$out/h200-served-llama-1b.json"
    grep -h '^| \|TTFT mean' "$out"/llama-8b.log "$out"/llama-1b.log | tail -40
    ;;
  s22c)
    # s22a's tests ran past their limit (156 tests in 170 s, two errors and a failure unnamed): the same files in
    # three runs that each finish; then the GEMV rule's A/B at 16 and 32 streams (s22b's served llama-1B at 32
    # streams decoded 1.77x with it against 2.28x without, though 32 rows never take the kernel).
    pt="python -m pytest -q -p no:cacheprovider -rfE --tb=short -n 14"
    run 100 tests-kernels $pt tests/test_reused_kernel.py tests/test_gemv_cuda_text.py tests/test_qkv_rope.py \
      tests/test_mixed_steps.py
    run 130 tests-steps $pt tests/test_paged_decode_step.py tests/test_decode_step.py
    run 130 tests-gemma4 $pt tests/test_gemma4_decode_step.py
    grep -h "^FAILED\|^ERROR\|passed\|failed" "$out"/tests-*.log | tail -20
    run 100 gemv-ab-32 python benchmarks/host_step.py --shape llama-1b --streams 16,32 --ab MLX_INFER_GEMV_ROWS=0 \
      --rounds 3
    grep -h "median" "$out"/gemv-ab-32.log
    ;;
  s23a)
    # (Session 22's last phase, not run: its device time went to machines that did not start.) gemma4's compiled
    # bfloat16 cases on CUDA: MLX's own mx.compile drift beside the step's (compile_drift.py) and the test, whose GPU
    # bound is twice that drift; the HTTP column at 32 streams with 8 client processes (4 streams each: s22b's split
    # put 11-19 ms between the server's first chunk and the client's read) and 256 tokens a request (s22b's decode
    # window was ~1 s); the GEMV kernel for 9-64 rows (MLX_INFER_GEMV_ROWS=64 against the default 8) on llama-1B,
    # whose weights all fit the 64 MiB cap but the LM head.
    run 45 drift python benchmarks/compile_drift.py
    run 90 tests-gemma4 python -m pytest -q -p no:cacheprovider -rfE --tb=short -n 14 \
      tests/test_gemma4_decode_step.py -k "bf16"
    grep -h "mx.compile\|^FAILED\|passed\|failed" "$out"/drift.log "$out"/tests-gemma4.log
    run 150 http-1b python benchmarks/served.py -p 512 -g 256 -r 2 -n 3 --no-text --streams 32 --http \
      --http-beside --http-clients 8 --shape llama-1b --json "$out/h200-served-llama-1b-http.json"
    grep -h '^| \|TTFT mean' "$out"/http-1b.log | tail -16
    run 90 gemv64-1b python benchmarks/host_step.py --shape llama-1b --streams 16,32,64 --ab MLX_INFER_GEMV_ROWS=64 \
      --rounds 2
    grep -h "median" "$out"/gemv64-*.log
    ;;
  s23b)
    # llama-8B's rows at 64 and 128 streams (s22b ran 1/8/32), and gemma3-270m's table at the current tree.
    run 300 llama-8b $served --shape llama-8b --streams 64,128 --json "$out/h200-served-llama-8b-64-128.json" \
      --plot "$out/h200-served-llama-8b-64-128.png"
    run 200 gemma3-270m $served --shape gemma3-270m --json "$out/h200-served-gemma3-270m.json" \
      --plot "$out/h200-served-gemma3-270m.png"
    grep -h '^| ' "$out"/llama-8b.log "$out"/gemma3-270m.log
    ;;
  s23c)
    # Issue 17's per-product table with our decode graphs' product beside MLX's and cuBLAS's (products.py "ours":
    # the GEMV kernel where its rule takes the operands), its worst ratio against cuBLAS, JSON + plot.
    run 300 products python benchmarks/products.py --ms 1,2,4,8,16,32,64,128,256 --json "$out/products.json" \
      --plot "$out/products.png"
    grep -h "step products\|worst" "$out"/products.log
    # Issue 16's two goals last measured in session 9 (H200), re-run at this tree: a request joining 31 decoding
    # streams gets its first token within 2x its TTFT alone; the host time of a 64-stream step (tiny shape) <= 1 ms.
    run 110 join-ttft python benchmarks/join_ttft.py --shape llama-1b -p 512 -n 3
    run 60 host-step python benchmarks/host_step.py --streams 32,64
    tail -4 "$out"/join-ttft.log; grep -h "streams" "$out"/host-step.log
    ;;
  s23d)
    # A 16-64-row llama-1B step is host-bound (s22c: wait ~0, MLX's submit 1.7-1.8 ms of 2.3-2.5), and each of its
    # 65 products past the GEMV rule costs MLX's host ~19-23 us (cuBLASLt descriptors and heuristic every call,
    # s21). Our tuned cuBLASLt primitive caches its plan per shape: what does a product cost the host through it,
    # and the step? A second build with it (MLX_INFER_CUBLAS=ON), then the submit probe (MLX's x @ W.T, the GEMV
    # kernel, ours) and the step's A/B (tuned on by default in that build; MLX_INFER_TUNED_PRODUCTS=0 off).
    t=$(date +%s)
    (cd /tmp/proj && CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-build-isolation --no-deps \
      --no-compile -Ccmake.define.MLX_INFER_LTO=OFF -Ccmake.define.MLX_INFER_CUBLAS=ON --target /tmp/site-cublas . \
      > "$out/build-cublas.log" 2>&1) && echo "built the cuBLAS copy in $(( $(date +%s) - t )) s" | tee -a "$out/phase.log"
    export PYTHONPATH=/tmp/site-cublas:/tmp/site
    python -c "from mlx_infer import _fast; print('tuned products available:', _fast.tuned_products_available())" \
      | tee -a "$out/phase.log"
    run 90 tuned-check python benchmarks/gpu_tuned_products.py --shapes llama-1b --ms 16,32 --iters 5 --rounds 1
    tail -3 "$out/tuned-check.log"
    run 90 submit-tuned python benchmarks/submit_cost.py --rows 2,16,32,64 --nodes 32 --kinds matmul_wt,skinny,tuned \
      --json "$out/submit-tuned.json"
    grep -h "rows" "$out"/submit-tuned.log
    run 120 tuned-ab-1b python benchmarks/host_step.py --shape llama-1b --streams 16,32,64 \
      --ab MLX_INFER_TUNED_PRODUCTS=0 --rounds 2
    grep -h "median" "$out"/tuned-ab-1b.log
    ;;
  s24b)
    # Session 24's second call: s23d (the tuned cuBLASLt build, its host cost per product and the llama-1B step's
    # A/B), then s23c's two issue-16 goals last measured in session 9 (join TTFT, 64-stream host step), on the
    # default build.
    bash "$0" s23d
    export PYTHONPATH=/tmp/site-proj:/tmp/site
    run 110 join-ttft python benchmarks/join_ttft.py --shape llama-1b -p 512 -n 3
    run 60 host-step python benchmarks/host_step.py --streams 32,64
    tail -4 "$out"/join-ttft.log; grep -h "streams" "$out"/host-step.log
    ;;
  s25a)
    # The HTTP goal's split (session 24's s24a: HTTP 0.81x e2e / 0.76x decode of the in-process engine at 32
    # streams, trials 0.65-0.95x), at a tree where the events cross the pipe as tuples and the server process makes
    # the text (ServerText): each column's engine mean inter-token latency (engine_itl_mean_ms) says whether the
    # engine process decodes slower than the engine in process (equal: the gap is the server's, the loopback's, the
    # clients'); the in-process text column beside the ids one (the server must detokenize: the like-for-like
    # anchor); then the same run with the text back in the engine process (MLX_INFER_SERVER_TEXT=0, the server
    # inherits it), the A/B of ServerText.
    run 220 http-1b python benchmarks/served.py -p 512 -g 256 -r 2 -n 3 --streams 32 --http \
      --http-beside --http-clients 8 --shape llama-1b --json "$out/h200-served-llama-1b-http.json"
    grep -h '^| \|TTFT mean' "$out"/http-1b.log | tail -16
    MLX_INFER_SERVER_TEXT=0 run 200 http-1b-engine-text python benchmarks/served.py -p 512 -g 256 -r 2 -n 3 \
      --no-ids --streams 32 --http --http-beside --http-clients 8 --shape llama-1b \
      --json "$out/h200-served-llama-1b-http-engine-text.json"
    grep -h '^| \|TTFT mean' "$out"/http-1b-engine-text.log | tail -12
    ;;
  s25c)
    # Where the engine process's and the server's Python time goes at 32 streams (py-spy over the whole tree, one
    # HTTP trial; the image's py-spy), folded per process (profile_tree.py).
    spy=$(command -v py-spy || ls /opt/*/.venv/bin/py-spy 2>/dev/null | head -1)
    run 150 http-spy "${spy:-py-spy}" record -r 200 -f raw --subprocesses -o "$out/http-spy.txt" -- python \
      benchmarks/served.py -p 512 -g 256 -r 1 -n 1 --no-text --no-ids --streams 32 --http --http-clients 8 \
      --shape llama-1b
    python benchmarks/profile_tree.py "$out/http-spy.txt" --top 15 --processes 4 > "$out/http-spy-tree.txt" 2>&1
    head -40 "$out/http-spy-tree.txt"
    ;;
  s26a)
    # Session 25's 1-stream split (s25-host): llama-1B's step host-bound at ~5.4 us of MLX encoding a node (314
    # nodes), so the step drops 4 views a layer (K/V arrive from qkv_rope in the Scatter's update layout, the
    # attention kernel writes (R, H D)) and, with MLX_INFER_PAGED_ATTN_ONE_PASS=1 (off until this runs), the
    # split-K merge kernel (the last split merges inside pass 1). First the CUDA tests of the changed kernels and
    # steps (the one-pass merge on too), then the node census and step split and the one-pass A/B, then (s26b)
    # the served 1-stream rows against generate_step (and 32 streams), llama-1B and llama-8B.
    run 170 cuda-tests python -m pytest -q -x -p no:cacheprovider tests/test_paged_step_kernel.py \
      tests/test_paged_attention.py tests/test_qkv_rope.py tests/test_mixed_steps.py
    tail -3 "$out"/cuda-tests.log
    MLX_INFER_PAGED_ATTN_ONE_PASS=1 run 120 cuda-tests-one-pass python -m pytest -q -x -p no:cacheprovider \
      tests/test_paged_step_kernel.py tests/test_mixed_steps.py
    tail -3 "$out"/cuda-tests-one-pass.log
    run 60 host-1b python benchmarks/host_step.py --shape llama-1b --streams 1,8,32 --census
    run 100 one-pass-ab python benchmarks/host_step.py --shape llama-1b --streams 1,32 \
      --ab MLX_INFER_PAGED_ATTN_ONE_PASS=1 --interleave 10 --rounds 20
    grep -h "interleaved" "$out"/one-pass-ab.log
    run 60 host-8b python benchmarks/host_step.py --shape llama-8b --streams 1,8 --census
    grep -h "streams\|graph" "$out"/host-1b.log "$out"/host-8b.log
    ;;
  s27a)
    # Session 26's changes, never run on a GPU (its device starts failed), and qkv_rope writing K/V into the
    # storage itself (on by default; MLX_INFER_QKV_ROPE_WRITE=0 keeps the two Scatters a layer), in one call
    # (the device budget went to failed starts): the step's CUDA tests with the write and both fused kernels on
    # (cpp/fused/, off by default: a CustomKernel costs MLX's host more than a built-in op); the served 1-stream
    # rows against generate_step (the missed goal) with a column of both fused kernels on; the write's A/B.
    run 100 step-tests env MLX_INFER_FUSED_ADD_NORM=1 MLX_INFER_FUSED_GATED=1 MLX_INFER_L2_PREFETCH_O=1 \
      python -m pytest -q -p no:cacheprovider -rfE --tb=short -n 8 tests/test_paged_step_kernel.py \
      tests/test_mixed_steps.py tests/test_fused_cuda.py
    tail -4 "$out"/step-tests.log
    served() {
      run 140 served-$1 python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 1 \
        --mlx-lm-step --shape $1 --env-column MLX_INFER_FUSED_ADD_NORM=1,MLX_INFER_FUSED_GATED=1 \
        --json "$out/served-$1-1.json"
      grep -h '^| ' "$out/served-$1.log"
    }
    served llama-1b
    run 60 ab-1b python benchmarks/host_step.py --shape llama-1b --streams 1 --ab MLX_INFER_QKV_ROPE_WRITE=0 \
      --interleave 10 --rounds 12 --census
    grep -h "interleaved\|graph" "$out"/ab-1b.log
    served llama-8b
    ;;
  s27m)
    # s27a cut to what ~300 device-seconds hold: the step's CUDA tests with qkv_rope's K/V write (on by
    # default) and both fused kernels on, then the write's A/B at 1 stream (llama-1B) with the node census.
    run 90 step-tests env MLX_INFER_FUSED_ADD_NORM=1 MLX_INFER_FUSED_GATED=1 \
      python -m pytest -q -p no:cacheprovider -rfE --tb=short -n 8 tests/test_paged_step_kernel.py \
      tests/test_mixed_steps.py tests/test_fused_cuda.py
    tail -4 "$out"/step-tests.log
    run 60 ab-1b python benchmarks/host_step.py --shape llama-1b --streams 1 --ab MLX_INFER_QKV_ROPE_WRITE=0 \
      --interleave 10 --rounds 10 --census
    grep -h "interleaved\|graph\|streams" "$out"/ab-1b.log
    ;;
  s27b)
    # What s27m left (the device budget): the kernels' CUDA tests (the float32 GeGLU bound is new); llama-8B's
    # 1-stream A/Bs of one-row products through our GEMV kernel and of the L2 prefetch of each layer's o weight;
    # the step at served.py's context (512-token prompts: s26's served 1-stream llama-1B ran 2.69 ms a token
    # against host_step's 1.62 ms step at 16-token prompts).
    run 90 cuda-tests python -m pytest -q -p no:cacheprovider -rfE --tb=short -n 8 tests/test_fused_cuda.py \
      tests/test_qkv_rope.py tests/test_l2_prefetch.py tests/test_paged_attention.py
    tail -4 "$out"/cuda-tests.log
    run 130 ab-8b python benchmarks/host_step.py --shape llama-8b --streams 1 --ab MLX_INFER_GEMV_MIN_ROWS=1 \
      --ab MLX_INFER_L2_PREFETCH_O=1 --interleave 10 --rounds 12
    grep -h "interleaved" "$out"/ab-8b.log
    run 50 host-1b-512 python benchmarks/host_step.py --shape llama-1b --streams 1 --prompt 512 --census
    grep -h "streams\|graph" "$out"/host-1b-512.log
    ;;
  s28a)
    # Issue 16's whole served table after the K/V write and the fused defaults (session 27), on the H200 the goals
    # name: the three shapes at 1-128 streams against BatchGenerator and, at 1 stream, generate_step. One shape
    # a call (each ~4-7 minutes): bash benchmarks/h200_engine.sh s28a llama-1b (then llama-8b, gemma3-270m).
    shape=${2:-llama-1b}
    run 560 served-$shape python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text \
      --streams 1,8,32,64,128 --mlx-lm-step --shape $shape --json "$out/served-$shape.json" \
      --plot "$out/served-$shape.png"
    grep -h '^| ' "$out/served-$shape.log"
    ;;
  s28b)
    # After ef46736 (the q/k norms inside qkv_rope, the sandwich norm inside add_rms_norm): the kernels' and the
    # steps' CUDA tests, gemma3-270m's census, the two changes' A/B on its step, and its served table with the
    # old graph as a column beside (MLX_INFER_QKV_ROPE_NORM=0 and MLX_INFER_FUSED_ADD_NORM=0 = session 28's
    # gemma graph: its post-norms kept it off the fused add+norm then).
    run 150 cuda-tests python -m pytest -q -p no:cacheprovider -rfE --tb=short -n 8 tests/test_fused_cuda.py \
      tests/test_qkv_rope.py tests/test_l2_prefetch.py tests/test_paged_step_kernel.py tests/test_mixed_steps.py \
      tests/test_gemma4_decode_step.py
    tail -4 "$out"/cuda-tests.log
    run 60 census-gemma python benchmarks/host_step.py --shape gemma3-270m --streams 1,32 --prompt 512 --census
    grep -h "streams\|graph" "$out"/census-gemma.log
    run 120 ab-gemma python benchmarks/host_step.py --shape gemma3-270m --streams 1,32 \
      --ab MLX_INFER_QKV_ROPE_NORM=0 --interleave 10 --rounds 8
    grep -h "interleaved" "$out"/ab-gemma.log
    run 330 served-gemma3-270m python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text \
      --streams 1,8,32,64,128 --mlx-lm-step --shape gemma3-270m \
      --env-column MLX_INFER_QKV_ROPE_NORM=0,MLX_INFER_FUSED_ADD_NORM=0 \
      --json "$out/served-gemma3-270m.json" --plot "$out/served-gemma3-270m.png"
    grep -h '^| ' "$out/served-gemma3-270m.log"
    ;;
  s28c)
    # On an H200 (the goals' GPU) after ef46736: the new kernels' CUDA tests, then the served table of the shapes
    # named (default llama-1b gemma3-270m; llama-8b in a call of its own), as s28a runs it.
    # NO_TESTS=1 skips the tests (a later call on the same tree).
    shift
    if [ -z "${NO_TESTS:-}" ]; then
      run 120 cuda-tests python -m pytest -q -p no:cacheprovider -rfE --tb=short -n 8 tests/test_fused_cuda.py \
        tests/test_qkv_rope.py tests/test_paged_step_kernel.py tests/test_mixed_steps.py
      tail -4 "$out"/cuda-tests.log
    fi
    for shape in ${@:-llama-1b gemma3-270m}; do
      run 330 served-$shape python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text \
        --streams 1,8,32,64,128 --mlx-lm-step --shape $shape --json "$out/served-$shape.json" \
        --plot "$out/served-$shape.png"
      grep -h '^| ' "$out/served-$shape.log"
    done
    ;;
  s29a)
    # Session 28's open question: gemma3-270m's own peak rose with the norm kernels (1 stream 0.65 -> 0.77 GB,
    # 64 streams 1.89 -> 2.32). Each switch apart, at 1 and 64 streams, beside the default.
    run 300 peak-gemma python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 1,64 \
      --shape gemma3-270m --env-column MLX_INFER_QKV_ROPE_NORM=0 --env-column MLX_INFER_FUSED_ADD_NORM=0 \
      --json "$out/peak-gemma.json"
    grep -h '^| ' "$out/peak-gemma.log"
    ;;
  s29b)
    # Session 29's first call: the CUDA tests (the shared block_sum header's first NVRTC compile, the loosened
    # float32 RoPE test), then s29a's peak split.
    run 150 cuda-tests python -m pytest -q -p no:cacheprovider -rfE --tb=short -n 8 tests/test_fused_cuda.py \
      tests/test_qkv_rope.py tests/test_l2_prefetch.py tests/test_paged_step_kernel.py tests/test_mixed_steps.py
    tail -4 "$out"/cuda-tests.log
    bash "$0" s29a
    ;;
  s29c)
    # The norm kernels bounded to decode-sized steps (MLX_INFER_FUSED_NORM_MAX_ROWS, default 256) against session
    # 28's unbounded graph as a column: peak, TTFT and decode at 1, 8, 64 streams (gemma3-270m), 1 and 64 (llama-1b).
    run 60 cuda-tests python -m pytest -q -p no:cacheprovider -rfE --tb=short -n 8 tests/test_step_graph.py \
      tests/test_fused_cuda.py
    tail -3 "$out"/cuda-tests.log
    run 280 bound-gemma python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 1,8,64 \
      --shape gemma3-270m --env-column MLX_INFER_FUSED_NORM_MAX_ROWS=1000000 --json "$out/bound-gemma.json"
    grep -h '^| ' "$out/bound-gemma.log"
    run 200 bound-llama-1b python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 1,64 \
      --shape llama-1b --env-column MLX_INFER_FUSED_NORM_MAX_ROWS=1000000 --json "$out/bound-llama-1b.json"
    grep -h '^| ' "$out/bound-llama-1b.log"
    ;;
  s29d)
    # Run at ba25323 (MLX_INFER_SEGMENT_LAYERS was removed after it lost). The prompt steps' peak with the norm
    # kernels on every step: committed every 4 or 2 layers
    # (MLX_INFER_SEGMENT_LAYERS) against the 256-row norm bound (the default) and session 28's one graph; then,
    # as a check of why, the bound and the one graph under MLX_MAX_OPS_PER_BUFFER=40 (the whole process).
    unb=MLX_INFER_FUSED_NORM_MAX_ROWS=1000000
    run 260 seg-gemma python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 1,8,64 \
      --shape gemma3-270m --env-column $unb --env-column $unb,MLX_INFER_SEGMENT_LAYERS=4 \
      --env-column $unb,MLX_INFER_SEGMENT_LAYERS=2 --json "$out/seg-gemma.json"
    grep -h '^| ' "$out/seg-gemma.log"
    run 150 seg-llama-1b python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 1,64 \
      --shape llama-1b --env-column MLX_INFER_SEGMENT_LAYERS=4 --json "$out/seg-llama-1b.json"
    grep -h '^| ' "$out/seg-llama-1b.log"
    run 120 ops40-gemma env MLX_MAX_OPS_PER_BUFFER=40 python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text \
      --streams 1,64 --shape gemma3-270m --env-column $unb --json "$out/ops40-gemma.json"
    grep -h '^| ' "$out/ops40-gemma.log"
    ;;
  s29e)
    # After the 256-row norm bound, 1 stream against generate_step too (the peak goal read against both of
    # mlx-lm's: session 28 had llama-1b's own peak 2.95 GB against generate_step's 2.80); the device time left.
    for shape in llama-1b gemma3-270m; do
      # the gated kernel off as a column: whether its prompt-step nodes hold llama's 1-stream peak above the step's
      run 120 served-$shape python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 1 \
        --mlx-lm-step --shape $shape --env-column MLX_INFER_FUSED_GATED=0 --json "$out/served-$shape.json"
      grep -h '^| ' "$out/served-$shape.log"
    done
    ;;
  s30a)
    # Session 30's first call: the CUDA tests at session 29's last tree (test_step_graph's census tests now on the
    # CPU device; the 256-row norm bound), then the 1-stream rows against generate_step: llama-1b with the gated
    # kernel and qkv_rope's K/V write off as columns (which prompt-step nodes hold its own peak above generate_step's), gemma3-270m.
    run 150 cuda-tests python -m pytest -q -p no:cacheprovider -rfE --tb=short -n 8 tests/test_step_graph.py \
      tests/test_fused_cuda.py tests/test_qkv_rope.py tests/test_paged_step_kernel.py tests/test_mixed_steps.py
    tail -4 "$out"/cuda-tests.log
    run 150 served-llama-1b python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 1 \
      --mlx-lm-step --shape llama-1b --env-column MLX_INFER_FUSED_GATED=0 --env-column MLX_INFER_QKV_ROPE_WRITE=0 \
      --json "$out/served-llama-1b.json"
    grep -h '^| ' "$out/served-llama-1b.log"
    run 100 served-gemma3-270m python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 1 \
      --mlx-lm-step --shape gemma3-270m --json "$out/served-gemma3-270m.json"
    grep -h '^| ' "$out/served-gemma3-270m.log"
    ;;
  s30b)
    # Issue 16's other goals at the same tree as s30a and the s28a tables (session 30): a request joining 31
    # decoding streams, the 64-stream host step (tiny llama), the HTTP column at 32 streams (text made in the
    # server, the in-process text column beside); then llama-1b's 1-stream peak under MLX_MAX_OPS_PER_BUFFER=40
    # (the whole process: whether the commit interval is why its own peak sits ~0.04 GB above generate_step's).
    run 110 join-ttft python benchmarks/join_ttft.py --shape llama-1b -p 512 -n 3
    run 60 host-step python benchmarks/host_step.py --streams 32,64
    tail -4 "$out"/join-ttft.log; grep -h "streams" "$out"/host-step.log
    run 230 http-1b python benchmarks/served.py -p 512 -g 256 -r 2 -n 3 --streams 32 --http \
      --http-beside --http-clients 8 --shape llama-1b --json "$out/served-llama-1b-http.json"
    grep -h '^| \|TTFT mean' "$out"/http-1b.log | tail -16
    run 100 ops40-llama-1b env MLX_MAX_OPS_PER_BUFFER=40 python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 \
      --no-text --streams 1 --mlx-lm-step --shape llama-1b --json "$out/ops40-llama-1b.json"
    grep -h '^| ' "$out"/ops40-llama-1b.log
    ;;
  s30c)
    # Where llama-8B's 1-stream step goes at session 30's tree (the one goal the H100 table misses: 1.11x
    # generate_step): each kernel of 4 decode steps under Nsight Compute, ours and generate_step's, caches and
    # clocks left as they run (session 25's profile flushed the caches, which inflates the small kernels); then
    # the step's wall split and node census.
    for eng in engine mlx-lm; do kernel_profile 200 "$eng-llama-8b" $eng; done
    python benchmarks/kernel_times.py --summarize "$out/engine-llama-8b.csv" "$out/mlx-lm-llama-8b.csv" --steps 4 \
      > "$out/summary.txt" 2>&1; head -30 "$out/summary.txt"; gzip -f "$out"/*.csv
    run 120 host-8b python benchmarks/host_step.py --shape llama-8b --streams 1 --prompt 512 --census
    grep -h "streams\|graph" "$out"/host-8b.log
    ;;
  s30d)
    # s30c's profile had the paged attention at 18.3 us a layer (llama-8B, 1 row, ~600 keys: 2.6 MB of K/V),
    # 9 % of the step: latency-bound (10 splits of 64 keys, 4 dependent iterations each, then the last block's
    # merge one L2 round trip a split). After the merge loops were unrolled (8 splits' loads in flight): the CUDA
    # tests, then the kernel under Nsight Compute by the split floor and the key pipeline, then the step A/B.
    run 120 cuda-tests python -m pytest -q -p no:cacheprovider -rfE --tb=short -n 8 tests/test_paged_attention.py \
      tests/test_paged_step_kernel.py
    tail -3 "$out"/cuda-tests.log
    csvs=""
    for arm in default MLX_INFER_PAGED_ATTN_MIN_SPLIT_KEYS=16 MLX_INFER_PAGED_ATTN_MIN_SPLIT_KEYS=32 \
        MLX_INFER_PAGED_ATTN_UNROLL=4 MLX_INFER_PAGED_ATTN_PREFETCH=1 MLX_INFER_PAGED_ATTN_ONE_PASS=0; do
      kernel_profile 75 "$(arm_name $arm)" engine $(arm_env $arm)
      csvs="$csvs $out/$(arm_name $arm).csv"
    done
    python benchmarks/kernel_times.py --summarize $csvs --steps 4 > "$out/summary.txt" 2>&1
    head -14 "$out/summary.txt"; gzip -f "$out"/*.csv
    run 150 ab-split python benchmarks/host_step.py --shape llama-8b --streams 1 --prompt 512 \
      --ab MLX_INFER_PAGED_ATTN_MIN_SPLIT_KEYS=16 --interleave 10 --rounds 12
    grep -h "interleaved" "$out"/ab-split.log
    ;;
  s30e)
    # s30d cut to the device time left (session 30): the changed kernel's CUDA tests, llama-8B's 1-stream row
    # against generate_step with the split floor at 16 keys as a column, then the kernel under Nsight Compute,
    # default and split floor 16.
    run 60 cuda-tests python -m pytest -q -p no:cacheprovider -rfE --tb=short -n 8 tests/test_paged_attention.py
    tail -3 "$out"/cuda-tests.log
    run 130 served-llama-8b python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 1 \
      --mlx-lm-step --shape llama-8b --env-column MLX_INFER_PAGED_ATTN_MIN_SPLIT_KEYS=16 \
      --json "$out/served-llama-8b.json"
    grep -h '^| ' "$out/served-llama-8b.log"
    for arm in default MLX_INFER_PAGED_ATTN_MIN_SPLIT_KEYS=16; do
      kernel_profile 70 "$(arm_name $arm)" engine $(arm_env $arm)
      python benchmarks/kernel_times.py --summarize "$out/$(arm_name $arm).csv" --steps 4 2>&1 | head -4
    done
    gzip -f "$out"/*.csv
    ;;
  s30f)
    # Issue 23's one-rank case on one GPU (the multi-GPU kinds are not lent): benchmarks/distributed.py alone is
    # the baseline its NCCL runs compare against (a launch of one rank is the same one-process group), llama-8B
    # at batch 1 (the compiled step) and 8 / 32 (the engine).
    run 400 distributed-n1 python benchmarks/distributed.py --shape llama-8b --batches 1,8,32 -p 512 -g 128 \
      --json "$out/distributed-n1.json"
    tail -8 "$out"/distributed-n1.log
    ;;
  s31q)
    # Issue 17 names the 4/8-bit affine formats, never measured on a GPU: MLX's quantized_matmul (what every decode
    # graph runs for a quantized checkpoint) per product against the bf16 rows (MLX, cuBLAS, ours) and the packed
    # weights at the bandwidth (products.py --bits 4,8, its default).
    run 330 products-q python benchmarks/products.py --shapes llama-8b,llama-1b --ms 1,8,32,128 \
      --json "$out/products-q.json" --plot "$out/products-q.png"
    grep -h "step products\|worst" "$out/products-q.log"
    ;;
  s31r)
    # The fused dequantizing GEMV (cpp/matmul/qgemv_cuda.cpp): its CUDA tests, then 4-bit llama-8B served at 1
    # stream with the kernel off as a column (MLX's quantized_matmul; the default routes 1-4 rows to the kernel)
    # and mlx-lm, then each kernel's device time under Nsight Compute (MLX's qmv / qmm against ours). Session 31
    # ran the tests and the Nsight part (s31r/); the served A/B is still to run.
    run 90 qgemv-tests python -m pytest -q -p no:cacheprovider -rfE --tb=short -n 8 tests/test_qgemv_cuda.py \
      tests/test_qgemv_cuda_text.py
    tail -3 "$out"/qgemv-tests.log
    run 150 served-8b-q4 python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 1 --mlx-lm-step \
      --shape llama-8b --quantize 4 --env-column MLX_INFER_QGEMV_ROWS=0 --json "$out/served-8b-q4.json"
    grep -h '^| ' "$out/served-8b-q4.log"
    # a host-bound quantized model: does the kernel's node (a custom kernel, ~7 us of MLX's host against qmv's ~5)
    # cost more than its device time saves at 1-4 streams?
    run 120 served-1b-q4 python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 1,4 --mlx-lm-step \
      --shape llama-1b --quantize 4 --env-column MLX_INFER_QGEMV_ROWS=0 --json "$out/served-1b-q4.json"
    grep -h '^| ' "$out/served-1b-q4.log"
    ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
    run 90 qk "${ncu_bin:-ncu}" --csv --profile-from-start off --cache-control all --clock-control none \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum --log-file "$out/qk.csv" \
      python benchmarks/quantized_kernels.py --shape llama-8b --ms 1,2,8 --labels "$out/qk.labels"
    python benchmarks/quantized_kernels.py --summarize "$out/qk.csv" --labels "$out/qk.labels" \
      > "$out/qk-summary.txt" 2>&1; cat "$out/qk-summary.txt"; gzip -f "$out/qk.csv"
    ;;
  s32a)
    # After session 31: the dequantizing GEMV on by default for 1-4 rows, its tensor-core form (5-64 rows, behind
    # MLX_INFER_QGEMV_ROWS) never run. The CUDA tests (the kernels against MLX's quantized_matmul; the bf16 GEMV,
    # whose tensor-core text now ends in gemv_common.h's kMmaStore; the decode-step suites, whose quantized variants
    # now take the kernel), then 4-bit llama-8B served at 1 / 8 / 32 streams with
    # the kernel off and on for 1-64 rows as columns, then each kernel's device time at 1-64 rows.
    run 200 cuda-tests python -m pytest -q -p no:cacheprovider -p no:benchmark -rfE --tb=short -n 8 \
      tests/test_qgemv_cuda.py tests/test_gemv_cuda_text.py tests/test_step_graph.py tests/test_paged_step_kernel.py \
      tests/test_mixed_steps.py
    tail -4 "$out"/cuda-tests.log
    # the quantized tiny models' steps against their eager forward (MLX's quantized_matmul), now on the kernel
    run 150 quant-step-tests python -m pytest -q -p no:cacheprovider -p no:benchmark -rfE --tb=short -n 8 \
      tests/test_decode_step.py tests/test_paged_decode_step.py -k "q4 or q8 or quant"
    tail -4 "$out"/quant-step-tests.log
    ;;
  s32b)
    # s32a's second call (each call < 10 minutes): the served A/B and the kernels' device times.
    run 300 served-8b-q4 python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 1,8,32 \
      --mlx-lm-step --shape llama-8b --quantize 4 --env-column MLX_INFER_QGEMV_ROWS=0 \
      --env-column MLX_INFER_QGEMV_ROWS=64 --json "$out/served-8b-q4.json"
    grep -h '^| ' "$out/served-8b-q4.log"
    ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
    run 100 qk "${ncu_bin:-ncu}" --csv --profile-from-start off --cache-control all --clock-control none \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum --log-file "$out/qk.csv" \
      python benchmarks/quantized_kernels.py --shape llama-8b --ms 1,2,4,8,32,64 --bits 4 --labels "$out/qk.labels"
    python benchmarks/quantized_kernels.py --summarize "$out/qk.csv" --labels "$out/qk.labels" \
      > "$out/qk-summary.txt" 2>&1; cat "$out/qk-summary.txt"; gzip -f "$out/qk.csv"
    ;;
  s30g)
    # llama-1B's own 1-stream peak sits ~0.04 GB above generate_step's, and its activations (~0.36 GB above the
    # weights and KV) match the activation ceiling's reserve: 8 layers x 512 rows x (8 hidden + 3 intermediate)
    # x 2 bytes = 0.34 GB (engine/activations.py). The reserve at 4 and 2 layers as columns: own peak and TTFT at
    # 1 stream (against generate_step) and at 8 and 64 streams (where a small reserve made the host wait, session 7).
    for shape in llama-1b gemma3-270m; do
      run 200 ceiling-$shape python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 1,8,64 \
        --mlx-lm-step --shape $shape --env-column MLX_INFER_CEILING_LAYERS=4 --env-column MLX_INFER_CEILING_LAYERS=2 \
        --json "$out/ceiling-$shape.json"
      grep -h '^| ' "$out/ceiling-$shape.log"
    done
    ;;
  s27c)
    # The L2-prefetch probe (the mechanism alone, CUPTI-timed).
    run 100 l2-prefetch python benchmarks/gpu_l2_prefetch_probe.py --json "$out/l2-prefetch.json"
    ;;
  s26b)
    # s26a's second half, on the warm machine: the served 1-stream rows against generate_step, and 32 streams.
    for shape in llama-1b llama-8b; do
      run 110 served-$shape python benchmarks/served.py -p 512 -g 128 -r 1 -n 2 --no-text --streams 1,32 \
        --mlx-lm-step --shape $shape --json "$out/h200-served-$shape-1-32.json"
      grep -h '^| ' "$out/served-$shape.log"
    done
    ;;
  s25b)
    # Session 24's step A/Bs were host-noise-bound (one arm per measurement: round-to-round swings of 40-50 %).
    # Again with both arms' engines live and stepped in alternating 10-step blocks (host_step.py --interleave):
    # the tuned cuBLASLt products (the cuBLAS build) and the GEMV kernel for 9-64 rows, llama-1B and llama-8B.
    t=$(date +%s)
    (cd /tmp/proj && CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-build-isolation --no-deps \
      --no-compile -Ccmake.define.MLX_INFER_LTO=OFF -Ccmake.define.MLX_INFER_CUBLAS=ON --target /tmp/site-cublas . \
      > "$out/build-cublas.log" 2>&1) && echo "built the cuBLAS copy in $(( $(date +%s) - t )) s" | tee -a "$out/phase.log"
    for shape in llama-1b llama-8b; do
      PYTHONPATH=/tmp/site-cublas:/tmp/site run 120 tuned-$shape python benchmarks/host_step.py --shape $shape \
        --streams 16,32,64 --ab MLX_INFER_TUNED_PRODUCTS=0 --interleave 10 --rounds 20
      run 120 gemv64-$shape python benchmarks/host_step.py --shape $shape --streams 16,32,64 \
        --ab MLX_INFER_GEMV_ROWS=64 --interleave 10 --rounds 20
    done
    grep -h "interleaved" "$out"/tuned-*.log "$out"/gemv64-*.log
    ;;
  *) echo "usage: $0 a|b|c1|c2|d1|prof|e|next|s7a|s7b|s7c|s8a|s8b|s8c|s9a|s9b|s9c|s10a|s10b|s10c|s11|s12a|s12b|s13a|s13b|s13c|s13d|s13e|s13f|s14a|s14b|s14c|s15a|s15b|s15c|s15d|s16a|s16b|s16c|s17a|s17b|s18a|s18b|s18c|s18d|s18e|s19a|s19b|s19c|s20a|s20b|s20c|s21a|s21b|s21c|s21d|s21e|s22a|s22b|s22c|s23a|s23b|s23c|s23d|s24b|s25a|s25b|s25c|s26a|s26b|s27a|s27m|s27b|s27c|s28a|s28b|s28c|s29a|s29b|s29c|s29d|s29e|s30a|s30b|s30c|s30d|s30e|s30f|s30g" >&2
     exit 2 ;;
esac
