"""Argument types and early checks shared by the command-line tools.

A bad value becomes a parser error naming the option and what it expects (``argparse`` prints it with the
usage and exits with status 2), before any model is read or any program compiles.

>>> import argparse
>>> p = argparse.ArgumentParser(prog="tool", exit_on_error=False)
>>> _ = p.add_argument("--limit", type=positive_int)
>>> p.parse_args(["--limit", "3"]).limit
3
>>> try:
...     p.parse_args(["--limit", "0"])
... except argparse.ArgumentError as e:
...     print(e)
argument --limit: expected an integer >= 1, got '0'
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

__all__ = ["positive_int", "nonnegative_int", "positive_float", "nonnegative_float", "fraction", "temperature", "port",
           "existing_file", "writable_file", "model_path", "check_engine_arguments", "parse_with_quick"]


def _int(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int(text, 1)


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    return _int(text, 0)


def _float(text: str, *, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise argparse.ArgumentTypeError(f"expected a finite number {'> 0' if positive else '>= 0'}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return _float(text, positive=True)


def nonnegative_float(text: str) -> float:
    """A finite number >= 0."""
    return _float(text, positive=False)


def fraction(text: str) -> float:
    """A number in (0, 1].

    >>> fraction("0.9")
    0.9
    """
    value = _float(text, positive=True)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def temperature(text: str) -> float:
    """A sampling temperature: a finite number >= 0 (0: greedy)."""
    return _float(text, positive=False)


def port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    value = _int(text, 0)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {text!r}")
    return value


def existing_file(text: str) -> str:
    """A path to a file that exists."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file" + (" (a folder)" if Path(text).is_dir() else ""))
    return text


def writable_file(text: str) -> str:
    """A file the tool will write (`io.check_writable`: its folder exists and takes a file), checked at parsing
    rather than after the long work that produces it."""
    from dspark_jax.io import check_writable  # noqa: PLC0415

    try:
        check_writable(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def model_path(text: str) -> str:
    """A target model: a GGUF file, or a Hugging Face checkpoint folder (with its config.json)."""
    path = Path(text)
    if path.is_dir() and not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text}: a folder must be a Hugging Face checkpoint; config.json is missing")
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or folder (expected a GGUF file or a Hugging Face "
                                         f"checkpoint folder)")
    return text


def check_engine_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The engine options (`build.add_engine_arguments`) checked before the model loads: the policy parses, an
    ``--sps`` file is an SPS table, a ``--draft`` that is not a shipped name is a drafter folder that fits
    ``--model``, ``--max-num-batched-tokens`` leaves room for a prefill chunk beside every request's token.
    Errors go through ``p.error``."""
    from dspark_jax.drafters import drafter_source, precheck_for_model  # noqa: PLC0415
    from dspark_jax.engine import parse_policy  # noqa: PLC0415
    from dspark_jax.sps import SPSTable  # noqa: PLC0415

    try:
        policy = parse_policy(args.policy)
    except ValueError as e:
        p.error(f"--policy: {e}")
    if getattr(args, "sps", None):
        try:
            SPSTable.load(args.sps)
        except ValueError as e:
            p.error(f"--sps: {e}")
    slots = getattr(args, "num_slots", None) or getattr(args, "concurrency", None)
    budget = getattr(args, "max_num_batched_tokens", 0)
    if budget and slots and budget < slots + 16:
        p.error(f"--max-num-batched-tokens {budget}: expected 0 (no budget) or at least the request slots + 16 "
                f"= {slots + 16} (every running request's token and a prefill chunk)")
    draft = getattr(args, "draft", None)
    if policy.drafts and draft is not None:
        try:
            drafter_source(draft)
            precheck_for_model(draft, getattr(args, "model", None))
        except ValueError as e:
            p.error(str(e) if str(e).startswith("--draft") else f"--draft: {e}")


def parse_with_quick(p: argparse.ArgumentParser, argv=None, **quick) -> argparse.Namespace:
    """Parse ``argv``; with ``--quick`` the ``quick`` values replace the defaults of their options, while an
    option given on the command line keeps its value (``--quick --concurrency 4`` measures 4 users).

    >>> p = argparse.ArgumentParser()
    >>> _ = p.add_argument("--quick", action="store_true")
    >>> _ = p.add_argument("--repeats", type=int, default=7)
    >>> _ = p.add_argument("--users", type=int, default=16)
    >>> a = parse_with_quick(p, ["--quick", "--users", "4"], repeats=2, users=1)
    >>> a.repeats, a.users
    (2, 4)
    """
    args = p.parse_args(argv)
    unknown = sorted(k for k in quick if not hasattr(args, k))
    if unknown:
        raise ValueError(f"quick defaults for options the parser does not have: {unknown}")
    if not getattr(args, "quick", False):
        return args
    before = {k: p.get_default(k) for k in quick}
    p.set_defaults(**quick)
    try:
        return p.parse_args(argv)
    finally:
        p.set_defaults(**before)  # the parser's own defaults again, for its next use
