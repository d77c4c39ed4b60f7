#!/bin/bash
# Everything issue 5 measures, on a GPU machine, results under $OUT (the device tool's commands stop at 10 minutes,
# so run it as three commands: `... tests` (up to 7 minutes with a cold Triton cache), `... tune timing profile`,
# then `... compare spec`):
#   GPU tests -> kernel tile/warp tuning -> the 0.8B-shaped model -> decode step timing (GPU vs host) ->
#   decode profiles at BS 1 and 32 -> truespec vs transformers (BS 1, 8, 32, 128 and the mixed workload) ->
#   the embedded model's speculation speeds. Each part has its own time limit, so one failure costs only itself.
#
#   bash benchmarks/gpu_suite.sh [PARTS...]     # PARTS: tests tune timing profile compare spec (default: all)
#                                               # not in the default: kernel_tests (the kernels' GPU tests; tests runs the engine's),
#                                               # kv (compressed-cache decode speed),
#                                               # governor (speculation vs none, governor auto / off), serve (load),
#                                               # prefill (one attention layer's prefill: split-KV vs tiled vs SDPA),
#                                               # ttft (the engine's TTFT at 512 / 8K / 32K, BS 1 / 8; decode gaps
#                                               # while a 32K prompt arrives),
#                                               # prefix (multi-turn prefix caching on the 0.8B shape, issue 16),
#                                               # splits (split-KV cap 16 / 32 / 64 / 128 at 8K-32K keys, issue 14),
#                                               # splits_tests (its GPU tests at 32K keys: a compile per cap and
#                                               # format, so kept out of part tests' time limit)
#
# fla-core (optional; transformers' best GDN path and truespec's chunked prefill) is installed from .whl/ if there.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-.out/gpu_suite}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # .whl/serve/: fastapi, uvicorn, pydantic ... for `truespec serve` (part serve)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl $(ls .whl/serve/*.whl 2>/dev/null) \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src:tests PYTHONUNBUFFERED=1
parts=${*:-tests tune timing profile compare spec}
has() { [[ " $parts " == *" $1 "* ]]; }
shape=/tmp/qwen35-0.8b-shape
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"

# the GPU tests in two parts of <= 9 minutes each (a device command stops at 10): the engine-level ones, then kernels
engine_tests=$(ls tests/test_gpu_*.py)
if has tests; then
    timeout 540 python3 -m pytest -q -m gpu -p no:cacheprovider $engine_tests 2>&1 | tail -30 > "$OUT/gpu_tests.log"
    tail -3 "$OUT/gpu_tests.log"
fi
if has kernel_tests; then
    timeout 540 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ --ignore=tests/test_paged_attention_many_splits.py \
        $(for f in $engine_tests; do echo "--ignore=$f"; done) 2>&1 | tail -30 > "$OUT/gpu_kernel_tests.log"
    tail -3 "$OUT/gpu_kernel_tests.log"
fi
if has tune; then
    timeout 90 python3 benchmarks/tune_decode_kernels.py --batch-sizes 1 8 32 128 --query-len 1 4 \
        > "$OUT/tune_decode_kernels.txt" 2>&1
fi
if has timing || has profile || has compare; then
    [ -d $shape ] || timeout 60 python3 benchmarks/qwen35_shape.py --out $shape --device cuda
fi
if has timing; then
    timeout 120 python3 benchmarks/step_timing.py --model $shape --batch-sizes 1 8 32 > "$OUT/step_timing.txt" 2>&1
    tail -6 "$OUT/step_timing.txt"
fi
if has profile; then
    for bs in 1 32; do
        timeout 60 python3 benchmarks/profile_step.py --model $shape --batch-size $bs > "$OUT/profile_bs$bs.txt" 2>&1
        grep "GPU kernel time" "$OUT/profile_bs$bs.txt"
    done
fi
if has compare; then
    timeout 300 python3 benchmarks/vs_transformers.py --model $shape --json "$OUT/vs_transformers.json" \
        > "$OUT/vs_transformers.txt" 2>&1  # BS 1, 8, 32, 128: truespec and transformers
    tail -12 "$OUT/vs_transformers.txt"
    timeout 120 python3 benchmarks/vs_transformers.py --model $shape --mixed --json "$OUT/vs_transformers_mixed.json" \
        > "$OUT/vs_transformers_mixed.txt" 2>&1  # the 256 mixed-length requests, truespec only
    tail -2 "$OUT/vs_transformers_mixed.txt"
fi
if has spec; then
    timeout 150 python3 benchmarks/spec_speed.py --json "$OUT/spec_speed.json" > "$OUT/spec_speed.txt" 2>&1
    tail -16 "$OUT/spec_speed.txt"
fi
if has kv; then
    [ -d $shape ] || timeout 60 python3 benchmarks/qwen35_shape.py --out $shape --device cuda
    timeout 400 python3 benchmarks/kv_decode_speed.py --model $shape --json "$OUT/kv_decode_speed.json" \
        > "$OUT/kv_decode_speed.txt" 2>&1
    tail -9 "$OUT/kv_decode_speed.txt"
fi
if has splits_tests; then
    timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_paged_attention_many_splits.py 2>&1 \
        | tail -30 > "$OUT/gpu_tests_splits.log"
    tail -3 "$OUT/gpu_tests_splits.log"
fi
if has splits; then  # the attention kernel per split cap, bf16 vs the packed caches (engine steps at the default)
    [ -d $shape ] || timeout 60 python3 benchmarks/qwen35_shape.py --out $shape --device cuda
    timeout 500 python3 benchmarks/kv_decode_speed.py --model $shape --kv-cache-dtypes auto fp8 turboquant_k8v4 \
        turboquant_4bit_nc turboquant_3bit_nc --max-splits 16 32 64 128 --json "$OUT/kv_splits.json" \
        > "$OUT/kv_splits.txt" 2>&1
    grep -A 24 "by split cap" "$OUT/kv_splits.txt"
fi
if has governor; then
    timeout 500 python3 benchmarks/spec_vs_none.py --methods none "ngram k=8" "mtp k=3 ahead" --governors auto off \
        --json "$OUT/spec_vs_none_governor.json" > "$OUT/spec_vs_none_governor.txt" 2>&1
    tail -8 "$OUT/spec_vs_none_governor.txt"
fi
if has serve; then
    timeout 150 python3 benchmarks/serve_load.py --clients 32 --duration 60 --max-tokens 64 \
        --json "$OUT/serve_load.json" -- --dtype bfloat16 --max-num-seqs 32 > "$OUT/serve_load.txt" 2>&1
    tail -12 "$OUT/serve_load.txt"
fi
if has ttft; then  # issue 17: TTFT of long prompts through the engine, and decode gaps while a 32K prompt arrives
    [ -d $shape ] || timeout 60 python3 benchmarks/qwen35_shape.py --out $shape --device cuda
    timeout 300 python3 benchmarks/prefill_ttft.py --model $shape --repeats 3 --stall 32768 --stall-runs 2 --log-compiles \
        --json "$OUT/prefill_ttft.json" \
        > "$OUT/prefill_ttft.txt" 2>&1
    tail -16 "$OUT/prefill_ttft.txt"
fi
if has prefill; then
    timeout 200 python3 benchmarks/prefill_attention_speed.py --json "$OUT/prefill_attention_speed.json" \
        > "$OUT/prefill_attention_speed.txt" 2>&1
    tail -9 "$OUT/prefill_attention_speed.txt"
fi
if has prefix; then
    [ -d $shape ] || timeout 60 python3 benchmarks/qwen35_shape.py --out $shape --device cuda
    timeout 560 python3 benchmarks/prefix_cache_multiturn.py --model $shape --dtype bfloat16 \
        --json "$OUT/prefix_cache_multiturn.json" > "$OUT/prefix_cache_multiturn.txt" 2>&1
    tail -9 "$OUT/prefix_cache_multiturn.txt"
fi
