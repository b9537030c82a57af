#!/usr/bin/env bash
# Short CUDA check of the trainer (run on a GPU machine with torch + transformers installed):
# the demo on the GPU, then a few tiny-MoE steps per routing-replay mode and a bf16 run.
set -uo pipefail
export PYTHONPATH="$PWD" HF_HUB_OFFLINE=1
OUT="${OUT:-/tmp/gpu_check}"; mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
python3 -m gspo demo --output-dir /tmp/gpu_demo 2>&1 | grep -v "━" | tail -12
for mode in none old_policy rollout; do
  python3 -m gspo train model=tiny-moe task=add3 max_steps=3 per_device_batch_size=4 num_generations=4 \
    max_completion_length=16 eval_num_prompts=8 routing_replay=$mode device=cuda progress=false \
    learning_rate=1e-3 output_dir=/tmp/gpu_moe_$mode > /tmp/gpu_moe_$mode.log 2>&1
  echo "moe $mode rc=$?"; tail -n 1 /tmp/gpu_moe_$mode/metrics.jsonl | cut -c1-400
done
python3 -m gspo train model=tiny-dense dtype=bfloat16 task=add3 max_steps=2 per_device_batch_size=4 num_generations=4 \
  max_completion_length=16 eval_num_prompts=8 device=cuda progress=false output_dir=/tmp/gpu_bf16 > /tmp/gpu_bf16.log 2>&1
echo "bf16 rc=$?"; tail -n 3 /tmp/gpu_bf16.log
cp /tmp/gpu_moe_*.log /tmp/gpu_bf16.log "$OUT"/ 2>/dev/null || true
# padding-free forwards (issue 20): a few steps per layout, then flash attention's varlen path if installed
for pf in true false; do
  python3 -m gspo bench model=tiny-dense task=add3 device=cuda padding_free=$pf max_completion_length=256 --steps 3 \
    > "$OUT/bench_padding_free_$pf.log" 2>&1
  echo "bench padding_free=$pf rc=$?"; tail -n 8 "$OUT/bench_padding_free_$pf.log"
done
if python3 -c "import flash_attn" >/dev/null 2>&1; then
  python3 -m gspo bench model=tiny-dense task=add3 device=cuda dtype=bfloat16 attn_implementation=flash_attention_2 \
    max_completion_length=256 --steps 3 > "$OUT/bench_flash.log" 2>&1
  echo "bench flash_attention_2 rc=$?"; tail -n 8 "$OUT/bench_flash.log"
else
  echo "flash attention: flash_attn is not installed in this Python; skipped"
fi
# vLLM colocated with the trainer (issue 16): a ~0.44B model from config in bf16; generation and step
# throughput, push time, peak memory, MFU. Needs vllm in this Python (pip install vllm); skipped without it.
if python3 -c "import vllm" >/dev/null 2>&1; then
  VLLM_ENABLE_V1_MULTIPROCESSING=0 python3 benchmarks/vllm_colocate.py --out "$OUT/vllm_colocate.json" \
    > "$OUT/vllm_colocate.log" 2>&1
  echo "vllm colocate rc=$?"; tail -n 3 "$OUT/vllm_colocate.log"
else
  echo "vllm colocate: vllm is not installed in this Python; skipped"
fi
# Asynchronous rollouts (issue 34): the synchronous loop against one rollout worker one step ahead, the worker
# on the same GPU as the trainer (weights through the CPU over gloo): the demo model, then the 50M model at
# T = 512 with long-tailed lengths; then, where vllm is installed, 1 trainer + 1 vLLM worker on the GPU.
python3 benchmarks/async_rollouts.py --device cuda --reps 2 --steps 20 --eval-prompts 100 \
  --work-dir /tmp/gpu_async_demo --out "$OUT/async_demo.json" > "$OUT/async_demo.log" 2>&1
echo "async demo rc=$?"; tail -n 14 "$OUT/async_demo.log"
python3 benchmarks/async_rollouts.py --device cuda --model 50m --T 512 --B 4 --G 4 --M 2 --steps 8 --reps 2 \
  --eval-prompts 1 --eval-k 1 --work-dir /tmp/gpu_async_50m --out "$OUT/async_50m.json" > "$OUT/async_50m.log" 2>&1
echo "async 50m rc=$?"; tail -n 12 "$OUT/async_50m.log"
if python3 -c "import vllm" >/dev/null 2>&1; then
  python3 benchmarks/async_rollouts.py --device cuda --backend vllm --model 50m --T 512 --B 4 --G 4 --M 2 --steps 8 \
    --reps 2 --eval-prompts 1 --eval-k 1 --work-dir /tmp/gpu_async_vllm --out "$OUT/async_vllm.json" > "$OUT/async_vllm.log" 2>&1
  echo "async vllm rc=$?"; tail -n 12 "$OUT/async_vllm.log"
else
  echo "async vllm: vllm is not installed in this Python; skipped"
fi
# Issue 51: the trainer and one `vllm serve` on the same GPU, weights by gspo's backend (the wire, through the CPU),
# a Qwen3-0.6B-shaped model from config, 10 steps: tokens/s, seconds per sync, MFU; where two GPUs are, the same
# with vLLM's NCCL backend (the server on the second GPU). Alone, in well under 10 minutes each:
# python3 benchmarks/vllm_serve_check.py [--transfer nccl] --out /tmp/x.json
if python3 -c "import vllm" >/dev/null 2>&1; then
  timeout 600 python3 benchmarks/vllm_serve_check.py --out "$OUT/vllm_serve_check.json" > "$OUT/vllm_serve_check.log" 2>&1
  echo "vllm serve check rc=$?"; tail -n 3 "$OUT/vllm_serve_check.log"
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    timeout 600 python3 benchmarks/vllm_serve_check.py --transfer nccl --out "$OUT/vllm_serve_check_nccl.json" \
      > "$OUT/vllm_serve_check_nccl.log" 2>&1
    echo "vllm serve check (nccl) rc=$?"; tail -n 3 "$OUT/vllm_serve_check_nccl.log"
  else
    echo "vllm serve check (nccl): one GPU (NCCL puts one rank on one GPU); skipped"
  fi
else
  echo "vllm serve check: vllm is not installed in this Python; skipped"
fi
