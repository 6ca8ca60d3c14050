#!/usr/bin/env bash
# The EPLB loop on one machine: run a batch, dump tokens per expert, replan, rerun on the plan, replan again
# from the previous plan (so only the experts that must move do).
#
#   bash examples/eplb_replan.sh                  # medium Qwen3-MoE (examples/make_medium_qwen3_moe.py)
#   MODEL=DIR NUM_GPUS=8 NUM_REPLICAS=40 bash examples/eplb_replan.sh
#
# NUM_GPUS / NUM_NODES describe the expert-parallel layout the plan is for; NUM_REPLICAS is the number of
# physical expert slots per layer (a multiple of NUM_GPUS, at least the model's expert count).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-$($PY examples/make_medium_qwen3_moe.py)}
WORK=${WORK:-$(mktemp -d /tmp/eplb_replan.XXXXXX)}
NUM_GPUS=${NUM_GPUS:-4}
NUM_NODES=${NUM_NODES:-1}
NUM_GROUPS=${NUM_GROUPS:-1}
NUM_REPLICAS=${NUM_REPLICAS:-40}
BATCH=${BATCH:-32}
echo "model $MODEL, work dir $WORK"

# run a batch and dump the load; with a plan, run on it (LLM(..., eplb_plan=PLAN.json))
run_batch() {  # $1 = stats out, $2 = plan or ""
    $PY - "$MODEL" "$1" "$2" "$BATCH" <<'PYEOF'
import sys
import torch
from deepinfer import LLM, SamplingParams
model, stats, plan, batch = sys.argv[1], sys.argv[2], sys.argv[3] or None, int(sys.argv[4])
llm = LLM(model, dtype="bfloat16", max_model_len=512, kv_cache_memory=256 << 20, eplb_plan=plan)
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(3, 32000, (64,), generator=g).tolist()} for _ in range(batch)]
llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
load = llm.get_expert_load()                     # [steps, layers, experts] tokens per logical expert
print(f"recorded {int(load.sum())} routed tokens over {load.shape[0]} steps, plan={plan}")
llm.dump_expert_load(stats)
PYEOF
}

run_batch "$WORK/stats0.npz" ""
$PY -m eplb.replan --stats "$WORK/stats0.npz" --num-replicas "$NUM_REPLICAS" --num-nodes "$NUM_NODES" \
    --num-gpus "$NUM_GPUS" --num-groups "$NUM_GROUPS" --out "$WORK/plan1.json"
run_batch "$WORK/stats1.npz" "$WORK/plan1.json"
$PY -m eplb.replan --stats "$WORK/stats1.npz" --num-replicas "$NUM_REPLICAS" --num-nodes "$NUM_NODES" \
    --num-gpus "$NUM_GPUS" --num-groups "$NUM_GROUPS" --prev "$WORK/plan1.json" --out "$WORK/plan2.json"
echo "plans: $WORK/plan1.json $WORK/plan2.json"
