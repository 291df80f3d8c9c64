"""The report of ``make gpu-check``: ``gpu-check.json`` (everything) and ``gpu-check.md`` (the tables).

JSON: ``{"setup": {...}, "notes": [...], "cuda_default": {...}, "varlen": {...}, "parts": [Outcome.row(), ...]}``
(the verdicts of ``cuda_tests.verdict``).
"""

from __future__ import annotations

import json
from pathlib import Path

NOTES = (
    "One GPU cannot host two NCCL ranks: nothing here measures communication, and every multi-rank figure "
    "(overlap, CP exchange, dp/cp/tp layouts) comes from `flashpar simulate` until a multi-GPU machine is available.",
    "The trainer ran at world size 1: its tokens/s and MFU are one GPU's compute, not a parallel run's.",
)


def write(report: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "gpu-check.json", out / "gpu-check.md"
    js.write_text(json.dumps(report, indent=1, default=str))
    md.write_text(markdown(report))
    return js, md


def _table(head: list[str], rows: list[list]) -> list[str]:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(fmt(v).replace("|", "/") for v in r) + " |" for r in rows), ""]


def markdown(report: dict) -> str:
    s = report["setup"]
    lines = [f"# flashpar gpu-check: {s['device_name']}", "",
             f"{s['started']} UTC; torch {s['torch']} (CUDA {s['cuda']}), Python {s['python']}, flashpar commit "
             f"{s['commit']}; mode: {'tiny (CPU rehearsal)' if s['tiny'] else 'full'}; total {s['wall_s']:.0f} s "
             f"of the parts' {s['limit_s']:.0f} s limits.", ""]
    if s["device"] != "cuda":
        lines += ["**This report was made on the CPU** (a rehearsal of the code paths at tiny sizes): it says "
                  "nothing about a GPU.", ""]
    lines += [f"- {n}" for n in report["notes"]] + [""]
    d = report["cuda_default"]
    said = {True: "PASSED", False: "FAILED: fix `flashpar.cp.sdpa_cuda` (or pass backend='math' meanwhile)",
            None: "not run"}[d["passed"]]
    lines += [f"**CUDA default backend (`flash`: torch's FlashAttention-2 / memory-efficient SDPA kernels) against "
              f"math and float64: {said}** ({d['detail']}).", ""]
    v = report["varlen"]
    said = {True: "PASSED", False: "FAILED", None: "not run"}[v["passed"]]
    lines += [f"**varlen FlashAttention-2 backend (selectable by name) against math: {said}** ({v['detail']}).", ""]
    lines += ["## Parts", ""] + _table(["part", "status", "wall s", "limit s", "error"],
                                       [[p["name"], p["status"], p["wall_s"], p["limit_s"], p["error"]]
                                        for p in report["parts"]])
    for p in report["parts"]:
        lines += SECTIONS.get(p["name"], lambda _: [])(p)
        if p["status"] not in ("passed", "skipped") and p["tail"]:
            lines += [f"<details><summary>{p['name']}: the end of its output</summary>", "", "```",
                      p["tail"][-3000:], "```", "</details>", ""]
    return "\n".join(lines)


def _tests(p: dict) -> list[str]:
    r = p["result"]
    rows = [[t["test"], t["outcome"], t["seconds"], t["message"][:160]] for t in r.get("tests", ())]
    return ["## CUDA-only tests", "", f"Files: {', '.join(r.get('files', ())) or 'none'}.", ""] + \
        (_table(["test", "outcome", "s", "message"], rows) if rows else ["No test report.", ""])


def _attention(p: dict) -> list[str]:
    r = p["result"]
    if "rows" not in r:
        return []
    st = r.get("setup", {})
    out = ["## CP segment attention vs dense FlashAttention", "",
           f"{st.get('heads')} query heads, {st.get('kv_heads')} kv heads, head dim {st.get('head_dim')}, "
           f"{st.get('dtype')}, plans by {st.get('strategy')}; TFLOP/s of useful FLOPs (forward 4, backward 10 "
           f"per mask pair and head dim); dense: SDPA flash, causal, one sequence of about the same pairs; "
           f"predicted: the cost model (preset {st.get('preset')}).", ""]
    rows = []
    for c in r["rows"]:
        if "skipped" in c:
            rows.append([c["case"], "", "", "", "", "", "", c["skipped"]])
            continue
        for b in c["backends"]:
            if b.get("status") == "ran":
                rows.append([c["case"], b["backend"], b["fwd_ms"], b["bwd_ms"], b["fwd_tflops"], b["bwd_tflops"],
                             b.get("fwd_vs_dense"), f"max diff vs math {b['max_abs_diff_vs_math']:.2g}"
                             if "max_abs_diff_vs_math" in b else f"{b['kernel_calls']} kernel calls"])
            else:
                rows.append([c["case"], b["backend"], "", "", "", "", "", f"{b.get('status')}: {b.get('why')}"])
        d = c.get("dense", {})
        if "fwd_tflops" in d:
            rows.append([c["case"], f"dense {d['tokens']} tokens", d["fwd_ms"], d["bwd_ms"], d["fwd_tflops"],
                         d["bwd_tflops"], 1.0, d.get("note", "")])
        elif "error" in d:
            rows.append([c["case"], "dense", "", "", "", "", "", d["error"]])
        rows.append([c["case"], "predicted", "", "", c["predicted_fwd_tflops"], c["predicted_bwd_tflops"], "",
                     f"{c['documents']} documents, longest {c['longest']}, {c['local_tokens']} local + "
                     f"{c['received_tokens']} received tokens"])
    return out + _table(["case", "backend", "fwd ms", "bwd ms", "fwd TFLOP/s", "bwd TFLOP/s", "fwd vs dense", "note"],
                        rows)


def _gemm(p: dict) -> list[str]:
    r = p["result"]
    if "rows" not in r:
        return []
    st = r.get("setup", {})
    out = ["## GEMM split into N row pieces", "",
           f"Per-rank GEMMs of a Llama model (hidden {st.get('hidden')}, FFN {st.get('ffn')}; 8B: 4096, 14336), "
           f"{st.get('tokens')} "
           f"tokens, {st.get('dtype')}; efficiency = one GEMM's time / its N pieces' time (each written into its "
           f"slice of the output); predicted: preset {st.get('preset')}.", ""]
    out += _table(["pieces", "mean efficiency", "worst", "predicted (mean)"],
                  [[b["pieces"], b["mean_efficiency"], b["worst_efficiency"], b["mean_predicted"]]
                   for b in r.get("by_pieces", ())])
    rows = [[x["tp"], x["linear"], f"{x['m']}x{x['k']}x{x['n']}", x["pieces"], x["one_ms"], x["split_ms"],
             x["one_tflops"], x["efficiency"], x["predicted_efficiency"]] for x in r["rows"] if "efficiency" in x]
    return out + _table(["tp", "linear", "m x k x n", "N", "one ms", "N pieces ms", "one TFLOP/s", "efficiency",
                         "predicted"], rows)


def _train(p: dict) -> list[str]:
    r = p["result"]
    out = ["## Trainer at world size 1", ""]
    for name, cmd in r.get("commands", {}).items():
        out.append(f"- {name}: `{cmd}`")
    out.append("")
    c = r.get("check")
    if c:
        out.append(f"--check: {'PASS' if c['passed'] else 'FAIL'} (exit status {c['rc']}); "
                   + ", ".join(f"{x['group']} {x['error']:.2g}" for x in c["rows"]))
        out.append("")
    t = r.get("train")
    if t:
        losses = t.get("losses", [])
        out.append(f"train: {'PASS' if t['passed'] else 'FAIL'} (exit status {t['rc']}): {len(losses)} of "
                   f"{t['steps_wanted']} steps"
                   + (f", loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "")
                   + (f", {t['tokens_per_s']:.0f} tokens/s, MFU "
                      + (f"{t['mfu']:.1%}" if t.get("mfu") is not None else "none (CPU: no vendor peak)")
                      + f", peak memory {t['peak_mem_mb']:.0f} MB" if t.get("tokens_per_s") is not None else ""))
        out.append("")
    return out


SECTIONS = {"tests": _tests, "attention": _attention, "gemm": _gemm, "train": _train}
