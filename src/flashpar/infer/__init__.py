"""Inference with the parallel model: packed multi-prompt prefill (FlashCP + FlashOverlap), a KV cache sharded
as the plan placed the tokens, context-parallel decode, sampling, and ``flashpar generate``.

    prompts.py    reading prompts: .jsonl (text, tokens or chat messages), .txt, or stdin
    tokenizer.py  a tokenizer.json with its end-of-text token and chat template (rendered with jinja2)
    planning.py   the planner's forward-only cost model
    prefill.py    the packed prompts through the parallel model's blocks: last-token logits and the K/V
    cache.py      the sharded KV cache and the schedule of decode appends
    attention.py  decode attention over a rank's cache and the log-sum-exp combine across a prompt's group
    decode.py     one decode step, tensor parallel over heads
    penalties.py  repetition, frequency and presence penalties on the logits
    sampling.py   greedy, temperature, top-k, top-p, min-p from a seed; log-probabilities
    stopping.py   where an output ends (end-of-text, stop tokens, stop strings) and its finish reason
    generate.py   the loop: ``generate(model, prompts, ...)``
"""

from __future__ import annotations

from flashpar.infer.generate import Generation, generate
from flashpar.infer.sampling import Sampling

__all__ = ["Generation", "Sampling", "generate"]
