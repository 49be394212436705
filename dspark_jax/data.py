"""Drafter training data: target-generated responses, then a compact cache of the target's hidden states.

Stage 1 (`dspark_jax.datagen`): the target answers the training prompts itself, several times each, into
resumable shards of token ids.

Stage 2 (`build_target_cache`): one teacher-forced pass over every sequence (prompt + response; the samples of
one prompt share the prompt's pass) stores, per token, the raw outputs of the tapped layers in bfloat16 (the
residual stream can hold large values), the final normed hidden state in float16 (small values, more mantissa),
and the float32 log-partition of the target logits computed from that stored float16 state, so the recomputed
target distribution sums to one. Full-vocabulary logits are never stored: the target's probabilities on any
token set are ``exp(h @ E[ids].T - lse)`` from the frozen LM head. Shards are written atomically and skipped on
restart.

Stage 3 (`BlockLoader`): batches of blocks for training, bucketed by sequence length, with anchors sampled
uniformly without replacement among positions where the anchor and the next token are both assistant tokens
(spec section 5). Batches depend only on (seed, step), so a resumed run sees the same data.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from pathlib import Path
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dspark_jax.io import atomic_write_file, atomic_write_text
from dspark_jax.models.llama import logits_from_hidden

BF16 = ml_dtypes.bfloat16


@dataclasses.dataclass(frozen=True)
class Prompt:
    index: int  # position in the combined prompt list (stable across runs)
    domain: str  # file stem, e.g. "gsm8k"
    turns: tuple[str, ...]


def prompt_files(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """The JSONL files ``paths`` name: files as given, folders as their ``*.jsonl`` files sorted by name.

    Raises:
      ValueError: a path that is neither a file nor a folder, or no JSONL file at all.
    """
    files: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            files += sorted(Path(f) for f in glob.glob(str(p / "*.jsonl")))
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"prompts: {p} is neither a JSONL file nor a folder")
    if not files:
        raise ValueError(f"prompts: no JSONL files found in {list(map(str, paths))}")
    return files


def load_prompts(paths: Sequence[str | os.PathLike], limit: int | None = None) -> list[Prompt]:
    """Prompts from JSONL files (``{"turns": [...]}`` per line) or folders of them, in a stable order.

    Args:
      paths: files or folders; folders contribute their ``*.jsonl`` files sorted by name (`prompt_files`).
      limit: keep at most this many prompts per file.
    """
    files = prompt_files(paths)
    out: list[Prompt] = []
    for f in files:
        with open(f) as fh:
            for n, line in enumerate(fh):
                if limit is not None and n >= limit:
                    break
                if not line.strip():
                    continue
                out.append(Prompt(len(out), f.stem, parse_turns(line, f"{f}:{n + 1}")))
    return out


def parse_turns(line: str, where: str = "prompt") -> tuple[str, ...]:
    """The user turns of one prompts-file line, ``{"turns": ["first turn", ...]}``.

    Raises:
      ValueError: naming `where` (file:line) and what was expected.

    >>> parse_turns('{"turns": ["Hi", "And then?"]}')
    ('Hi', 'And then?')
    >>> parse_turns('{"turns": "not a list"}', "p.jsonl:3")
    Traceback (most recent call last):
    ...
    ValueError: p.jsonl:3: expected {"turns": ["...", ...]} (a non-empty list of strings), got '{"turns": "not a list"}'
    """
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    turns = obj.get("turns") if isinstance(obj, dict) else None
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise ValueError(f"{where}: expected {{\"turns\": [\"...\", ...]}} (a non-empty list of strings), "
                         f"got {line.strip()[:80]!r}")
    return tuple(turns)


# ------------------------------------------------------------------------------------------ stage 2
class StackedRows:
    """Arrays stacked along their first axis without copying them: rows of memory-mapped shards read on demand.

    ``parts``: arrays of one dtype and one row shape. Indexing by a slice or by integer rows returns what the
    same index of ``np.concatenate(parts)`` would, reading only the rows asked for, so a cache larger than memory
    can be trained on.

    >>> rows = StackedRows([np.arange(6).reshape(3, 2), np.arange(6, 10).reshape(2, 2)])
    >>> rows.shape, rows[2:4].tolist(), rows[np.array([4, 0])].tolist()
    ((5, 2), [[4, 5], [6, 7]], [[8, 9], [0, 1]])
    """

    def __init__(self, parts: Sequence[np.ndarray]):
        if not parts:
            raise ValueError("StackedRows: expected at least one array")
        rest = {(p.dtype, p.shape[1:]) for p in parts}
        if len(rest) != 1:
            raise ValueError(f"StackedRows: the arrays differ in dtype or row shape: {sorted(map(str, rest))}")
        self.parts = list(parts)
        self.starts = np.concatenate([[0], np.cumsum([len(p) for p in parts])])
        self.dtype, row = rest.pop()
        self.shape = (int(self.starts[-1]), *row)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1 and start < stop:
                k = int(np.searchsorted(self.starts, start, side="right")) - 1
                if stop <= self.starts[k + 1]:  # within one part: a view of it, nothing read yet
                    return self.parts[k][start - self.starts[k] : stop - self.starts[k]]
            index = np.arange(start, stop, step)
        rows = np.asarray(index)
        if rows.dtype.kind not in "iu":
            raise TypeError(f"StackedRows: index by a slice or integer rows, got {type(index).__name__}")
        rows = np.where(rows < 0, rows + len(self), rows)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"StackedRows: rows out of range for {len(self)} rows")
        part = np.searchsorted(self.starts, rows, side="right") - 1
        out = np.empty(rows.shape + self.shape[1:], self.dtype)
        for k in np.unique(part):
            sel = part == k
            out[sel] = self.parts[k][rows[sel] - self.starts[k]]
        return out

    def view(self, dtype) -> "StackedRows":
        """Every part viewed as ``dtype`` (of the same item size)."""
        return StackedRows([p.view(dtype) for p in self.parts])


@dataclasses.dataclass
class TargetCache:
    """Hidden states of many sequences laid end to end (memory-mapped when opened from disk).

    tokens int32 [T], taps bf16 [T, M, D], final float16 [T, D], lse float32 [T]; sequence i occupies
    ``offsets[i] : offsets[i] + lengths[i]`` and its assistant tokens start at ``prompt_lengths[i]``. ``taps``
    and ``final`` may be `StackedRows` of the cache's shards, read on demand.
    """

    tokens: np.ndarray
    taps: np.ndarray | StackedRows
    final: np.ndarray | StackedRows
    lse: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    prompt_lengths: np.ndarray
    domains: list[str]
    temperatures: np.ndarray | None = None  # float [num_sequences], each answer's sampling temperature (nan: unknown)

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)


def build_target_cache(model, chunks: dict[str, Sequence[dict]], out_dir: str | os.PathLike, *,
                       progress: bool = True) -> Path:
    """Teacher-forced pass over every sequence; one shard per generated chunk,
    ``<chunk>.{tokens,taps,final,lse}.npy``, plus ``index.json``. Resumable and incremental: shards already
    written are kept, so it can follow a generation run that is still adding chunks.

    The samples of one prompt (consecutive records with the same prompt) share its pass: the prompt is
    prefilled once and each answer continues from a copy of that cache, so the prompt of a prompt answered five
    times is run once, not five times (the stored rows are those of a whole-sequence pass, up to float
    rounding). Every record needs a prompt and an answer of at least one token each."""
    from tqdm import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "index.json").is_file():
        old = json.loads((out_dir / "index.json").read_text())
        if (list(old.get("tap_layers", [])), old.get("dim")) != (list(model.cfg.tap_layers), model.cfg.dim):
            raise ValueError(f"{out_dir}: a cache of a target with tap layers {old.get('tap_layers')} and width "
                             f"{old.get('dim')}, not this one's ({list(model.cfg.tap_layers)}, {model.cfg.dim}); "
                             f"use another output folder")
    bar = tqdm(total=sum(len(c) for c in chunks.values()), desc="target cache", unit="seq", disable=not progress)
    entries = []
    for name, shard in chunks.items():
        stem = out_dir / name
        meta = [{"index": s["index"], "domain": s["domain"], "prompt_length": len(s["prompt_ids"]),
                 "length": len(s["prompt_ids"]) + len(s["output_ids"]), "temperature": s.get("temperature")}
                for s in shard]
        entries.append({"shard": stem.name, "sequences": meta})
        if Path(f"{stem}.lse.npy").exists():  # written last: the shard is complete
            held = np.load(f"{stem}.tokens.npy", mmap_mode="r")
            want = [t for r in shard for t in (*r["prompt_ids"], *r["output_ids"])]
            if len(held) != len(want) or not np.array_equal(held, np.asarray(want, held.dtype)):
                raise ValueError(f"{stem}.tokens.npy: the shard holds other sequences than the data's chunk {name!r} "
                                 f"(a cache built from other data?); use another output folder, or delete the "
                                 f"shard's files to rebuild it")
            bar.update(len(shard))
            continue
        toks, taps, finals, lses = [], [], [], []
        for group in _prompt_groups(shard):
            for ids, (tap, final, lse) in zip(*_group_pass(model, group)):
                toks.append(np.asarray(ids, np.int32))
                taps.append(tap)
                finals.append(final)
                lses.append(lse)
                bar.update(1)
        arrays = {"tokens": np.concatenate(toks), "taps": np.concatenate(taps).view(np.uint16),
                  "final": np.concatenate(finals), "lse": np.concatenate(lses)}
        for name, arr in arrays.items():
            atomic_write_file(Path(f"{stem}.{name}.npy"), lambda f, a=arr: np.save(f, a))
    bar.close()
    index = {"shards": entries, "tap_layers": list(model.cfg.tap_layers), "dim": model.cfg.dim}
    atomic_write_text(out_dir / "index.json", json.dumps(index) + "\n")
    return out_dir


def _prompt_groups(shard: Sequence[dict]) -> list[list[dict]]:
    """Runs of consecutive records with the same prompt tokens, in order."""
    groups: list[list[dict]] = []
    for s in shard:
        if groups and list(groups[-1][0]["prompt_ids"]) == list(s["prompt_ids"]):
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def _pad64(n: int) -> int:
    return -(-n // 64) * 64


@jax.jit
def _log_partition(weights, final):
    """float32 [n] log-partition of the target logits from float16 final states [n, D]."""
    return jax.nn.logsumexp(logits_from_hidden(weights, final.astype(jnp.float32)), axis=-1)


def _rows(model, extras, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The first ``n`` rows of a pass's (taps bfloat16, final float16, lse float32)."""
    final = extras.final_hidden.astype(jnp.float16)
    return (np.asarray(extras.taps.astype(jnp.bfloat16))[:n], np.asarray(final)[:n],
            np.asarray(_log_partition(model.weights, final), np.float32)[:n])


def _group_pass(model, group: Sequence[dict]):
    """The rows of every sequence of a group sharing one prompt: (token ids per sequence, (taps, final, lse)
    per sequence). The prompt's pass is made once; each answer continues from a copy of its cache.

    Prompt and answers are padded to multiples of 64 tokens, so that the programs compile once per padded
    length, not once per sequence length; attention is causal, so padding changes none of the real rows, and
    the prompt's padded positions are overwritten by each answer's first chunk (at least 64 tokens) before
    any real position reads them."""
    prompt = list(group[0]["prompt_ids"])
    n_p = len(prompt)
    for s in group:
        if not n_p or not len(s["output_ids"]):
            raise ValueError(f"build_target_cache: record {s.get('index')} (sample {s.get('sample')}) has "
                             f"{n_p} prompt and {len(s['output_ids'])} answer tokens; expected at least one each")
    pad_p = _pad64(n_p)
    capacity = -(-(pad_p + max(_pad64(len(s["output_ids"])) for s in group)) // 256) * 256
    _, extras, cache = model.prefill(model.init_cache(1, capacity), prompt + [0] * (pad_p - n_p), 0,
                                     return_extras=True)
    head = _rows(model, extras, n_p)
    ids_out, rows_out = [], []
    for i, s in enumerate(group):
        answer = list(s["output_ids"])
        n_a = len(answer)
        start = cache if i == len(group) - 1 else jax.tree.map(jnp.copy, cache)  # prefill donates its cache
        _, extras, _ = model.prefill(start, answer + [0] * (_pad64(n_a) - n_a), 0, start=n_p, return_extras=True)
        tail = _rows(model, extras, n_a)
        ids_out.append(prompt + answer)
        rows_out.append(tuple(np.concatenate([a, b]) for a, b in zip(head, tail)))
    return ids_out, rows_out


def open_target_cache(cache_dir: str | os.PathLike) -> TargetCache:
    """Memory-map a cache written by `build_target_cache`."""
    cache_dir = Path(cache_dir)
    index_path = cache_dir / "index.json"
    if not index_path.is_file():
        raise ValueError(f"{cache_dir}: no index.json; run train.build_cache first")
    index = json.loads(index_path.read_text())
    parts = {"tokens": [], "taps": [], "final": [], "lse": []}
    offsets, lengths, prompt_lengths, domains, temperatures = [], [], [], [], []
    base = 0
    for entry in index["shards"]:
        stem = cache_dir / entry["shard"]
        for name in parts:
            arr = np.load(f"{stem}.{name}.npy", mmap_mode="r")
            parts[name].append(arr)
        for m in entry["sequences"]:
            offsets.append(base)
            lengths.append(m["length"])
            prompt_lengths.append(m["prompt_length"])
            domains.append(m["domain"])
            temperatures.append(np.nan if m.get("temperature") is None else m["temperature"])
            base += m["length"]
    cat = lambda xs: xs[0] if len(xs) == 1 else np.concatenate(xs)  # noqa: E731
    # The hidden states stay on disk (7 KB a token at SmolLM2's shape): only the rows a batch asks for are read.
    stack = lambda xs: xs[0] if len(xs) == 1 else StackedRows(xs)  # noqa: E731
    return TargetCache(
        tokens=cat(parts["tokens"]),
        taps=stack(parts["taps"]).view(BF16),
        final=stack(parts["final"]),
        lse=cat(parts["lse"]),
        offsets=np.asarray(offsets, np.int64),
        lengths=np.asarray(lengths, np.int64),
        prompt_lengths=np.asarray(prompt_lengths, np.int64),
        domains=domains,
        temperatures=np.asarray(temperatures, np.float64),
    )


# ------------------------------------------------------------------------------------------ stage 3
@dataclasses.dataclass(frozen=True)
class BlockBatch:
    """One training batch (numpy, host side).

    taps [N, S, M, D] bf16 context features; tokens [N, S] int32 (0 beyond the sequence);
    anchors [N, B] int32 anchor positions; valid [N, B, G] bool (label exists and is an assistant token);
    final [N, B, G, D] float16 and lse [N, B, G] float32: the target state at positions anchor + k.
    """

    taps: np.ndarray
    tokens: np.ndarray
    anchors: np.ndarray
    valid: np.ndarray
    final: np.ndarray
    lse: np.ndarray


def default_buckets(longest: int) -> tuple[int, ...]:
    """Training context buckets that hold a sequence of ``longest`` tokens: 256, 512, 1024, then powers of two
    and one and a half times them (1536, 2048, 3072, ...), so a batch pads at most a third of its context and
    a long-tailed cache compiles few steps (a 1024-token prompt with a 512-token answer lands in 1536).

    >>> default_buckets(300), default_buckets(1536), default_buckets(5000)
    ((256, 512, 1024), (256, 512, 1024, 1536), (256, 512, 1024, 1536, 2048, 3072, 4096, 6144))
    """
    out = [256, 512, 1024]
    while out[-1] < longest:
        top = out[-1]
        out.append(top * 3 // 2 if top & (top - 1) == 0 else top * 4 // 3)
    return tuple(out)


class BlockLoader:
    """Batches of training blocks from a `TargetCache`.

    Sequences are bucketed by length into ``buckets`` (context lengths S); a batch holds
    ``context_tokens // S`` sequences of one bucket and ``blocks // N`` blocks per sequence, so every
    step has about the same cost and each bucket compiles once. The default buckets (`default_buckets`)
    hold the longest sequence; with explicit ones, sequences longer than the largest are skipped (`skipped`
    counts them). ``sequences_multiple``: N is rounded down to a multiple of it (at least one multiple), so a
    batch splits evenly over that many data-parallel devices.
    """

    def __init__(self, cache: TargetCache, *, block: int, buckets: Sequence[int] | None = None,
                 context_tokens: int = 2048, blocks: int = 256, seed: int = 0,
                 sequence_ids: Sequence[int] | None = None, sequences_multiple: int = 1):
        self.cache, self.block, self.seed = cache, block, seed
        ids = np.arange(cache.num_sequences) if sequence_ids is None else np.asarray(sequence_ids)
        if buckets is None:
            buckets = default_buckets(int(cache.lengths[ids].max(initial=1)))
        self.buckets = tuple(sorted(buckets))
        # A sequence needs at least one anchor: two assistant tokens.
        ids = ids[cache.lengths[ids] - cache.prompt_lengths[ids] >= 2]
        fits = cache.lengths[ids] <= self.buckets[-1]
        self.skipped = int(np.sum(~fits))  # sequences longer than the largest bucket
        ids = ids[fits]
        if len(ids) == 0:
            raise ValueError("no usable sequences (need two assistant tokens and a length within the buckets)")
        which = np.searchsorted(self.buckets, cache.lengths[ids], side="left")
        self.groups = {self.buckets[b]: ids[which == b] for b in range(len(self.buckets)) if np.any(which == b)}
        m = max(1, int(sequences_multiple))  # sequences a batch holds: a multiple of the data-parallel devices
        seqs_of = {s: max(m, context_tokens // s // m * m) for s in self.groups}
        self.shapes = {s: (n, max(1, blocks // n)) for s, n in seqs_of.items()}
        # Pick a bucket in proportion to the tokens it holds.
        sizes = np.array([cache.lengths[g].sum() for g in self.groups.values()], np.float64)
        self.bucket_probs = sizes / sizes.sum()

    @property
    def num_sequences(self) -> int:
        """Sequences the batches draw from (those with an anchor, within the buckets)."""
        return int(sum(len(g) for g in self.groups.values()))

    @property
    def num_tokens(self) -> int:
        return int(sum(self.cache.lengths[g].sum() for g in self.groups.values()))

    def batch(self, step: int) -> BlockBatch:
        """The batch of ``step`` (a pure function of seed and step)."""
        rng = np.random.default_rng([self.seed, step])
        S = list(self.groups)[rng.choice(len(self.groups), p=self.bucket_probs)]
        N, B = self.shapes[S]
        G = self.block
        seqs = rng.choice(self.groups[S], size=N, replace=len(self.groups[S]) < N)
        c = self.cache
        M, D = c.taps.shape[1], c.taps.shape[2]
        taps = np.zeros((N, S, M, D), BF16)
        tokens = np.zeros((N, S), np.int32)
        anchors = np.zeros((N, B), np.int32)
        valid = np.zeros((N, B, G), bool)
        final = np.zeros((N, B, G, D), np.float16)
        lse = np.zeros((N, B, G), np.float32)
        for i, s in enumerate(seqs):
            off, n, p = int(c.offsets[s]), int(c.lengths[s]), int(c.prompt_lengths[s])
            taps[i, :n] = c.taps[off : off + n]
            tokens[i, :n] = c.tokens[off : off + n]
            cand = np.arange(p, n - 1)  # anchor and next token are assistant tokens
            take = rng.choice(cand, size=min(B, len(cand)), replace=False)
            anchors[i, : len(take)] = take
            pos = take[:, None] + np.arange(G)[None, :]  # [b, G] positions a + k (label at a + k + 1)
            ok = pos + 1 < n
            valid[i, : len(take)] = ok
            safe = np.minimum(pos, n - 1) + off
            final[i, : len(take)] = c.final[safe]
            lse[i, : len(take)] = c.lse[safe]
        return BlockBatch(taps, tokens, anchors, valid, final, lse)

    def __iter__(self) -> Iterator[BlockBatch]:
        step = 0
        while True:
            yield self.batch(step)
            step += 1


def token_frequencies(cache: TargetCache, vocab_size: int, temperature: float | None = None) -> np.ndarray:
    """How often each token occurs among assistant tokens (for choosing a reduced draft vocabulary).

    With ``temperature`` (e.g. 1.0) only answers sampled at it count, when the cache has any: answers drawn at
    T = 1 are samples of the target's own distribution, so their counts estimate its probability mass, which is
    what a draft vocabulary has to cover (greedy answers over-count the most likely tokens)."""
    counts = np.zeros(vocab_size, np.int64)
    use = np.ones(cache.num_sequences, bool)
    if temperature is not None and cache.temperatures is not None:
        match = np.isclose(cache.temperatures, temperature)
        use = match if match.any() else use
    for off, n, p in zip(cache.offsets[use], cache.lengths[use], cache.prompt_lengths[use]):
        np.add.at(counts, cache.tokens[off + p : off + n], 1)
    return counts


def token_counts(cache: TargetCache, vocab_size: int) -> np.ndarray:
    """How often each token id occurs anywhere in the cache, prompts and chat-template tokens included: int64 [V]."""
    return np.bincount(np.asarray(cache.tokens, np.int64), minlength=vocab_size)[:vocab_size]


def tap_rms(cache: TargetCache, sample: int = 4096) -> np.ndarray:
    """The typical size of each tapped layer: the median over ``sample`` evenly spaced cached tokens of the
    root mean square of its hidden state, float32 [M]. The median, not the mean: a few tokens (a sequence's
    first) carry hidden states tens of times larger than the rest."""
    n = len(cache.taps)
    rows = np.unique(np.linspace(0, n - 1, min(sample, n)).astype(np.int64))
    taps = np.asarray(cache.taps[rows], np.float32)  # [n, M, D]
    return np.median(np.sqrt(np.mean(taps * taps, axis=-1)), axis=0).astype(np.float32)
