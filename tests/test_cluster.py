"""Benches and grids on a local Ray instance (`speclab.cluster`, `--ray`): two single-thread workers give the same
outputs as one process, one trace whose invariants hold, nothing lost or duplicated when a worker is killed, and
one line for every bad option."""
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from conftest import DEVICE
from helpers import assert_one_error_line
from speclab.bench.run import BenchConfig, run_bench
from speclab.trace import TraceStore

pytestmark = pytest.mark.slow

METHODS = ["ar", "sps", "pld"]


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray instance for the module (2 CPUs: two single-thread workers), shut down after."""
    if DEVICE != "cpu":  # the GPU machine's image has no Ray (the CPU suite's set-up installs it: never skipped there)
        pytest.importorskip("ray")
    import ray
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             object_store_memory=128 * 2**20)
    yield
    ray.shutdown()


def _paths(model_dir):
    from speclab.models import ModelPaths
    return ModelPaths(str(model_dir["qwen3"]), {"draft": str(model_dir["qwen3_draft"])}, dtype="fp32")


def _busy_workers() -> list[int]:
    """Pids of Ray workers running a task now (Ray names the process after the method it runs)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "cmdline").read_bytes().startswith(b"ray::Worker.run"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def _kill_one_busy_worker(killed: list, stop: threading.Event) -> None:
    while not stop.is_set() and not killed:
        for pid in _busy_workers():
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        time.sleep(0.01)


def _invariants(store: TraceStore, bench_id: str) -> None:
    """The merged trace is whole: every row belongs to a run of the trace, run ids are unique, each traced run's
    rounds commit exactly its tokens, each round's accepted draft nodes are its accepted count, and every
    (prompt, method) ran exactly once."""
    q = store.query
    for t in ("rounds", "tokens", "draft_nodes", "router_decisions"):
        assert q(f"SELECT count(*) AS n FROM {t} WHERE run_id NOT IN (SELECT run_id FROM runs)").n[0] == 0, t
    assert q("SELECT count(*) - count(DISTINCT run_id) AS d FROM runs").d[0] == 0
    per_run = q("""SELECT r.run_id, r.new_tokens, sum(x.committed) AS committed,
                          (SELECT count(*) FROM tokens t WHERE t.run_id = r.run_id) AS tokens
                   FROM runs r JOIN rounds x USING (run_id) WHERE r.bench_id = ? GROUP BY ALL""", [bench_id])
    assert len(per_run) and (per_run.committed == per_run.new_tokens).all()
    assert (per_run.tokens == per_run.new_tokens).all()
    nodes = q("""SELECT x.n_accepted, (SELECT count(*) FROM draft_nodes d WHERE d.run_id = x.run_id
                 AND d.round = x.round AND d.accepted) AS acc FROM rounds x JOIN runs USING (run_id)
                 WHERE bench_id = ?""", [bench_id])
    assert (nodes.n_accepted == nodes.acc).all()
    dup = q("SELECT prompt_id, method, count(*) AS n FROM runs WHERE bench_id = ? GROUP BY ALL HAVING n > 1",
            [bench_id])
    assert dup.empty, dup


def test_a_cluster_bench_equals_one_process_and_survives_a_killed_worker(ray_local, qwen3, qwen3_draft, model_dir,
                                                                          tmp_path):
    from speclab import cluster
    cfg = dict(suite="zoo", methods=METHODS, limit=1, max_new_tokens=24, peers=False)
    db = tmp_path / "t.duckdb"
    with TraceStore(db) as store:  # the same bench in this process: the reference (and an earlier bench in the trace)
        local = run_bench(BenchConfig(**cfg), qwen3, {"draft": qwen3_draft}, store, log=lambda s: None)
        before = store.query("SELECT count(*) AS n FROM runs").n[0]
    killed, stop = [], threading.Event()
    killer = threading.Thread(target=_kill_one_busy_worker, args=(killed, stop), daemon=True)
    killer.start()
    said = []
    try:
        bench_id = cluster.run_bench(cluster.Cluster("local", workers=2, threads=1), BenchConfig(**cfg),
                                     _paths(model_dir), str(db), log=said.append)
    finally:
        stop.set()
    assert killed, "no worker was busy to kill"
    with TraceStore(db) as store:
        runs = store.runs()
        ours, ref = runs[runs.bench_id == bench_id], runs[runs.bench_id == local]
        assert len(ref) == before and len(ours) == len(ref) == 8 * len(METHODS)  # nothing lost, none twice
        key = ["prompt_id", "method"]
        both = ours.merge(ref, on=key, suffixes=("", "_local"))
        assert len(both) == len(ours) and (both.output_hash == both.output_hash_local).all()
        # (the killed worker may still be reloading its models when the other one has finished)
        assert set(ours.worker) <= {"w0", "w1"} and ours.node.notna().all() and ref.worker.isna().all()
        # a prompt's runs all on one worker: its speedups are over AR decoded there
        assert (ours.groupby("prompt_id").worker.nunique() == 1).all()
        bench = store.query("SELECT * FROM benches WHERE bench_id = ?", [bench_id]).iloc[0]
        assert bench.status == "done" and bench.retries >= 1 and "2 worker(s) of 1 thread(s)" in bench.cluster
        assert any("died during task" in s for s in said)
        _invariants(store, bench_id)
        from speclab.bench.results import bench_report
        report = bench_report(store, bench_id).text
        assert "## Where it ran" in report and f"{bench.retries} task(s) retried" in report


def test_a_cluster_grid_decodes_what_one_process_does(ray_local, qwen3, qwen3_draft, model_dir):
    from speclab import cluster
    from speclab.bench.grid import param_grid
    grid = {"k": ["2", "3"]}
    local = param_grid(qwen3, {"draft": qwen3_draft}, "sps", grid, suite="demo", limit=1, max_new_tokens=12,
                       log=lambda s: None)
    ours, out = cluster.param_grid(cluster.Cluster("local", workers=2), _paths(model_dir), "sps", grid, "demo", 1, 12,
                                   [], log=lambda s: None)
    cols = ["k", "tau", "equal_to_ar"]
    def by_k(df):
        return df.sort_values("k")[cols].reset_index(drop=True)
    assert by_k(ours).equals(by_k(local)) and len(out.results) == 4 and out.retries == 0
    assert {w["worker"] for w, _ in out.results.values()} <= {"w0", "w1"}
    assert {r["worker"] for r in out.ready} == {"w0", "w1"}


@pytest.mark.parametrize("argv,says", [
    (["--ray", "127.0.0.1:1"], "no Ray cluster answers there"),
    (["--ray", "not an address"], "give 'local' or a cluster's address as host:port"),
    (["--workers", "2"], "--workers and --worker-threads go with --ray"),
    (["--ray", "local", "--workers", "64"], "room for at most"),
])
def test_bad_cluster_options_are_one_line_before_anything_is_written(argv, says, model_dir, tmp_path, capsys,
                                                                     ray_local):
    db = tmp_path / "t.duckdb"
    assert_one_error_line(["bench", "--model", str(model_dir["qwen3"]), "--methods", "ar", "--limit", "1",
                           "--no-peers", "--db", str(db), "--report", str(tmp_path / "r.md"), *argv], says, capsys)
    assert not db.exists()


def test_router_training_checks_the_address_before_any_model_loads(tmp_path, capsys):
    assert_one_error_line(["train", "router", "--out", str(tmp_path / "run"), "--ray", "127.0.0.1:1"],
                          "no Ray cluster answers there", capsys)
    assert_one_error_line(["train", "router", "--out", str(tmp_path / "run"), "--workers", "2"],
                          "--workers and --worker-threads go with --ray", capsys)
    assert not (tmp_path / "run").exists()


def test_a_command_without_ray_refuses_the_option(capsys):
    assert_one_error_line(["generate", "--prompt", "x", "--ray", "local"], "unrecognized arguments: --ray", capsys)


def test_a_worker_that_cannot_load_its_models_is_named_with_its_node(ray_local, model_dir, tmp_path, capsys):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(model_dir["qwen3"], broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not weights")
    db = tmp_path / "t.duckdb"
    line = assert_one_error_line(["bench", "--model", str(broken), "--methods", "ar", "--limit", "1", "--no-peers",
                                  "--dtype", "fp32", "--ray", "local", "--db", str(db),
                                  "--report", str(tmp_path / "r.md")], "cannot load the models", capsys)
    assert "on node " in line and "worker w" in line
    assert not db.exists()


def test_ctrl_c_keeps_the_prompts_that_finished_and_marks_the_bench(ray_local, model_dir, tmp_path, monkeypatch):
    import ray

    from speclab import cluster
    db = tmp_path / "t.duckdb"
    real_wait, calls = ray.wait, []

    def wait(*a, **kw):  # Ctrl-C on the driver while it waits for its third result
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_wait(*a, **kw)
    monkeypatch.setattr(ray, "wait", wait)
    with pytest.raises(KeyboardInterrupt):
        cluster.run_bench(cluster.Cluster("local", workers=2), BenchConfig(suite="demo", methods=["ar", "pld"],
                          limit=1, max_new_tokens=12, peers=False), _paths(model_dir), str(db), log=lambda s: None)
    with TraceStore(db) as store:
        bench = store.query("SELECT * FROM benches").iloc[0]
        runs = store.runs()
        assert bench.status == "interrupted" and set(runs.status) == {"done"}
        assert runs.prompt_id.nunique() == 2 and len(runs) == 2 * 4  # two prompts, each whole: 2 methods + untraced
        _invariants(store, bench.bench_id)


def test_router_pairs_profiled_on_the_cluster_equal_one_process_in_prompt_order(ray_local, deep, trained_eagle3,
                                                                                 trained_dflash, tmp_path):
    """`speclab train router --ray`: the workers profile the prompts (each loading the models once, in the driver's
    dtype) and `collect` keeps the pairs in prompt order, checkpointed as they come, equal to one process's."""
    import numpy as np
    import torch

    from speclab import cluster
    from speclab.train.router import RouterTrainConfig, collect, corpus_prompts
    rng = np.random.default_rng(0)
    data = {d: {"train": rng.integers(0, 200, 500)} for d in ("code", "stories", "literature", "math")}
    cfg = RouterTrainConfig(corpus_dir="-", out_dir="-", sequences=6, prompt_tokens=8, new_tokens=8)
    prompts = corpus_prompts(data, cfg)
    models = {"eagle3": trained_eagle3, "dflash": trained_dflash}
    for role, m in models.items():
        m.save(tmp_path / role, dtype=torch.float32)
    local = collect(deep, models, prompts, cfg, tmp_path / "local.pt", log=lambda s: None)
    profiles = cluster.router_profiles(cluster.Cluster("local", workers=2), deep.name, str(tmp_path / "eagle3"),
                                       str(tmp_path / "dflash"), deep, prompts, cfg.new_tokens, log=lambda s: None)
    ours = collect(deep, models, prompts, cfg, tmp_path / "ours.pt", log=lambda s: None, profiles=profiles)
    assert ours["domain"] == local["domain"] and [int(s[0]) for s in ours["seq"]] == list(range(6))
    for k in ("delta", "al", "entropy"):
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours[k], local[k])), k
    assert len(torch.load(tmp_path / "ours.pt")["al"]) == 6  # checkpointed


def test_bench_profiles_made_on_the_cluster_equal_one_process(ray_local, deep, trained_eagle3, trained_dflash,
                                                               tmp_path):
    """`speclab profile --ray`: each prompt of a bench profiled by a worker (the models loaded there in the bench's
    dtype), saved in the trace in the bench's prompt order, what this process profiles."""
    import numpy as np
    import torch

    from speclab import cluster
    from speclab.bench.routing import profile_bench
    from speclab.models import ModelPaths
    from speclab.routing import replay
    models = {"eagle3": trained_eagle3, "dflash": trained_dflash}
    for role, m in models.items():
        m.save(tmp_path / role, dtype=torch.float32)
    with TraceStore(tmp_path / "t.duckdb") as store:
        bench_id = run_bench(BenchConfig(suite="demo", methods=["ar"], limit=1, max_new_tokens=12, peers=False,
                                         untraced=False), deep, {}, store, log=lambda s: None)
        local = profile_bench(store, bench_id, deep, models, log=lambda s: None)
        paths = ModelPaths(deep.name, {r: str(tmp_path / r) for r in models}, dtype="fp32")
        on_ray = cluster.bench_profiles(cluster.Cluster("local", workers=2), paths, lambda s: None)
        ours = profile_bench(store, bench_id, deep, models, log=lambda s: None, profiles=on_ray)
        saved, _ = replay.load_profiles(store, bench_id)
    assert [p.prompt_id for p in ours] == [p.prompt_id for p in local] and len(ours) == 4
    saved = {p.prompt_id: p for p in saved}
    assert all(np.array_equal(a.accepted, b.accepted) and np.array_equal(a.accepted, saved[a.prompt_id].accepted)
               for a, b in zip(ours, local))


def test_a_command_joins_a_running_cluster_with_its_token(ray_local, model_dir, tmp_path):
    """`ray start --head` then `speclab bench --ray HOST:PORT` in another process, neither told RAY_AUTH_MODE: the
    head turns token authentication on because a token is saved in ~/.ray (this module's local instance saved one),
    and speclab, finding it, sends it. The runs land in the trace; the head stops after."""
    import socket
    import subprocess
    import sys

    from helpers import run_cli
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray_cli = str(Path(sys.executable).parent / "ray")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    assert (Path.home() / ".ray" / "auth_token").is_file()
    head = subprocess.Popen([ray_cli, "start", "--head", "--block", "--port", str(port), "--num-cpus", "1",
                             "--include-dashboard=false", "--disable-usage-stats"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        db = tmp_path / "t.duckdb"
        for _ in range(60):  # the head answers on its port
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        r = run_cli("bench", "--model", str(model_dir["qwen3"]), "--methods", "ar", "--limit", "1",
                    "--max-new-tokens", "4", "--no-peers", "--no-untraced", "--dtype", "fp32", "--ray",
                    f"127.0.0.1:{port}", "--db", str(db), "--report", str(tmp_path / "r.md"), timeout=180, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        with TraceStore(db, read_only=True) as store:
            runs = store.runs()
            assert len(runs) == 4 and set(runs.worker) == {"w0"}
            assert "ray 127.0.0.1" in store.query("SELECT cluster FROM benches").cluster[0]
    finally:
        head.terminate()
        head.wait(60)
