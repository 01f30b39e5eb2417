"""`minillm bench structured`: what constrained decoding costs on the real vocabulary.

1. Index build: regex -> DFA, then DFA x vocabulary -> token index, for realistic JSON Schemas and regexes (cold:
   no cache), plus the one-off byte trie of the tokenizer.
2. Mask cost per step: masking one row (and a batch of 8) with a cached per-state mask, and building a state's
   mask the first time, against a measured batch-1 decode step.
3. End to end: output tokens/s and time per output token (after the first), constrained vs unconstrained, the
   same prompts at batch 1 and batch 8 (the index built before timing: a server caches it across requests).
"""
from __future__ import annotations

import json
import random
import statistics
import time

import jsonschema
import torch

from minillm.engine.llm_engine import LLMEngine
from minillm.engine.prompt import build_prompt_ids
from minillm.sampling.params import SamplingParams
from minillm.structured.automata import compile_regex
from minillm.structured.matcher import StructuredOutputManager
from minillm.structured.params import StructuredOutputsParams
from minillm.structured.token_index import VocabTrie, build_token_index, prune_unspellable

USER = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"type": "string"}}, "active": {"type": "boolean"}},
    "required": ["name", "age", "email"]}
# the same with every length bounded: a DFA counts, so each bounded position is its own set of states
BOUNDED = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "email": {"type": "string", "pattern": "[a-z0-9._]{1,20}@[a-z0-9-]{1,15}\\.(com|org|net)"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    "active": {"type": "boolean"}}, "required": ["name", "age", "email"]}
ORDER = {"type": "object", "properties": {
    "id": {"type": "string", "format": "uuid"},
    "items": {"type": "array", "minItems": 1, "maxItems": 10, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "[A-Z]{3}-[0-9]{4}"}, "qty": {"type": "integer"}},
        "required": ["sku", "qty"]}},
    "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
    "created": {"type": "string", "format": "date-time"}}, "required": ["id", "items", "status"]}
CASES = {
    "json: user (5 fields)": StructuredOutputsParams(json=USER),
    "json: user, bounded lengths": StructuredOutputsParams(json=BOUNDED),
    "json: order (nested array)": StructuredOutputsParams(json=ORDER),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex: phone": StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}"),
    "regex: email": StructuredOutputsParams(regex=r"[a-z0-9._]{1,30}@[a-z0-9-]{1,20}(\.[a-z]{2,6}){1,2}"),
    "choice: 4 labels": StructuredOutputsParams(choice=["positive", "negative", "neutral", "mixed"]),
}
PROMPTS = ["Invent a user profile for a music app as JSON.", "Make up a customer of a bookshop, as JSON.",
           "Describe a fictional person as a JSON object.", "Create a JSON record for a new employee.",
           "Give me a JSON user for a test database.", "JSON for a gamer profile, please.",
           "Invent a JSON user who likes hiking.", "Make a JSON profile of a chef."]


def build_times(tokenizer) -> dict:
    t = time.perf_counter()
    trie = VocabTrie.build(tokenizer.token_bytes())
    out = {"vocab_size": tokenizer.vocab_size, "trie_s": round(time.perf_counter() - t, 3), "patterns": {}}
    eos = sorted(tokenizer.stop_token_ids)
    for name, so in CASES.items():
        pattern = so.to_regex()
        t0 = time.perf_counter()
        dfa = compile_regex(pattern)
        t1 = time.perf_counter()
        index = prune_unspellable(build_token_index(dfa, trie, eos), pattern)
        t2 = time.perf_counter()
        out["patterns"][name] = {
            "regex_chars": len(pattern), "dfa_states": dfa.num_states, "compile_s": round(t1 - t0, 3),
            "index_s": round(t2 - t1, 3), "total_s": round(t2 - t0, 3),
            "mean_allowed_tokens": round(statistics.mean(len(a) for a in index.allowed), 1), "index": index}
    return out


def mask_costs(index, vocab: int, rng: random.Random, rows: int = 8, reps: int = 200) -> dict:
    """Per-row masking cost over states met on a random walk through the index."""
    states, s = [], index.dfa.start
    for _ in range(64):
        states.append(s)
        if len(index.allowed[s]) == 0:
            s = index.dfa.start
            continue
        s = int(index.next_states[s][rng.randrange(len(index.allowed[s]))])
    t = time.perf_counter()
    for st in set(states):
        index.mask(st, vocab)
    cold = (time.perf_counter() - t) / len(set(states))
    apply = StructuredOutputManager.apply_masks
    logits = torch.randn(rows, vocab)
    timings = {}
    for n in (1, rows):
        items = [(index, states[i % len(states)]) for i in range(n)]
        apply(logits, list(range(n)), items)
        t = time.perf_counter()
        for _ in range(reps):
            apply(logits, list(range(n)), items)
        timings[n] = (time.perf_counter() - t) / reps
    return {"cold_mask_ms": round(1e3 * cold, 3), "mask_batch1_ms": round(1e3 * timings[1], 3),
            f"mask_batch{rows}_ms": round(1e3 * timings[rows], 3)}


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    done, t0 = [], time.perf_counter()
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    wall = time.perf_counter() - t0
    toks = sum(len(o.outputs[0].token_ids) for o in done)
    tpots = [o.metrics.tpot for o in done if o.metrics.tpot is not None]
    return {"tok_s": toks / wall, "tpot_ms": 1e3 * statistics.mean(tpots) if tpots else float("nan"), "tokens": toks,
            "wall": wall,
            "outputs": done}


def _runs(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], bs: int) -> dict:
    """bs > 1: all prompts in one batch; bs = 1: one after the other. Outputs in prompt order."""
    runs = [_run(engine, prompts, params)] if bs > 1 else [_run(engine, [p], [sp]) for p, sp in zip(prompts, params)]
    outputs = sorted((o for x in runs for o in x["outputs"]), key=lambda o: int(o.request_id))
    return {"tok_s": sum(x["tokens"] for x in runs) / sum(x["wall"] for x in runs),
            "tpot_ms": statistics.mean(x["tpot_ms"] for x in runs), "outputs": outputs}


def end_to_end(loaded, config, batch_sizes=(1, 8), max_tokens: int = 64, repeat: int = 1,
               progress=None) -> tuple[dict, dict]:
    """Constrained vs unconstrained tok/s per batch size, and every run's tok/s (for the repeats' spread)."""
    tok = loaded.tokenizer
    engine = LLMEngine(loaded.model, tok, config)
    so = CASES["json: user, bounded lengths"]     # bounded: greedy decoding of a small model cannot loop forever
    prompts = [build_prompt_ids(tok, p) for p in PROMPTS]
    _run(engine, prompts[:1], [SamplingParams(max_tokens=2, structured_outputs=so)])   # build the index, warm up
    out, repeats = {}, {}
    for bs in batch_sizes:
        best: dict[str, dict] = {}
        batch = [prompts[i % len(prompts)] for i in range(bs)] if bs > 1 else prompts[:3]
        for r in range(repeat):
            # constrained first; then the same prompts unconstrained with each request's constrained output length
            # (EOS ignored), so both runs do the same work and batch the same way
            if progress:
                progress(f"end to end: batch {bs}, run {r + 1}/{repeat}")
            cp = [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so) for _ in batch]
            c = _runs(engine, batch, cp, bs)
            lengths = [len(o.outputs[0].token_ids) for o in c["outputs"]]
            up = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
            u = _runs(engine, batch, up, bs)
            for mode, res in (("constrained", c), ("unconstrained", u)):
                repeats.setdefault(f"batch {bs} {mode} tok/s", []).append(round(res["tok_s"], 2))
                if mode not in best or res["tok_s"] > best[mode]["tok_s"]:
                    best[mode] = res
        c, u = best["constrained"], best["unconstrained"]
        valid = 0
        for o in c["outputs"]:
            if o.outputs[0].finish_reason == "stop":      # complete: it must parse and validate
                jsonschema.validate(json.loads(o.outputs[0].text), BOUNDED)
                valid += 1
        out[f"batch{bs}"] = {
            "unconstrained_tok_s": round(u["tok_s"], 2), "constrained_tok_s": round(c["tok_s"], 2),
            "ratio": round(c["tok_s"] / u["tok_s"], 3),
            "unconstrained_tpot_ms": round(u["tpot_ms"], 2), "constrained_tpot_ms": round(c["tpot_ms"], 2),
            "complete_and_valid": f"{valid}/{len(c['outputs'])}",
            "example": c["outputs"][0].outputs[0].text}
    return out, repeats


def structured_bench(loaded, config, batch_sizes=(1, 8), max_tokens: int = 64, repeat: int = 1,
                     progress=None) -> dict:
    if progress:
        progress("index build times")
    builds = build_times(loaded.tokenizer)
    rng = random.Random(0)
    V = loaded.model.cfg.vocab_size
    for name, b in builds["patterns"].items():
        b.update(mask_costs(b.pop("index"), V, rng))
    e2e, repeats = end_to_end(loaded, config, batch_sizes, max_tokens, repeat, progress)
    step_ms = e2e["batch1"]["unconstrained_tpot_ms"] if "batch1" in e2e else None
    if step_ms:
        for b in builds["patterns"].values():
            b["mask_share_of_decode_step"] = round(b["mask_batch1_ms"] / step_ms, 4)
    return {"model": loaded.path.name, "threads": torch.get_num_threads(), "build": builds, "end_to_end": e2e,
            "decode_step_ms": step_ms, "max_tokens": max_tokens, "repeats": repeats}


def format_structured(r: dict) -> str:
    b = r["build"]
    lines = [f"{r['model']}, {r['threads']} threads; vocabulary {b['vocab_size']} tokens, byte trie built in "
             f"{b['trie_s']:.2f} s (once per tokenizer)", "",
             f"{'pattern':28s} {'states':>6s} {'compile s':>9s} {'index s':>8s} {'allowed':>8s} "
             f"{'mask ms':>8s} {'cold ms':>8s} {'x8 ms':>7s} {'% step':>7s}"]
    for name, p in b["patterns"].items():
        share = p.get("mask_share_of_decode_step")
        lines.append(f"{name:28s} {p['dfa_states']:6d} {p['compile_s']:9.3f} {p['index_s']:8.3f} "
                     f"{p['mean_allowed_tokens']:8.0f} {p['mask_batch1_ms']:8.3f} {p['cold_mask_ms']:8.3f} "
                     f"{p['mask_batch8_ms']:7.3f} {'' if share is None else f'{100 * share:6.2f}%':>7s}")
    lines += ["", "mask ms: one row with its state's cached mask; cold: building a state's mask the first time; "
                  "% step: one row's mask vs a batch-1 decode step"
                  + (f" ({r['decode_step_ms']:.1f} ms)" if r["decode_step_ms"] else ""), ""]
    for bs, e in r["end_to_end"].items():
        lines.append(f"end to end, {bs}: unconstrained {e['unconstrained_tok_s']:.1f} tok/s "
                     f"(TPOT {e['unconstrained_tpot_ms']:.1f} ms), constrained (bounded user schema) "
                     f"{e['constrained_tok_s']:.1f} tok/s (TPOT {e['constrained_tpot_ms']:.1f} ms): "
                     f"{e['ratio']:.2f}x; complete (all valid) {e['complete_and_valid']}")
    first = next(iter(r["end_to_end"].values()), None)
    if first:
        lines.append(f"example: {first['example']}")
    return "\n".join(lines)
