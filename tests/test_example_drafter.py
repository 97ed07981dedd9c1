"""A drafter is a plug-in: a tiny drafter defined in this file and registered here (its one registry line, in the
`example_drafter` fixture) decodes losslessly through `generate`, runs in `speclab bench` and `speclab grid`, shows
in the app's method list with its own colour in figures, and passes the conformance suite (tests/test_conformance.py)
with no edit anywhere else.

The drafter, "repeat": the text repeats with period n, so it proposes the last n committed tokens again, in order
(a chain of n: x[t+1..t+n] = x[t-n+1..t]). No model, no features."""
import re
from pathlib import Path

import pytest
import torch

import test_conformance as conformance
from helpers import PROMPTS
from speclab.checks import Bound
from speclab.core.sampling import Sampling
from speclab.core.tree import DraftTree
from speclab.drafters.registry import DrafterEntry, Param, register, unregister


class Repeat:
    name = "repeat"
    layers: tuple[int, ...] = ()

    def __init__(self, *, n: int):
        self.n = n
        self.ids = torch.zeros(0, dtype=torch.long)

    def reset(self, prompt_ids: torch.Tensor, prompt_features=None, capacity: int | None = None) -> None:
        self.ids = prompt_ids.detach().cpu().long().clone()

    def catch_up(self, ids: torch.Tensor, features=None) -> None:
        self.ids = torch.cat([self.ids, ids.detach().cpu().long()])

    def propose(self, max_depth: int, sampling: Sampling, generator=None) -> DraftTree:
        k = min(self.n, max_depth, self.ids.numel())
        if k <= 0:
            return DraftTree.empty()
        chain = self.ids[-self.n:][:k].clone()
        return DraftTree.chain(chain, torch.full((k,), float("nan")))

    def commit(self, tree: DraftTree, accepted: torch.Tensor) -> None:
        pass


ENTRY = DrafterEntry(
    name="repeat", label="repeat", color="#123456",
    build=lambda target, model, **params: Repeat(**params),
    methods={"repeat": "repeat the last n tokens (a test's plug-in drafter)"},
    params=(Param("n", 3, lambda t: Bound(1, 64), grid=(1, 2, 4), help="period of the repetition guessed"),))


@pytest.fixture
def example_drafter():
    register(ENTRY)  # the one registry line
    yield ENTRY
    unregister(ENTRY.name)


def test_it_decodes_like_ar_with_its_drafts_verified(deep, example_drafter, monkeypatch):
    from speclab.generate import generate

    proposed = []
    propose = Repeat.propose
    monkeypatch.setattr(Repeat, "propose", lambda self, *a: proposed.append(propose(self, *a)) or proposed[-1])
    for p in PROMPTS[:3]:
        ar = generate(deep, p, "ar", max_new_tokens=32)
        for n in (1, 3):
            res = generate(deep, p, "repeat", n=n, max_new_tokens=32)
            assert res.token_ids == ar.token_ids
            assert res.decode.rounds < 32 or all(t.tokens.numel() > 0 for t in proposed)  # every round verified a draft
    assert sum(t.tokens.numel() for t in proposed) >= 3 * 32  # its drafts went to the target (accepted: the zoo test's)
    with pytest.raises(Exception, match="n must be"):
        generate(deep, PROMPTS[0], "repeat:n=0")


def test_the_app_lists_it_and_figures_colour_it(deep, example_drafter, tmp_path):
    pytest.importorskip("gradio")  # absent from the GPU machine's image (scripts/device_tests.sh)
    from app.lab import Lab
    from speclab.trace import TraceStore
    from speclab.viz import drafter_rgb, method_color

    with TraceStore(str(tmp_path / "t.duckdb")) as store:
        assert "repeat" in Lab(deep, {}, store).methods()
    assert method_color("repeat") == "#123456" and drafter_rgb("repeat") == (0x12, 0x34, 0x56)


@pytest.mark.slow
def test_generate_bench_and_grid_commands_run_it_on_the_zoo(example_drafter, tmp_path, capsys):
    """The commands, in this process (where it is registered): generate prints its text, bench records its runs
    (equal to AR's), grid sweeps its parameter grid."""
    import duckdb

    from speclab.cli.main import main

    db, report = str(tmp_path / "b.duckdb"), str(tmp_path / "b.md")
    assert main(["generate", "--method", "repeat", "--n", "3", "--prompt", "Return the value of the value of the value",
                 "--max-new-tokens", "12", "--dtype", "fp32", "--db", str(tmp_path / "g.duckdb")]) == 0
    with duckdb.connect(str(tmp_path / "g.duckdb"), read_only=True) as con:
        assert con.execute("SELECT sum(n_accepted) FROM rounds").fetchone()[0] > 0  # the zoo target repeats it too
    assert main(["bench", "--methods", "ar,repeat", "--limit", "1", "--max-new-tokens", "24", "--no-peers",
                 "--no-untraced", "--dtype", "fp32", "--db", db, "--report", report]) == 0
    with duckdb.connect(db, read_only=True) as con:
        runs = con.execute("SELECT method, count(*), bool_and(status = 'done') FROM runs GROUP BY method "
                           "ORDER BY method").fetchall()
        assert [r[0] for r in runs] == ["ar", "repeat"] and all(r[2] for r in runs)
        hashes = con.execute("SELECT count(DISTINCT method), count(*) FROM runs GROUP BY prompt_id, output_hash"
                             ).fetchall()
        assert all(m == 2 for m, _ in hashes)  # every prompt: repeat's output is AR's
    assert "repeat" in Path(report).read_text()
    assert main(["grid", "--method", "repeat", "--limit", "1", "--max-new-tokens", "16", "--dtype", "fp32",
                 "--report", str(tmp_path / "g.md")]) == 0
    grid = (tmp_path / "g.md").read_text()
    assert all(re.search(rf"^\|\s+{n} \|", grid, re.M) for n in (1, 2, 4))  # a row per value of its grid


@pytest.mark.slow
def test_it_passes_the_conformance_suite(deep, tiny_v8, tmp_path_factory, example_drafter):
    """Every check of tests/test_conformance.py on it (greedy = AR in fp32 and bf16, deferred on and off, sampling
    keeps the target's distribution, catch-up in one call, bad parameters in one line, reset forgets)."""
    from speclab.core.target import Target

    bf16 = Target.load(deep.name, dtype="bf16", exact=True)
    conformance.check_conformance(example_drafter, deep, conformance.Models(tmp_path_factory), conformance.ARTokens(),
                                  bf16_target=bf16, sampling_target=tiny_v8)
