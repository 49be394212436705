"""Structured output's cost: tokens/s and accepted length of JSON-schema-constrained decoding against the same
requests unconstrained, at several loads, and the host time spent on grammar masks.

    python -m profiling.bench_grammar [--quick] [--json out.json] [--policies none,dspark] [--users 1,16]

For each policy and load (``--users`` requests at once, each asking for JSON; the engine has that many slots), the
same prompts run unconstrained and with a JSON schema each (`grammar.Grammar.json_schema`, four schemas in turn:
nested objects, arrays, enums, integers), greedy, up to ``--max-tokens`` tokens. A first pass compiles; the timed
pass reports the engine's steady rounds: tokens/s, accepted length (tokens per request-round, bonus included),
the mean round time and requests per round (constrained answers end with their grammar, so their runs hold
fewer requests a round towards the end: tokens/s alone mixes that in), drafts the grammar forbade, and the
masks' host time per round (the first masks of a drafting round are computed
while the draft program runs; the rest lies on the round's path).
"""

from __future__ import annotations

import argparse
import datetime

import numpy as np

from dspark_jax.build import add_model_arguments, build_engine, load_target
from dspark_jax.cli import parse_with_quick, positive_int, writable_file
from dspark_jax.engine import SamplingParams
from dspark_jax.gate import GateConfig
from dspark_jax.grammar import Grammar, grammar_tokenizer
from dspark_jax.timing import device_info, format_table, write_json

SCHEMAS = [
    ("Invent a person and their home address. Answer in JSON.",
     {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "address": {
         "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                          "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
         "required": ["city", "zip"], "additionalProperties": False}},
      "required": ["name", "address"], "additionalProperties": False}),
    ("List four fruits and their colours in JSON.",
     {"type": "object", "properties": {"fruits": {"type": "array", "maxItems": 4, "items": {
         "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                          "colour": {"type": "string", "maxLength": 16}},
         "required": ["name", "colour"], "additionalProperties": False}}},
      "required": ["fruits"], "additionalProperties": False}),
    ("Review: 'The film was wonderful, but too long.' Give the sentiment and a star rating in JSON.",
     {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "mixed"]},
                                       "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                       "summary": {"type": "string", "maxLength": 60}},
      "required": ["sentiment", "stars", "summary"], "additionalProperties": False}),
    ("Add 12 and 30 and say whether the sum is even. Answer in JSON.",
     {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 1000},
                                       "b": {"type": "integer", "minimum": 0, "maximum": 1000},
                                       "sum": {"type": "integer", "minimum": 0, "maximum": 2000},
                                       "even": {"type": "boolean"}},
      "required": ["a", "b", "sum", "even"], "additionalProperties": False}),
]


def run(engine, prompts, grammars, max_tokens: int) -> dict[str, float]:
    """Run the requests to the end; the engine's steady-round summary with the grammar counters."""
    engine.rounds.clear()
    ids = [engine.submit(p, max_tokens, SamplingParams(temperature=0.0, grammar=g)) for p, g in zip(prompts, grammars)]
    while not engine.idle():
        engine.step()
    s = engine.summary()
    steady = [r for r in engine.rounds if not r.compiled]
    mask = np.array([r.mask_seconds for r in steady]) if steady else np.zeros(1)
    secs = np.array([r.seconds for r in steady]) if steady else np.ones(1)
    lengths = [len(engine.requests[i].output_ids) for i in ids]
    for i in ids:
        engine.requests.pop(i, None)
    return {"tokens_per_s": s["tokens_per_s"], "accept_len": s["accept_len"], "rounds": len(steady),
            "mean_answer_tokens": float(np.mean(lengths)),
            "forbidden_drafts_per_round": float(np.mean([r.forbidden_drafts for r in steady])) if steady else 0.0,
            "mask_ms_per_round": 1e3 * float(mask.mean()), "mask_share": float(mask.sum() / secs.sum()),
            "round_ms": 1e3 * float(secs.mean()),
            "active_per_round": float(np.mean([r.active for r in steady])) if steady else 0.0}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--quick", action="store_true", help="one user, 16 tokens, the dspark policy only")
    p.add_argument("--json", type=writable_file, help="write the rows here (checked before the benchmark)")
    p.add_argument("--policies", default="none,dspark", help="comma-separated engine policies")
    p.add_argument("--users", default="1,16", help="comma-separated loads (requests at once)")
    p.add_argument("--max-tokens", type=positive_int, default=96, help="answer budget per request")
    args = parse_with_quick(p, argv, users="1", max_tokens=16, policies="dspark")

    target = load_target(args.model, dtype=args.dtype)
    tok = target.tokenizer
    gtok = grammar_tokenizer(tok, target.cfg.vocab_size)
    users = [int(u) for u in args.users.split(",")]
    rows = []
    for policy in args.policies.split(","):
        for n in users:
            # the round-time correction off: the timed pass takes the first pass's decisions (and programs)
            engine = build_engine(target, policy, draft=args.draft, num_slots=n, max_prompt_tokens=96,
                                  max_new_tokens=args.max_tokens, gate=GateConfig(calibrate_times=False))
            picks = [SCHEMAS[i % len(SCHEMAS)] for i in range(n)]
            prompts = [tok.encode_chat([q]) for q, _ in picks]
            grammars = [Grammar.json_schema(schema, gtok) for _, schema in picks]
            for constrained in (False, True):
                gs = grammars if constrained else [None] * n
                run(engine, prompts, gs, args.max_tokens)  # compiles
                result = run(engine, prompts, gs, args.max_tokens)
                row = {"policy": policy, "users": n, "constrained": constrained, **result}
                rows.append(row)
                print(row, flush=True)
    for row in rows:  # constrained over unconstrained, same policy and load, measured in this run
        base = next(r for r in rows if r["policy"] == row["policy"] and r["users"] == row["users"]
                    and not r["constrained"])
        row["speed_ratio"] = row["tokens_per_s"] / base["tokens_per_s"]
    print(format_table(rows, ["policy", "users", "constrained", "tokens_per_s", "speed_ratio", "accept_len",
                              "mean_answer_tokens", "round_ms", "active_per_round", "forbidden_drafts_per_round",
                              "mask_ms_per_round", "mask_share"]))
    if args.json:
        write_json(args.json, {"device": device_info(), "date": datetime.datetime.now().isoformat(timespec="minutes"),
                               "args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows})


if __name__ == "__main__":
    main()
