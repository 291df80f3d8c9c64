"""Context-parallel planning (FlashCP) in one process: no process group, every rank's part of the plan.

Run: python docs/examples/plan.py
"""

from flashpar.cp import CostModel, CPPlan, plan
from flashpar.cp.lengths import resolve_lengths

doc_lens = [3000, 120, 45000, 800, 9000, 64, 17000]          # tokens of each document of one packed sequence
p = plan(doc_lens, 8)          # strategy="flashcp", CostModel() = Llama-3-8B layer, H100, 400 Gb/s
for rank in range(p.cp_size):  # every rank computes the same plan (deterministic) and uses its own part
    p.local_indices(rank)      # LongTensor: global token positions this rank holds, in its local order
    p.position_ids(rank)       # position inside the document (RoPE), per local token
    p.doc_ids(rank)            # document index, per local token
    p.kv_recv(rank)            # [(src_rank, start, end), ...] K/V token ranges to receive
s = p.stats()                  # per-rank attn_pairs, tokens, kv_recv_bytes, kv_send_bytes, est_time; compute_imbalance,
                               # attn_imbalance, token_imbalance, total_kv_bytes, kv_worst_frac, est_step_time
assert CPPlan.from_json(p.to_json()) == p

# a real pack: the first 128K tokens of the WLB-LLM length list that ships with flashpar, attention work only
pack = resolve_lengths("wlbllm").packs(131072, 1)[0]
imbalance = plan(pack, 8, cost=CostModel(linear=False)).stats()["compute_imbalance"]
print(f"flashcp on 128K wlbllm tokens over 8 ranks: compute imbalance (max / mean) {imbalance:.3f}")
