#!/usr/bin/env bash
# One device call: train the EAGLE head for the embedded model, run the gpu-marked tests, smoke the engine on
# CUDA. Usage on the GPU machine (with the fla-core wheel carried in .whl/): bash benchmarks/gpu_session.sh
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src:tests
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 330 python3 -m truespec.training.eagle --target src/truespec/assets/stdlib-qwen35 --out "$OUT/eagle" \
    --time-budget-s 150 --report "$OUT/eagle_report.json" 2>&1 | grep -v '^\[transformers\]' | tee "$OUT/eagle_train.log" | tail -5
timeout 150 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
timeout 100 python3 benchmarks/gpu_smoke.py --eagle "$OUT/eagle" 2>&1 | grep -v '^\[transformers\]' | tee "$OUT/gpu_smoke.log"
