"""The engine as a package: one concern per module, no private name crossing a module, models never import the
engine; each step's `StepOutput` tells what the step did; the bounded history keeps its indices."""

import ast
import doctest
from pathlib import Path

import numpy as np
import pytest

from dspark_jax import engine as eng
from dspark_jax.engine import compilation, config, loop, policy, programs, requests, shapes, state
from dspark_jax.engine.requests import History
from tests.test_engine import make_drafter, make_model, prompts

ROOT = Path(__file__).resolve().parents[1] / "dspark_jax"


def _imports(path: Path):
    """(module, names) of every ``from X import names`` in the file, function-local ones included."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []


def test_no_private_name_crosses_a_module_and_models_never_import_the_engine():
    for path in sorted((ROOT / "engine").glob("*.py")):
        for module, names in _imports(path):
            if module.startswith("dspark_jax"):
                private = [n for n in names if n.startswith("_")]
                assert not private, f"{path.name} imports private {private} from {module}"
    for path in sorted((ROOT / "models").glob("*.py")):
        for module, names in _imports(path):
            assert not module.startswith("dspark_jax.engine"), f"models/{path.name} imports {module}"
            assert not (module == "dspark_jax" and "engine" in names), f"models/{path.name} imports the engine"


def test_the_package_exports_what_callers_use():
    for name in eng.__all__ + ["MAX_SEED", "SEEDED_KEY_ID", "use_compilation_cache", "COMPILATION_CACHE_ENV",
                               "EngineState", "RoundSpec", "RoundInputs", "StepOutput", "History"]:
        assert getattr(eng, name) is not None, name
    assert eng.Engine is loop.Engine and eng.EngineConfig is config.EngineConfig and eng.Policy is policy.Policy


@pytest.mark.parametrize("module", [compilation, config, policy, requests, shapes, state, programs, loop])
def test_doctests(module):
    import jax.numpy as jnp

    result = doctest.testmod(module, extraglobs={"jnp": jnp}, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_history_keeps_indices_from_the_first_entry():
    h = History(maxlen=4)
    ref = []
    for i in range(11):
        start = len(h)
        h.append(i)
        ref.append(i)
        assert h[start:] == [i] and h[-1] == i and len(h) == len(ref)
        held = ref[-4:]
        assert list(h) == held and h.dropped == len(ref) - len(held)
        for a in range(-12, 13):
            for b in (None, -1, 3, 9, 20):
                assert h[a:b] == [x for x in ref[a:b] if x in held], (i, a, b)
    with pytest.raises(IndexError):
        h[0]
    assert 10 in h and 3 not in h and h == [7, 8, 9, 10]
    h.clear()
    assert len(h) == 0 and not h
    h.append("x")
    assert h[0] == "x"
    with pytest.raises(ValueError, match="maxlen"):
        History(0)


def test_step_outputs_tell_what_each_step_did():
    """Tokens per step add up to each completion, each request finishes once with its reason, admissions and the
    queue's counts follow the engine; a bounded history still indexes rounds from the first."""
    model = make_model()
    drafter = make_drafter(model)
    stop = [5]
    e = eng.Engine(model, drafter, "fixed:3", eng.EngineConfig(num_slots=2, capacity=64, max_history=3),
                   stop_ids=stop)
    ps = prompts(5, seed=3)
    budgets = [6, 1, 9, 4, 7]
    ids = [e.submit(p, b, eng.SamplingParams(logprobs=1 if i == 2 else None))
           for i, (p, b) in enumerate(zip(ps, budgets))]
    tokens = {i: [] for i in ids}
    logprobs, finished, admitted, rounds = [], {}, [], 0
    while not e.idle():
        out = e.step()
        assert isinstance(out, eng.StepOutput)
        for rid, t in out.tokens.items():
            tokens[rid] += t
        logprobs += out.logprobs.get(ids[2], [])
        assert set(out.logprobs) <= {ids[2]}
        for rid, reason in out.finished.items():
            assert rid not in finished
            finished[rid] = reason
        admitted += out.admitted
        assert out.running <= 2 and out.waiting == len(e.pending_ids())
        if out.stats is not None:
            rounds += 1
            assert e.rounds[len(e.rounds) - 1] is out.stats and out.stats.finished == sum(
                1 for rid in out.finished)
    assert admitted == ids and sorted(finished) == sorted(ids)
    for rid in ids:
        c = e.requests[rid]
        assert tokens[rid] == c.output_ids and finished[rid] == ("stop" if c.finished_by_stop else "length")
    assert [lp.token for lp in logprobs] == e.requests[ids[2]].output_ids
    assert len(e.rounds) == rounds > 3 and len(list(e.rounds)) == 3 and e.rounds.dropped == rounds - 3
    assert e.summary()["rounds"] == 3
    assert len(e.finished_ids) == 5 and list(e.finished_ids) == list(finished)[-3:]
    done = e.pop_completion(ids[0])
    assert done is not None and done.request_id == ids[0] and e.pop_completion(ids[0]) is None
    assert np.all(e.slot_request < 0)
