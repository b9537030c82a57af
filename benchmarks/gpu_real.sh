#!/usr/bin/env bash
# Issue 52 on one GPU, in under 10 minutes (never in CI): gspo against TRL's GRPOTrainer (GSPO settings), synchronous
# and with one rollout worker one step ahead, on a Qwen3-0.6B-shaped random model (add3's character tokenizer:
# nothing to download) and, where `make demo-real`'s package is installed, SmolLM2-135M-Instruct on the real-model
# demo's task; then `gspo bench` on each: seconds by phase and model FLOP/s against the card's measured bf16
# matmul peak (MFU). Both sides bf16 autocast on float32 weights. Needs torch with CUDA, transformers and TRL
# (pip install '.[bench]'). Results (logs, JSON) under $OUT.
#
#     bash benchmarks/gpu_real.sh
set -uo pipefail
export PYTHONPATH="$PWD" HF_HUB_OFFLINE=1
OUT="${OUT:-/tmp/gpu_real}"; mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'cuda', torch.cuda.is_available())"
if ! python3 -c "import trl" >/dev/null 2>&1; then
  echo "TRL is not installed in this Python (pip install '.[bench]'): the comparison is skipped"
else
  timeout 240 python3 benchmarks/vs_trl.py --device cuda --model qwen3-0.6b --async 1 --steps 6 --reps 1 \
    --work-dir /tmp/gpu_real_qwen --out "$OUT/vs_trl_qwen3_06b.json" > "$OUT/vs_trl_qwen3_06b.log" 2>&1
  echo "vs_trl qwen3-0.6b rc=$?"; tail -n 12 "$OUT/vs_trl_qwen3_06b.log"
  if python3 -c "from gspo.models import packaged_gguf; packaged_gguf('smollm2')" >/dev/null 2>&1; then
    timeout 180 python3 benchmarks/vs_trl.py --device cuda --model smollm2 --async 1 --steps 6 --reps 1 --T 128 \
      --eval-prompts 20 --work-dir /tmp/gpu_real_smollm2 --out "$OUT/vs_trl_smollm2.json" > "$OUT/vs_trl_smollm2.log" 2>&1
    echo "vs_trl smollm2 rc=$?"; tail -n 12 "$OUT/vs_trl_smollm2.log"
  else
    echo "vs_trl smollm2: the packaged model is not installed here (make demo-real); skipped"
  fi
fi
# MFU: gspo bench on the same models and batch (8 prompts x 4, T 128), bf16 autocast
cat > "$OUT/qwen3_06b.yaml" <<'YAML'
model: tiny-dense
model_overrides: {num_hidden_layers: 28, hidden_size: 1024, intermediate_size: 3072, num_attention_heads: 16,
                  num_key_value_heads: 8, head_dim: 128}
task: add3
YAML
timeout 120 python3 -m gspo bench --config "$OUT/qwen3_06b.yaml" device=cuda bf16=true per_device_batch_size=8 \
  num_generations=4 num_minibatches=4 max_completion_length=128 --steps 3 --out "$OUT/bench_qwen3_06b.json" \
  > "$OUT/bench_qwen3_06b.log" 2>&1
echo "bench qwen3-0.6b rc=$?"; tail -n 9 "$OUT/bench_qwen3_06b.log"
if python3 -c "from gspo.models import packaged_gguf; packaged_gguf('smollm2')" >/dev/null 2>&1; then
  timeout 120 python3 -m gspo bench --config configs/own_task_smollm2.yaml device=cuda bf16=true \
    per_device_batch_size=8 num_generations=4 num_minibatches=4 max_completion_length=128 --steps 3 \
    --out "$OUT/bench_smollm2.json" > "$OUT/bench_smollm2.log" 2>&1
  echo "bench smollm2 rc=$?"; tail -n 9 "$OUT/bench_smollm2.log"
fi
