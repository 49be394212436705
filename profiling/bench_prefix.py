"""Multi-turn chat with prefix caching on and off: time to first token, acceptance and throughput.

    python -m profiling.bench_prefix [--quick] [--json out.json] [--conversations 4 16] [--policy dspark]

``--conversations`` chats run at once, each of ``--turns`` user messages (prompts of the dev set, else the
shipped ones), all sharing a system prompt of a few hundred tokens; every turn resends the whole conversation
(system prompt, earlier questions and answers) through the chat template, as a chat client does, and the next
turn is sent as soon as the answer is complete. The same workload runs on two engines in this process, prefix
caching on and off (greedy, so the answers must be equal token for token: checked), each first once untimed
(compiles) and then timed. Per engine: the median time to first token of the turns after the first (the turns
that can find their history in the cache), the mean accepted length per request-round, the tokens emitted per
second over the whole run. Ratios on/off: TTFT, accepted length (pooled over requests, with a paired bootstrap
interval), throughput.
"""

from __future__ import annotations

import argparse
import datetime
import time

import numpy as np

from dspark_jax.build import add_model_arguments, build_engine, load_drafter_for, load_target
from dspark_jax.cli import parse_with_quick, positive_int, writable_file
from dspark_jax.data import load_prompts
from dspark_jax.engine import Engine, SamplingParams
from dspark_jax.gate import GateConfig
from dspark_jax.serving import pooled_ratio, shipped_prompts_dir
from dspark_jax.timing import device_info, format_table, write_json

SYSTEM = (
    "You are a careful, friendly assistant for a team of engineers who build and serve language models. "
    "Answer the question you are asked directly, then explain your reasoning in short steps. When the question "
    "is about mathematics, show the computation line by line and state the final number clearly at the end. "
    "When the question is about code, give a complete function in the language asked for, with a short "
    "docstring, and mention its time and memory cost. When the question is open, give two or three concrete "
    "points rather than a long essay, and say what you are unsure about. Never invent references, libraries or "
    "numbers; if you do not know something, say so and suggest how the user could find out. Keep a neutral "
    "tone, avoid filler phrases, and do not repeat the question back. Use plain text, with lists only where "
    "they help. If the user writes in another language, answer in that language. If a request is unsafe or "
    "asks for private data, decline briefly and offer a safer alternative. Remember earlier turns of the "
    "conversation and stay consistent with what you said before, correcting yourself explicitly when you were "
    "wrong. Prefer the simplest correct answer; mention a more general one only when it matters."
)


def user_messages(source, count: int) -> list[str]:
    """``count`` first turns of the prompt set (cycled), math, code and chat interleaved as in the files."""
    if source is None:
        from pathlib import Path  # noqa: PLC0415

        dev = Path("../shared/data/prompts/dev")
        source = dev if dev.is_dir() else shipped_prompts_dir()
    texts = [p.turns[0] for p in load_prompts([source]) if len(p.turns[0]) < 600]
    if not texts:
        raise ValueError(f"no prompts in {source}")
    rng = np.random.default_rng(0)
    rng.shuffle(texts)
    return [texts[i % len(texts)] for i in range(count)]


def run_chats(engine: Engine, tokenizer, messages: list[list[str]], answer: int) -> dict:
    """Every conversation turn by turn, each turn sent when the previous answer completes. Returns the answers
    (token ids per conversation and turn), per-turn TTFT, per-request accepted lengths and the totals."""
    sampling = SamplingParams(temperature=0.0)
    n, turns = len(messages), len(messages[0])
    history = [[{"role": "system", "content": SYSTEM}] for _ in range(n)]
    answers: list[list[list[int]]] = [[] for _ in range(n)]
    ttft: list[list[float]] = [[] for _ in range(n)]
    sent: dict[int, tuple[int, float]] = {}  # request id -> (conversation, submit time)
    first: dict[int, float] = {}

    def on_token(rid: int, token: int) -> None:
        first.setdefault(rid, time.perf_counter())

    def send(i: int) -> None:
        history[i].append({"role": "user", "content": messages[i][len(answers[i])]})
        rid = engine.submit(tokenizer.encode_chat(history[i]), answer, sampling)
        sent[rid] = (i, time.perf_counter())

    engine.on_token = on_token
    rounds_before = len(engine.rounds)
    t0 = time.perf_counter()
    for i in range(n):
        send(i)
    emitted = 0
    while sent:
        engine.step()
        done = set(engine.finished_ids)
        for rid in [r for r in sent if r in done]:
            i, t_sent = sent.pop(rid)
            out = engine.requests[rid].output_ids
            emitted += len(out)
            answers[i].append(out)
            ttft[i].append(first[rid] - t_sent)
            history[i].append({"role": "assistant", "content": tokenizer.decode(out)})
            if len(answers[i]) < turns:
                send(i)
    seconds = time.perf_counter() - t0
    engine.on_token = None
    acc: dict[int, list[float]] = {}
    for r in engine.rounds[rounds_before:]:
        for rid, a in zip(r.requests, r.accepted):
            acc.setdefault(int(rid), []).append(float(a) + 1)
    order = sorted(acc)  # requests in submission order: the same conversations and turns in both runs
    return {"answers": answers, "ttft": ttft, "seconds": seconds, "emitted": emitted,
            "accepted_sum": [sum(acc[r]) for r in order], "request_rounds": [len(acc[r]) for r in order],
            "prefix": engine.prefix_cache_stats()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--quick", action="store_true", help="2 conversations of 2 turns, 24-token answers")
    p.add_argument("--json", type=writable_file, help="write the rows here (checked before the benchmark)")
    p.add_argument("--policy", default="dspark")
    p.add_argument("--conversations", type=positive_int, nargs="+", default=[4, 16])
    p.add_argument("--turns", type=positive_int, default=4)
    p.add_argument("--answer", type=positive_int, default=64, help="tokens per answer (at most; EOS ends earlier)")
    p.add_argument("--prompts", help="folder of JSONL prompts (default: ../shared/data/prompts/dev or shipped)")
    args = parse_with_quick(p, argv, conversations=[2], turns=2, answer=24)

    target = load_target(args.model, dtype=args.dtype)
    tok = target.tokenizer
    drafter = load_drafter_for(target, args.draft) if args.policy != "none" else None
    rows = []
    for n in args.conversations:
        messages = user_messages(args.prompts, n * args.turns)
        messages = [messages[i * args.turns:(i + 1) * args.turns] for i in range(n)]
        longest = max(len(tok.encode_chat([{"role": "system", "content": SYSTEM}]
                                          + [{"role": "user", "content": m} for m in conv])) for conv in messages)
        prompt_cap = longest + args.turns * (args.answer + 16)
        results = {}
        for caching in (True, False):
            # the round-time correction off: both engines take the same decisions for the same rounds
            engine = build_engine(target, args.policy, draft=drafter, num_slots=n, max_prompt_tokens=prompt_cap,
                                  max_new_tokens=args.answer, enable_prefix_caching=caching,
                                  gate=GateConfig(calibrate_times=False))
            run_chats(engine, tok, messages, args.answer)  # compiles
            engine.prefix_counts.update(prompt_tokens=0, cached_tokens=0)
            if engine.prefix_store is not None:
                engine.prefix_store.clear()
            results[caching] = run_chats(engine, tok, messages, args.answer)
            print(f"{n} conversations, caching {'on' if caching else 'off'}: {results[caching]['seconds']:.1f} s, "
                  f"prefix {results[caching]['prefix']}", flush=True)
        on, off = results[True], results[False]
        identical = on["answers"] == off["answers"]
        later = {k: float(np.median([t for conv in r["ttft"] for t in conv[1:]])) for k, r in results.items()}
        acc, lo, hi = pooled_ratio(on["accepted_sum"], on["request_rounds"], off["accepted_sum"], off["request_rounds"])
        tps = {k: r["emitted"] / r["seconds"] for k, r in results.items()}
        row = {"conversations": n, "turns": args.turns, "policy": args.policy,
               "ttft_later_on_ms": 1e3 * later[True], "ttft_later_off_ms": 1e3 * later[False],
               "ttft_ratio": later[True] / later[False],
               "accept_len_on": sum(on["accepted_sum"]) / sum(on["request_rounds"]),
               "accept_len_off": sum(off["accepted_sum"]) / sum(off["request_rounds"]),
               "accept_ratio": acc, "accept_ratio_ci": [lo, hi],
               "tokens_per_s_on": tps[True], "tokens_per_s_off": tps[False], "throughput_ratio": tps[True] / tps[False],
               "hit_rate": on["prefix"]["hit_rate"], "identical_answers": identical}
        rows.append(row)
        if not identical:
            print("ANSWERS DIFFER between caching on and off", flush=True)
    print(format_table(rows, ["conversations", "turns", "policy", "ttft_later_on_ms", "ttft_later_off_ms", "ttft_ratio",
                              "accept_len_on", "accept_len_off", "accept_ratio", "tokens_per_s_on", "tokens_per_s_off",
                              "throughput_ratio", "hit_rate", "identical_answers"]))
    for r in rows:
        print(f"  {r['conversations']} conversations: accepted length on/off {r['accept_ratio']:.3f} "
              f"[{r['accept_ratio_ci'][0]:.3f}, {r['accept_ratio_ci'][1]:.3f}]")
    if args.json:
        write_json(args.json, {"device": device_info(), "date": datetime.datetime.now().isoformat(timespec="minutes"),
                               "args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
