"""The conformance suite: every registered drafter (`speclab.drafters.registry.drafters()`), in every shape its entry
documents (`DrafterEntry.shapes`: chains, trees, a reduced vocabulary, FlashHead...; an entry without shapes: one,
its default parameters), deferred on and off, keeps the contract of docs/ARCHITECTURE.md ("Invariants"):

- greedy output equals AR token for token: in fp32, with the random model of its role (`ModelRole.random`) and with
  the model conftest.py trains for its role (a `trained_<role>` fixture, if any), whose drafts must really be
  accepted; and in bf16, the target in exact mode, where every difference is a bug (a failure names the first
  divergence and the target's top-2 gap there: `speclab.equality.first_divergence`);
- sampling keeps the target's distribution (tests/test_sampling.py's chi-square harness with its power check), in its
  chain and tree shapes;
- a backlog caught up in one `catch_up` call drafts what a drafter that caught up round by round drafts (its round
  hooks called as the engine calls them);
- a parameter outside its bound, given in a method spec, is refused with one line (InvalidInput);
- `reset` forgets: one drafter object decoding a prompt twice, another prompt, then the first again drafts the same
  trees and commits the same tokens every time it decodes the first.

This file names no drafter: it reads the registry when collected, so a drafter added to `DRAFTER_MODULES` is checked
with no edit here. Each check is a function of an entry (`check_greedy` ... `check_reset`, all of them:
`check_conformance`), with the models of `Models` and AR's outputs from `ARTokens`, so a test that registers a drafter
of its own for its duration (`registry.register`) can run the same checks on it."""
from __future__ import annotations

import copy

import pytest
import torch

import conftest
from helpers import PROMPTS, NoTok
from speclab.core.engine import decode
from speclab.core.protocol import RoundView
from speclab.core.sampling import Sampling
from speclab.core.target import Target
from speclab.drafters.registry import DrafterEntry, Shape, build_drafter, drafters
from speclab.equality import first_divergence
from speclab.errors import InvalidInput
from speclab.generate import Generation, encode_prompt, generate
from speclab.methods import method_params

SEED = 0  # every random model's
N_NEW = 32  # tokens per greedy decode
DEFAULT = Shape("default")  # the one shape of an entry that documents none: its default parameters
PLAIN = Sampling(1.0)  # temperature 1, no top-k / top-p
SAMPLING_PROMPT = torch.tensor([2, 1, 4, 4, 2, 1])  # repeats itself: a drafter that looks things up in it drafts too
# (and tiny_v8 continues it as it repeats, under each of SAMPLINGS, often enough for two-token drafts to be accepted)


# ---- what each entry is checked in ----------------------------------------------------------------------------------

def shapes_of(entry: DrafterEntry) -> tuple[Shape, ...]:
    return entry.shapes or (DEFAULT,)


def method_of(entry: DrafterEntry) -> str:
    """The method that runs the drafter alone: the one named like it, else its first."""
    return entry.name if entry.name in entry.methods else next(iter(entry.methods))


def sampled_shapes(entry: DrafterEntry) -> tuple[Shape, ...]:
    """The shapes the sampling check runs (1200 decodes each): the chain and the tree, else the first shape."""
    named = tuple(s for s in shapes_of(entry) if s.name in ("chain", "tree"))
    return named or shapes_of(entry)[:1]


def trained_shapes(entry: DrafterEntry) -> tuple[Shape, ...]:
    """The shapes a trained model decodes in: those without a FlashHead (no index is built for it), one per set of
    parameters (shapes that differ only in their random model collapse)."""
    out: dict[str, Shape] = {}
    for s in shapes_of(entry):
        if s.params.get("head") != "flash":
            out.setdefault(repr(sorted(s.params.items())), s)
    return tuple(out.values())


def trained_fixture(entry: DrafterEntry) -> str | None:
    """The conftest.py fixture of a model trained for this drafter's role (`trained_<role>`), if there is one."""
    name = f"trained_{entry.model.role}" if entry.model else ""
    return name if hasattr(conftest, name) else None


def cases(shapes=shapes_of, only=lambda entry: True) -> list:
    """(drafter name, shape) for every registered drafter (`only` those), each of its `shapes`."""
    return [pytest.param(e.name, s, id=f"{e.name}-{s.name}") for e in drafters().values() if only(e)
            for s in shapes(e)]


DEFERRED = pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "not-deferred"])
DEFERRED_FAST = pytest.mark.parametrize(  # fp32 greedy: `make test-fast` runs every shape deferred, `make test` both
    "deferred", [pytest.param(True, id="deferred"), pytest.param(False, id="not-deferred", marks=pytest.mark.slow)])


# ---- the models and AR outputs the checks use -----------------------------------------------------------------------

class Models:
    """The models the checks decode with, each built once: the random model of a drafter's role for a target and a
    shape's `model` keywords (`ModelRole.random`, seed `SEED`), and the FlashHead index a shape with `head="flash"`
    reads, built beside the model (in a folder of the session's that names the model, as a loaded drafter is named
    by its directory)."""

    def __init__(self, tmp_path_factory):
        self.tmp, self.built, self.indexes = tmp_path_factory, {}, set()

    def of(self, entry: DrafterEntry, shape: Shape, target, model=None) -> dict:
        """{role: model} for `entry` in `shape` on `target` (`model`: that one, not a random one); {} for a drafter
        without a model."""
        if entry.model is None:
            return {}
        if model is None:
            key = (target, entry.name, repr(sorted(shape.model.items())))
            if key not in self.built:
                self.built[key] = entry.model.random(target, SEED, **shape.model)
            model = self.built[key]
        if shape.params.get("head") == "flash":
            self.index(entry, model, target, int(shape.params.get("clusters") or 64))
        return {entry.model.role: model}

    def index(self, entry: DrafterEntry, model, target, clusters: int) -> None:
        from speclab.drafters.flashhead import build_index, index_dir

        if (model, clusters) in self.indexes:
            return
        if not getattr(model, "name", None):
            model.name = str(self.tmp.mktemp(f"{entry.name}-flash"))
        weight = entry.build.head_weight(model, target)  # the head `speclab flashhead build` clusters
        build_index(weight, clusters, iters=5).save(index_dir(model.name, clusters))  # any clustering will do
        self.indexes.add((model, clusters))


class ARTokens:
    """AR's greedy tokens, decoded once per target, prompt and length."""

    def __init__(self):
        self.done: dict = {}

    def __call__(self, target, prompt: str, n: int = N_NEW) -> list[int]:
        key = (target, prompt, n)
        if key not in self.done:
            self.done[key] = generate(target, prompt, "ar", max_new_tokens=n).token_ids
        return self.done[key]


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Models:
    return Models(tmp_path_factory)


@pytest.fixture(scope="module")
def ar() -> ARTokens:
    return ARTokens()


@pytest.fixture(scope="module")
def deep_bf16(deep) -> Target:
    """`deep` in bf16, in exact mode: a row's logits never depend on how many rows run with it, so a speculative
    decode's are AR's, bit for bit."""
    return Target.load(deep.name, dtype="bf16", exact=True)


# ---- the checks -----------------------------------------------------------------------------------------------------

def check_greedy(target, entry: DrafterEntry, shape: Shape, models: dict, deferred: bool, ar: ARTokens,
                 prompts=PROMPTS[:2], n: int = N_NEW) -> tuple[int, int]:
    """Greedy decoding through the drafter (its method, the shape's parameters) gives AR's tokens for each prompt.
    Returns (draft tokens accepted, tokens decoded)."""
    accepted = total = 0
    for p in prompts:
        want = ar(target, p, n)
        res = generate(target, p, method_of(entry), models=models, deferred=deferred, max_new_tokens=n,
                       **shape.params)
        if res.token_ids != want:
            div = first_divergence(target, res.decode.prompt_ids, want, res.token_ids)
            pytest.fail(f"{entry.name} {shape.name} ({target.precision}, deferred={deferred}) on {p[:24]!r}: "
                        f"{div.describe() if div else 'the same tokens?'}")
        accepted += len(res.token_ids) - res.decode.rounds
        total += len(res.token_ids)
    return accepted, total


def check_sampling(target, entry: DrafterEntry, shape: Shape, models: dict, seed0: int,
                   s: Sampling = PLAIN) -> None:
    """The first two tokens sampled through the drafter under `s` follow the target's exact joint distribution, more
    than 1% of the decodes accept drafts for both, and the target's joint under other sampling is told apart
    (tests/test_sampling.py)."""
    from test_sampling import N_RUNS, assert_keeps_target_distribution

    drafter = build_drafter(entry.name, target, models, **method_params(method_of(entry), shape.params, target))
    assert_keeps_target_distribution(target, drafter, seed0, N_RUNS // 100, prompt=SAMPLING_PROMPT, s=s)


def accepted_path(tree, upcoming: torch.Tensor) -> torch.Tensor:
    """The nodes greedy verification accepts when the target's next tokens are `upcoming`: from the root, the child
    whose token is the next one, as deep as they match."""
    path: list[int] = []
    parent = -1
    for tok in upcoming.tolist():
        kids = ((tree.parents == parent) & (tree.tokens == tok)).nonzero().flatten().tolist()
        if not kids:
            break
        parent = kids[0]
        path.append(parent)
    return torch.tensor(path, dtype=torch.long)


@torch.inference_mode()
def check_catch_up(target, entry: DrafterEntry, shape: Shape, models: dict, prompt: str = PROMPTS[1],
                   backlog: int = 20) -> None:
    """One drafter follows a greedy decode round by round, as the engine hands it over (propose; commit the nodes
    greedy verification accepts; catch up on them and the target's token: token by token where nothing is
    accepted); another, reset on the same prompt, catches up on the whole backlog in one call. Then both draft the
    same tree (tokens, parents, draft probabilities). A drafter with round hooks gets its `before_catch_up` before
    every catch-up, over the target's cache of the committed tokens as a deferred decode holds it."""
    params = method_params(method_of(entry), shape.params, target)
    busy, idle = (build_drafter(entry.name, target, models, **params) for _ in range(2))
    ids = encode_prompt(target, prompt)
    ids = torch.cat([ids, torch.tensor(generate(target, ids, "ar", max_new_tokens=backlog).token_ids)])
    N, n0 = ids.numel(), ids.numel() - backlog
    feats = target.forward(ids, target.new_cache(), layers=busy.layers).features if busy.layers else None

    def f(a: int, b: int):  # the target's features of tokens a..b-1 (None: the drafter reads none)
        return None if feats is None else feats[a:b]

    def hook(d, n: int) -> None:  # the catch-up phase after n committed tokens: the drafter's own target work first
        if hasattr(d, "before_catch_up"):
            cache = target.new_cache(N + 1)
            target.forward(ids[: n - 1], cache)
            d.before_catch_up(RoundView(target, cache, n, n - 1, f, False))

    for d in (busy, idle):
        d.reset(ids[:n0], f(0, n0 - 1), capacity=N)
        hook(d, n0)
        d.catch_up(ids[n0:n0], f(n0 - 1, n0 - 1))
    s, rounds = n0, 0
    while s < N:
        tree = busy.propose(N - s, Sampling())
        path = accepted_path(tree, ids[s : N - 1])
        busy.commit(tree, path)
        step = path.numel() + 1
        hook(busy, s + step)
        busy.catch_up(ids[s : s + step], f(s - 1, s + step - 1))
        s, rounds = s + step, rounds + 1
    hook(idle, N)
    idle.catch_up(ids[n0:], f(n0 - 1, N - 1))
    a, b = busy.propose(8, Sampling()), idle.propose(8, Sampling())
    where = f"{entry.name} {shape.name}, after {rounds} rounds"
    n = len(a) if shape.params.get("adaptive") == "always" else len(b)  # an adaptive length follows the drafter's
    assert len(a) == n and len(b) >= n, where  # own rounds, not the context: the fresh one's proposal is longer
    assert torch.equal(a.tokens, b.tokens[:n]) and torch.equal(a.parents, b.parents[:n]), where
    torch.testing.assert_close(a.draft_probs, b.draft_probs[:n], atol=1e-5, rtol=1e-4, equal_nan=True, msg=where)


def bad_values(param, target) -> list:
    """Values of `param` outside what it allows on `target`: not a number, below its lowest, above its highest, not
    an integer, not one of its choices."""
    if param.choices:
        return ["nope"]
    b = param.bound(target)
    step = 1 if param.kind is int else 0.5
    out: list = ["x"]
    if b.lo is not None:
        out.append(b.lo - step)
    if b.hi is not None:
        out.append(b.hi if b.hi_open else b.hi + step)
    if param.kind is int:
        out.append(1.5)
    return out


def check_bad_parameters(target, entry: DrafterEntry, models: dict) -> None:
    """Each parameter given outside its bound in a method spec (`method:param=value`) is refused before any decode,
    in one line that names it; an unknown parameter and a missing model are refused alike; a spec's parameters win
    over the ones given beside it."""
    method = method_of(entry)

    def refused(spec: str, says: str, **kw) -> None:
        with pytest.raises(InvalidInput) as e:
            generate(target, PROMPTS[0], spec, max_new_tokens=4, **kw)
        msg = str(e.value)
        assert "\n" not in msg and says in msg, (spec, msg)

    for p in entry.params:
        for bad in bad_values(p, target):
            refused(f"{method}:{p.name}={bad}", p.name, models=models)
    refused(f"{method}:no_such_param=1", "not param=value", models=models)
    if entry.model is not None:
        refused(method, entry.model.option)
    ints = [p for p in entry.params if p.kind is int and not p.choices and p.default is not None]
    if ints:
        p = ints[0]
        hi = p.bound(target).hi
        v = p.default + 1 if hi is None or p.default + 1 <= hi else p.default - 1
        spec = f"{method}:{p.name}={v}"
        g = Generation(target, PROMPTS[0], spec, models=models, max_new_tokens=4, **{p.name: p.default})
        assert g.params[p.name] == v and g.method == spec  # the spec's value, and its run is named by the spec


def check_reset(target, entry: DrafterEntry, shape: Shape, models: dict, deferred: bool = True, n: int = 8) -> None:
    """One drafter object decodes prompt A twice, then B, then A again (sampling, one seed): every decode of A drafts
    the same trees, accepts the same nodes and commits the same tokens (`reset` leaves nothing of the decode
    before)."""
    d = build_drafter(entry.name, target, models, **method_params(method_of(entry), shape.params, target))

    def run(prompt: str) -> list:
        events: list = []
        res = decode(target, encode_prompt(target, prompt), {entry.name: d}, max_new_tokens=n, deferred=deferred,
                     sampling=Sampling(1.0, seed=3), listeners=(events.append,))
        return [res.new_ids.tolist()] + [(e.tree.tokens.tolist(), e.tree.parents.tolist(), e.accepted.tolist())
                                         for e in events]

    first = run(PROMPTS[0])
    again = run(PROMPTS[0])
    run(PROMPTS[2])
    assert again == first and run(PROMPTS[0]) == first, f"{entry.name} {shape.name}: a decode depends on the one before"


def check_conformance(entry: DrafterEntry, target, models: Models, ar: ARTokens, bf16_target=None,
                      sampling_target=None, seed0: int = 0) -> None:
    """Every check on one entry, every shape (bf16 and sampling where those targets are given): for a test whose
    drafter is registered only for its own duration."""
    for shape in shapes_of(entry):
        for deferred in (True, False):
            check_greedy(target, entry, shape, models.of(entry, shape, target), deferred, ar)
        if bf16_target is not None:
            check_greedy(bf16_target, entry, shape, models.of(entry, shape, bf16_target), True, ar, PROMPTS[2:3])
        check_catch_up(target, entry, shape, models.of(entry, shape, target))
        check_reset(target, entry, shape, models.of(entry, shape, target))
    if sampling_target is not None:
        for i, shape in enumerate(sampled_shapes(entry)):
            check_sampling(sampling_target, entry, shape, models.of(entry, shape, sampling_target), seed0 + 10_000 * i)
    check_bad_parameters(target, entry, models.of(entry, shapes_of(entry)[0], target))


# ---- the tests: every registered drafter, every shape ---------------------------------------------------------------

@DEFERRED_FAST
@pytest.mark.parametrize("name,shape", cases())
def test_greedy_equals_ar(deep, models, ar, name, shape, deferred):
    """fp32, the shape's random model."""
    entry = drafters()[name]
    check_greedy(deep, entry, shape, models.of(entry, shape, deep), deferred, ar)


@pytest.mark.slow
@pytest.mark.parametrize("name,shape", cases())
def test_greedy_equals_ar_in_bf16(deep_bf16, models, ar, name, shape):
    """bf16, the target in exact mode (where deferred or not changes nothing of a row's logits: deferred only), the
    random model in bf16, one prompt."""
    entry = drafters()[name]
    check_greedy(deep_bf16, entry, shape, models.of(entry, shape, deep_bf16), True, ar, PROMPTS[2:3])


@pytest.mark.slow
@DEFERRED
@pytest.mark.parametrize("name,shape", cases(trained_shapes, trained_fixture))
def test_greedy_equals_ar_with_a_trained_model(deep, models, ar, name, shape, deferred, request):
    """The model conftest.py trains for the drafter's role agrees with the target: its drafts are really accepted
    (for 30% of the tokens at least), and the output is still AR's."""
    entry = drafters()[name]
    trained = request.getfixturevalue(trained_fixture(entry))
    accepted, total = check_greedy(deep, entry, shape, models.of(entry, shape, deep, trained), deferred, ar)
    assert accepted > 0.3 * total, (accepted, total)


# the decode's sampling in the sampling checks: plain, nucleus and top-k (the top-k 20, scaled to the
# 8-token vocabulary of tiny_v8: 3 of 8 tokens kept, so the target's and the drafter's supports differ)
SAMPLINGS = {"T1": Sampling(1.0), "T0.7-top_p0.9": Sampling(0.7, top_p=0.9), "T1-top_k5": Sampling(1.0, top_k=5)}


def sampled_cases() -> list:
    """(drafter, shape, sampling): every sampled shape plainly and under top-k; chains under nucleus sampling too. A
    tree draws its children from the same transformed q as its chain, and its verification takes p and q as given,
    so the nucleus case of a tree adds nothing the chain's and top-k's do not check (top-k, which leaves the two
    distributions different supports, stays for trees)."""
    return [pytest.param(*c.values, k, id=f"{c.id}-{k}") for c in cases(sampled_shapes) for k in SAMPLINGS
            if k != "T0.7-top_p0.9" or c.values[1].name != "tree"]


@pytest.mark.slow
@pytest.mark.parametrize("name,shape,sampling", sampled_cases())
def test_sampling_keeps_the_target_distribution(tiny_v8, models, name, shape, sampling):
    """Chains and trees (a tree's children drawn from q at T > 0: the drafter's default scheme)."""
    entry = drafters()[name]
    seed0 = 100_000 * (1 + list(drafters()).index(name)) + 10_000 * shapes_of(entry).index(shape) + \
        1_000_000 * list(SAMPLINGS).index(sampling)
    check_sampling(tiny_v8, entry, shape, models.of(entry, shape, tiny_v8), seed0, SAMPLINGS[sampling])


@pytest.mark.parametrize("name,shape", cases())
def test_catch_up_in_one_call_drafts_what_round_by_round_does(deep, models, name, shape):
    entry = drafters()[name]
    check_catch_up(deep, entry, shape, models.of(entry, shape, deep))


@pytest.mark.parametrize("name", list(drafters()))
def test_bad_parameters_are_refused_in_one_line(deep, models, name):
    entry = drafters()[name]
    check_bad_parameters(deep, entry, models.of(entry, shapes_of(entry)[0], deep))


@pytest.mark.parametrize("name,shape", cases())
def test_reset_forgets_the_decode_before(deep, models, name, shape):
    entry = drafters()[name]
    check_reset(deep, entry, shape, models.of(entry, shape, deep))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["eagle3", "sps"])
def test_sampling_with_int8_drafter_weights_keeps_the_target_distribution(tiny_v8, name):
    """A drafter whose weights `--drafter-weights int8` made int8 (`speclab.models.quantize_drafter`), beside a bf16
    target: its draws are tested against the q they were drawn from, so the first two sampled tokens still follow the
    target's exact joint distribution (with the power check)."""
    from speclab.models import int8_drafters, quantize_drafter

    if not int8_drafters("int8", "cpu"):
        pytest.skip("no AVX512-VNNI here (the int8 product)")
    target = Target(copy.deepcopy(tiny_v8.model).to(torch.bfloat16), NoTok())
    target.eos_ids = []
    entry = drafters()[name]
    model = entry.model.random(target, SEED)
    assert quantize_drafter(model, target, "int8")
    check_sampling(target, entry, shapes_of(entry)[0], {entry.model.role: model}, 7_000_000)
