"""Fixtures: tiny Qwen3 / Llama models built from configs (no downloads), saved as HF directories, and the tiny
EAGLE-3 and DFlash drafters trained once per session on the 4-layer target. The builders live in helpers.py (the
names re-exported here keep `from conftest import ...` working)."""
from __future__ import annotations

import gc
import os

import pytest
import torch

from helpers import (  # noqa: F401  (PROMPTS, own_text_windows, tiny_config: re-exported)
    PROMPTS,
    NoTok,
    build_tiny,
    own_text_windows,
    perturbed,
    tiny_config,
    train_tiny_dflash,
    train_tiny_eagle3,
)
from speclab.core.target import Target

# `make test` runs the files on one worker per core (pytest-xdist, `-n auto --dist loadfile`): the tiny models'
# decodes are Python-bound, so two workers of one thread each finish the suite in about 60% of the time one worker
# of two threads takes. Each worker (and every process a test starts) gets its share of the cores.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, (os.cpu_count() or 2) // WORKERS))
torch.set_num_threads(THREADS)
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(THREADS)

# SPECLAB_TEST_DEVICE=cuda (scripts/device_tests.sh, on the lent GPU machine): the tiny models below load on that
# device, and only the tests that use one of them run (the rest are the CPU suite's, which CI runs)
DEVICE = os.environ.get("SPECLAB_TEST_DEVICE", "cpu")
DEVICE_FIXTURES = {"qwen3", "llama", "qwen3_hf", "qwen3_draft_hf", "qwen3_draft", "deep", "tiny_v8", "tiny_vocab",
                   "trained_eagle3", "trained_dflash"}


@pytest.fixture(scope="session", autouse=True)
def dtype_cache(tmp_path_factory):
    """--dtype auto's per-user cache in a folder of the session's (subprocesses inherit it): the suite never reads
    or writes the user's ~/.cache, and measures the zoo's decision at most once."""
    old = os.environ.get("SPECLAB_CACHE_DIR")
    os.environ["SPECLAB_CACHE_DIR"] = str(tmp_path_factory.mktemp("speclab-cache"))
    yield os.environ["SPECLAB_CACHE_DIR"]
    if old is None:
        os.environ.pop("SPECLAB_CACHE_DIR", None)
    else:
        os.environ["SPECLAB_CACHE_DIR"] = old


@pytest.fixture(autouse=True)
def worker_threads():
    """Every test ends with the worker's share of the cores (THREADS) for torch. An in-process training used to set
    torch's threads to its own `threads` (2) and leave them so: afterwards each small op of that worker ran on two
    threads, the second one spinning beside the first, and with the other worker on the second core every later test
    of the worker ran up to 10 times slower (a sampling test 40 s instead of 4). The trainings now hand the threads
    back (`speclab.train.threads.own_threads`); this keeps any other test from leaving another count behind."""
    yield
    if torch.get_num_threads() != THREADS:
        torch.set_num_threads(THREADS)


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    """Everything alive when a test file starts (the imports, the session's models and caches: millions of objects
    in a long-lived xdist worker) kept out of the garbage collector's walks for that file (`gc.freeze`), and handed
    back after it (`gc.unfreeze`: garbage among them is still collected later). Behind 3 million live objects a
    sampling test's 1,200 decodes took 41 s against 4 s, in the collector (the suite's other 10x slowdown was torch's
    threads: `worker_threads`)."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    paths = {"qwen3": build_tiny("qwen3", d / "qwen3", seed=0), "llama": build_tiny("llama", d / "llama", seed=1)}
    paths["qwen3_draft"] = perturbed(paths["qwen3"], d / "qwen3_draft", noise=0.15, seed=2)
    return paths


@pytest.fixture(scope="session")
def qwen3(model_dir) -> Target:
    return Target.load(model_dir["qwen3"], dtype="fp32", device=DEVICE)


@pytest.fixture(scope="session")
def llama(model_dir) -> Target:
    return Target.load(model_dir["llama"], dtype="fp32", device=DEVICE)


@pytest.fixture(scope="session")
def qwen3_hf(model_dir) -> Target:
    """The same tiny Qwen3 on the transformers forward (DynamicCache) instead of speclab's lean forward."""
    return Target.load(model_dir["qwen3"], dtype="fp32", backend="hf", device=DEVICE)


@pytest.fixture(scope="session")
def qwen3_draft_hf(model_dir) -> Target:
    return Target.load(model_dir["qwen3_draft"], dtype="fp32", backend="hf", device=DEVICE)


@pytest.fixture(scope="session")
def qwen3_draft(model_dir) -> Target:
    return Target.load(model_dir["qwen3_draft"], dtype="fp32", device=DEVICE)


@pytest.fixture(scope="session")
def deep_path(tmp_path_factory):
    return build_tiny("qwen3", tmp_path_factory.mktemp("deep") / "t4", seed=7, layers=4)


@pytest.fixture(scope="session")
def deep(deep_path):
    """A tiny 4-layer Qwen3 target with the zoo tokenizer (which reserves <|mask|> = 2): EAGLE-3 reads three
    distinct layers of it, DFlash three as well."""
    return Target.load(deep_path, dtype="fp32", device=DEVICE)


def on_cpu(deep, deep_path) -> Target:
    """`deep` where training runs: on the CPU, as `speclab train` does (its teacher loads there)."""
    return deep if DEVICE == "cpu" else Target.load(deep_path, device="cpu", dtype="fp32")


@pytest.fixture(scope="session")
def tiny_v8(tmp_path_factory):
    """A tiny 4-layer target over an 8-token vocabulary without a tokenizer (exact joint distributions are cheap):
    the end-to-end sampling tests of drafters that read target layers."""
    from transformers import AutoModelForCausalLM

    from test_sampling import V

    path = build_tiny("qwen3", tmp_path_factory.mktemp("v8") / "t", seed=5, vocab_size=V, tokenizer=False,
                      hidden=32, init=0.08, layers=4)
    target = Target(AutoModelForCausalLM.from_pretrained(path).eval().to(DEVICE), NoTok())
    target.eos_ids = []
    return target


@pytest.fixture(scope="session")
def tiny_vocab(tmp_path_factory):
    """A tiny target and draft over an 8-token vocabulary (exact joint distributions are cheap): the end-to-end
    sampling tests (test_sampling.py, the batched sampler in test_batch.py)."""
    from transformers import AutoModelForCausalLM

    from test_sampling import V

    d = tmp_path_factory.mktemp("tiny_vocab")

    def make(seed, name):
        path = build_tiny("qwen3", d / name, seed=seed, vocab_size=V, tokenizer=False, hidden=32, init=0.08)
        model = Target(AutoModelForCausalLM.from_pretrained(path).eval().to(DEVICE), NoTok())
        model.eos_ids = []
        return model
    return make(3, "target"), make(4, "draft")


def once_per_run(tmp_path_factory, name: str, build):
    """`build()` in the first pytest-xdist worker that asks, saved where this run's workers all look (the workers'
    common base folder), and loaded by the others instead of built again (pytest-xdist's recipe for a session
    fixture made once). Only for builds that are deterministic: the workers' own fixtures they start from (`deep`,
    from a fixed seed) are equal. Without xdist it just builds (the base folder's parent is then shared by runs)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build()
    from filelock import FileLock
    path = tmp_path_factory.getbasetemp().parent / f"{name}.pt"
    with FileLock(f"{path}.lock"):
        if path.is_file():
            return torch.load(path, weights_only=False)
        made = build()
        torch.save(made, path)
        return made


@pytest.fixture(scope="session")
def trained_eagle3(deep, deep_path, tmp_path_factory):
    """The tiny EAGLE-3 drafter trained on `deep` (about 15 s), once per run for every module that decodes with it."""
    made = once_per_run(tmp_path_factory, "trained_eagle3", lambda: train_tiny_eagle3(on_cpu(deep, deep_path)))
    return made.to(DEVICE)


@pytest.fixture(scope="session")
def trained_dflash(deep, deep_path, tmp_path_factory):
    """The tiny DFlash drafter (Markov head of rank 8) trained on `deep` (about 15 s), once per run for every module
    that decodes with it."""
    made = once_per_run(tmp_path_factory, "trained_dflash", lambda: train_tiny_dflash(on_cpu(deep, deep_path)))
    return made.to(DEVICE)


# fixtures that cost tens of seconds of CPU on a 2-core machine: every test that needs one, directly or through
# another fixture, is marked slow (`make test-fast` skips it) wherever it is written
SLOW_FIXTURES = {"trained_eagle3", "trained_dflash"}


def pytest_collection_modifyitems(config, items):
    off_device = pytest.mark.skip(reason=f"SPECLAB_TEST_DEVICE={DEVICE}: uses none of the tiny models' fixtures")
    training = pytest.mark.skip(reason=f"SPECLAB_TEST_DEVICE={DEVICE}: checks training code, which runs on the CPU")
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if SLOW_FIXTURES & names:
            item.add_marker(pytest.mark.slow)
        if DEVICE != "cpu" and not DEVICE_FIXTURES & names:
            item.add_marker(off_device)
        elif DEVICE != "cpu" and item.get_closest_marker("cpu_only"):
            item.add_marker(training)
