"""The generation command end to end on the real model (short outputs)."""

from __future__ import annotations

import json

import pytest

from dspark_jax import generate


def test_read_prompts_first_turns_and_limit(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"turns": ["a", "b"]}\n\n{"turns": ["c"]}\n{"turns": ["d"]}\n', encoding="utf-8")
    assert generate.read_prompts(f) == ["a", "c", "d"]
    assert generate.read_prompts(f, limit=2) == ["a", "c"]
    f.write_text('{"turns": ["a"]}\n{"prompt": "x"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"p\.jsonl:2: expected \{\"turns\": \[\"\.\.\.\", \.\.\.\]\}"):
        generate.read_prompts(f)
    f.write_text('{"turns": "not a list"}\n', encoding="utf-8")  # a string is not a list of turns
    with pytest.raises(ValueError, match=r"p\.jsonl:1: .*a non-empty list of strings"):
        generate.read_prompts(f)


@pytest.mark.slow
def test_generate_streams_and_writes_json(gguf_path, target, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(generate, "load_target", lambda model=None, dtype=None: target)
    out = tmp_path / "out.json"
    report = generate.main(["--prompt", "What is the capital of France?", "--max-new-tokens", "12",
                            "--json", str(out), "--model", str(gguf_path), "--policy", "none"])
    streamed = capsys.readouterr()
    saved = json.loads(out.read_text(encoding="utf-8"))
    assert saved == json.loads(json.dumps(report))
    (row,) = saved["results"]
    tok = target.tokenizer
    assert row["prompt_ids"] == tok.encode_chat(["What is the capital of France?"])
    assert 1 <= len(row["output_ids"]) <= 12
    assert row["output_ids"][-1] == tok.eos_id or len(row["output_ids"]) == 12
    assert row["text"] == tok.decode(row["output_ids"]) and "Paris" in row["text"]
    assert streamed.out == row["text"] + "\n"
    assert "tokens/s" in streamed.err and saved["tokens_per_s"] > 0

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ["Say hi.", "Count to 3.", "x"]))
    report = generate.main(["--prompts", str(prompts), "--limit", "2", "--max-new-tokens", "6", "--quiet",
                            "--temperature", "0.7", "--seed", "1", "--policy", "none"])
    assert [r["prompt"] for r in report["results"]] == ["Say hi.", "Count to 3."]
    assert all(1 <= len(r["output_ids"]) <= 6 for r in report["results"])


@pytest.mark.slow
def test_speculative_generate_equals_plain(gguf_path, target, tmp_path, monkeypatch):
    """The issue's check on two dev-like prompts: --policy dspark (a random drafter, the shipped SPS table)
    gives the same output_ids as --policy none at temperature 0, with both requests in one batch."""
    from tests.helpers import save_random_drafter

    monkeypatch.setattr(generate, "load_target", lambda model=None, dtype=None: target)
    save_random_drafter(target.cfg, tmp_path / "drafter", draft_vocab=1024)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in
                               ["What is 12 times 7?", "Write a Python function that reverses a list."]))
    common = ["--prompts", str(prompts), "--max-new-tokens", "20", "--concurrency", "2", "--quiet"]
    plain = generate.main(common + ["--policy", "none"])
    for policy in ("dspark", "fixed:3"):
        spec = generate.main(common + ["--policy", policy, "--draft", str(tmp_path / "drafter")])
        assert [r["output_ids"] for r in spec["results"]] == [r["output_ids"] for r in plain["results"]]
        assert spec["summary"]["rounds"] > 0
