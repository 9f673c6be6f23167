#!/usr/bin/env bash
# GPU check for one H200 (torch >= 2.11, NCCL), under 8 minutes:
#   1. titan-run --self-test on 1 GPU (NCCL process groups on every mesh axis, shard shapes)
#   2. a short bf16 training run of a ~0.5B Llama-style model (FSDP2 mixed precision on one
#      rank, per-block torch.compile), printing tokens/s, MFU and peak memory;
#      if the compiled run fails, the same run without compile.
# Usage: scripts/gpu_check.sh [steps]        (exit code 0 when both parts pass)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STEPS="${1:-30}"
TMP="$(mktemp -d /tmp/titan-gpu-check.XXXXXX)"
rc=0

python - <<'EOF' || exit 1
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
assert torch.cuda.is_available(), "no GPU visible"
EOF

echo "== 1. self-test (1 GPU, NCCL)"
timeout 180 python -m executor.cli --self-test --nproc-per-node 1 || { echo "SELF-TEST FAILED"; rc=1; }

# ~0.5B parameters: 16 layers, dim 1536, GQA 12/4 heads of 128, SwiGLU 4096, vocab 32768
cat > "$TMP/model.yaml" <<'EOF'
name: llama-0.5b-check
dim: 1536
n_layers: 16
n_heads: 12
n_kv_heads: 4
ffn_hidden: 4096
vocab_size: 32768
rope_theta: 500000.0
max_seq_len: 4096
source: "scripts/gpu_check.sh"
EOF

write_plan() {   # $1 = compile true/false
cat > "$TMP/plan.yaml" <<EOF
model: $TMP/model.yaml
hardware: h200
workload: {seq_len: 2048, global_batch: 16, dtype: bf16}
plan: {dp_shard: 1, microbatch: 8, n_microbatches: 2, ac: none, compile: $1}
train: {steps: $STEPS, lr: 3.0e-4, warmup: 5, log_every: 5, dtype: bf16, tensorboard: false,
        max_corpus_bytes: 64000000}
EOF
}

summary() {
python - "$1" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1] + "/summary.json"))
gib = 2 ** 30
print(f"RESULT {s['model']} seq {s['seq_len']} batch {s['global_batch']} {s['dtype']} on {s['hardware']}: "
      f"{s['tokens_per_s']:,.0f} tokens/s, MFU {100 * (s['mfu'] or 0):.1f}%, "
      f"peak memory {s['peak_memory_bytes'] / gib:.1f} GiB, step {1000 * s['step_time_s']:.0f} ms, "
      f"loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}")
EOF
}

echo "== 2. bf16 training run, compile on ($STEPS steps)"
write_plan true
if timeout 330 python -m executor.cli --plan "$TMP/plan.yaml" --nproc-per-node 1 --run-dir "$TMP/run_compile"; then
    summary "$TMP/run_compile" || rc=1
else
    echo "compiled run FAILED; retrying without compile"
    write_plan false
    if timeout 150 python -m executor.cli --plan "$TMP/plan.yaml" --nproc-per-node 1 --run-dir "$TMP/run_eager"; then
        summary "$TMP/run_eager" || rc=1
    else
        echo "eager run FAILED"; rc=1
    fi
    rc=1
fi
echo "gpu_check: $([ $rc -eq 0 ] && echo PASS || echo FAIL)  (runs in $TMP)"
exit $rc
