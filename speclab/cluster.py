"""Benches, grids and router profiles on a Ray cluster (`--ray local|ADDRESS` on `speclab bench`, `grid`, `profile`
and `train router`): Ray places the work, speclab only says what a task is.

- **Workers.** One Ray actor per worker, `threads` CPUs each (torch runs that many threads). A worker loads its
  models once, on its own node, in that node's device and dtype (`--dtype auto` measures there), warms up, then
  decodes tasks. A worker that cannot load its models is named with its node, in one line, before anything is
  written.
- **Tasks.** A task is one prompt with every method of the bench (its AR included, in the prompt's rotated order),
  so each speedup is paired with AR decoded on the same worker; its key is the prompt's index (idempotent: a result
  that comes twice is taken once). Each worker has one task in flight at a time, so a worker that dies loses one
  task: Ray restarts the worker (`max_restarts`) and the task goes back to the queue for the next free worker, and
  the bench counts the retry.
- **One trace.** A worker decodes each task into an in-memory trace and returns its rows as Arrow tables
  (`TraceStore.export_runs`); the driver merges every task's runs into the user's trace in one transaction at the
  end (`TraceStore.merge_runs`): run ids given anew, each run's `node` and `worker` on its row, the bench row with
  the cluster and its retries. A merge that fails leaves the trace as it was. Ctrl-C stops the workers and merges
  the tasks that finished, with the bench marked `interrupted`.
"""
from __future__ import annotations

import os
import socket
from collections import deque
from dataclasses import dataclass, field

from speclab.errors import InvalidInput, SpeclabError
from speclab.models import ModelPaths

MAX_RESTARTS = 3  # a worker killed more often than this is given up (its tasks go to the others)


@dataclass
class Cluster:
    """Where the work runs: `address` "local" (a Ray instance started for this command on this machine) or a
    running cluster's address (host:port, ray://host:port); `workers` (None: as many as the cluster's CPUs allow)
    of `threads` CPUs each."""
    address: str = "local"
    workers: int | None = None
    threads: int = 1
    started: bool = False  # this process started Ray (`start`), and `stop` shuts it down


def check_address(address: str) -> None:
    """'local', or a host:port (ray://host:port) that answers: one line otherwise, before anything starts."""
    if address == "local":
        return
    hostport = address.removeprefix("ray://")
    host, colon, port = hostport.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in hostport:
        raise InvalidInput(f"--ray {address!r}: give 'local' or a cluster's address as host:port "
                           "(e.g. 10.0.0.5:6379, or ray://10.0.0.5:10001 for Ray Client)")
    try:
        with socket.create_connection((host, int(port)), timeout=3):
            pass
    except OSError as e:
        raise InvalidInput(f"--ray {address}: no Ray cluster answers there ({e.strerror or e}); start one with "
                           "`ray start --head` or use --ray local") from None


def _require_ray():
    try:
        import ray
    except ImportError:
        raise InvalidInput("--ray needs the ray package (`pip install ray`; the README's set-up installs it)") from None
    return ray


def start(cl: Cluster):
    """Connect to (or start) the cluster; -> the number of workers, checked against its CPUs."""
    token = _auth_token()
    if cl.address != "local":  # before ray is imported: it reads these once
        if token and "RAY_AUTH_MODE" not in os.environ:
            # Ray (2.5x on) starts clusters with token authentication and sends the token to an explicit address only
            # when told to: the token `ray start` saved here, or one given as RAY_AUTH_TOKEN(_PATH)
            os.environ["RAY_AUTH_MODE"] = "token"
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "error")  # not a line a second while it cannot connect
    ray = _require_ray()
    if not ray.is_initialized():
        cl.started = True
        kw = dict(include_dashboard=False, log_to_driver=False, logging_level="ERROR", configure_logging=True)
        if cl.address == "local":
            # address "local": a new instance even where another cluster runs here (or a dead one left its address)
            ray.init(address="local", num_cpus=os.cpu_count(), object_store_memory=256 * 2**20, **kw)
        else:
            said, err = _quiet_stderr(lambda: ray.init(address=cl.address, **kw))  # Ray's C++ client says each retry
            if err is not None:  # a port that answers but is no Ray cluster, or one that wants another token
                why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                sent = os.environ.get("RAY_AUTH_MODE", "").lower() == "token"
                refused = "Unauthenticated" in said or "InvalidAuthToken" in said
                if refused:
                    why = "it refused the authentication token given here" if sent else "it asks for a token"
                hint = "" if sent and not refused else ("; a cluster with token authentication needs its token here: "
                                                        "RAY_AUTH_TOKEN, or the head's ~/.ray/auth_token copied")
                raise InvalidInput(f"--ray {cl.address}: cannot join a Ray cluster there ({why}){hint}")
    cpus = int(ray.cluster_resources().get("CPU", 0))
    most = cpus // cl.threads
    if most < 1:
        raise InvalidInput(f"the Ray cluster has {cpus} CPU(s): not enough for one worker of {cl.threads} thread(s)")
    if cl.workers is not None and cl.workers > most:
        raise InvalidInput(f"--workers {cl.workers}: the Ray cluster has {cpus} CPU(s), room for at most {most} "
                           f"worker(s) of {cl.threads} thread(s)")
    return cl.workers or most


def _quiet_stderr(fn) -> tuple[str, BaseException | None]:
    """fn() with this process's stderr (file descriptor 2, where Ray's C++ client writes) caught: (what it wrote,
    the exception fn raised or None)."""
    import sys
    import tempfile
    sys.stderr.flush()
    with tempfile.TemporaryFile() as caught:
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        err = None
        try:
            fn()
        except Exception as e:
            err = e
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        return caught.read().decode(errors="replace"), err


def _auth_token() -> bool:
    """Whether a Ray authentication token is at hand: RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, or the
    one `ray start` saves (~/.ray/auth_token)."""
    from pathlib import Path
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token"
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or Path(path).is_file()


def stop(cl: Cluster) -> None:
    """Shut down (or leave) what `start` started or joined; nothing where it never ran."""
    if not cl.started:
        return
    ray = _require_ray()
    if ray.is_initialized():
        ray.shutdown()
    cl.started = False


class Worker:
    """A worker (a Ray actor): its job's models loaded once on its node, then one task at a time."""

    def __init__(self, job, name: str, threads: int):
        import torch
        torch.set_num_threads(threads)
        self.where = {"node": socket.gethostname(), "worker": name}
        self.job, self.error, self.size = job, None, 0
        try:
            self.size = job.setup()
        except SpeclabError as e:
            self.error = str(e)
        except Exception as e:  # reported by the driver, named with this node
            self.error = f"{type(e).__name__}: {e}"

    def ready(self) -> dict:
        return {**self.where, "size": self.size, "error": self.error, **self.job.info()}

    def run(self, i: int):
        return i, self.where, self.job.run(i, self.where)


@dataclass
class Outcome:
    """What the cluster returned: task key -> result, who ran what, and what went wrong."""
    results: dict = field(default_factory=dict)
    ready: list = field(default_factory=list)  # each worker's `ready()`
    retries: int = 0
    status: str = "done"  # or interrupted / failed
    error: BaseException | None = None


def run_tasks(cl: Cluster, job, label: str, log=print, on_result=None) -> Outcome:
    """Every task of `job` (a bench or grid job: `setup() -> number of tasks`, `run(i, where)`, `info()`) on the
    cluster's workers, with progress across them (tasks done of total, per worker, ETA). A worker that dies has its
    task retried on the next free worker (Ray restarts the dead one); Ctrl-C or a failed task stops the workers and
    returns what finished (`status` says which). `on_result(i, result)`: called as each task's result comes."""
    n_workers = start(cl)  # first: it sets what ray reads when imported
    ray = _require_ray()
    from ray.exceptions import RayActorError

    from speclab.progress import Progress
    actor = ray.remote(num_cpus=cl.threads, max_restarts=MAX_RESTARTS, max_task_retries=0)(Worker)
    workers = [actor.remote(job, "w0", cl.threads)]  # each worker loads its models and warms up as it starts
    out = Outcome()
    try:
        if getattr(job, "measures_dtype", False):  # --dtype auto: the first worker alone first, so the others on its
            ray.get(workers[0].ready.remote())  # node read its decision from the node's cache instead of measuring
        workers += [actor.remote(job, f"w{k}", cl.threads) for k in range(1, n_workers)]
        out.ready = ray.get([w.ready.remote() for w in workers])
        for r in out.ready:
            if r["error"]:
                raise InvalidInput(f"worker {r['worker']} on node {r['node']} cannot load the models: {r['error']}")
        log(f"ray: {n_workers} worker(s) of {cl.threads} thread(s) ready on {len({r['node'] for r in out.ready})} "
            f"node(s), models loaded")
        sizes = {r["size"] for r in out.ready}
        if len(sizes) != 1:
            raise InvalidInput(f"the workers disagree on the work ({sorted(sizes)} tasks): are the models and data "
                               "the same on every node?")
        total = sizes.pop()
        pending, inflight, idle = deque(range(total)), {}, deque(range(n_workers))
        deaths = [0] * n_workers
        per: dict[str, int] = {}
        prog = Progress(total, label)
        try:
            while pending or inflight:
                while pending and idle:
                    k, i = idle.popleft(), pending.popleft()
                    inflight[workers[k].run.remote(i)] = (k, i)
                if not inflight:
                    raise SpeclabError(f"every worker died ({MAX_RESTARTS + 1} times each): "
                                       f"{len(pending)} task(s) left undone")
                (ref,), _ = ray.wait(list(inflight), num_returns=1)
                k, i = inflight.pop(ref)
                try:
                    i, where, result = ray.get(ref)
                except RayActorError:
                    deaths[k] += 1
                    out.retries += 1
                    pending.appendleft(i)
                    log(f"\nray: worker w{k} died during task {i}: the task goes to the next free worker")
                    if deaths[k] <= MAX_RESTARTS:
                        idle.append(k)  # Ray restarts it (its models load again)
                    continue
                idle.append(k)
                if i not in out.results:  # idempotent: a task's result is taken once
                    out.results[i] = (where, result)
                    if on_result is not None:
                        on_result(i, result)
                    per[where["worker"]] = per.get(where["worker"], 0) + 1
                    prog.update(len(out.results), workers=" ".join(f"{w}:{c}" for w, c in sorted(per.items())))
        except KeyboardInterrupt as e:
            out.status, out.error = "interrupted", e
        except Exception as e:  # a task that raised: the bench stops, what finished is kept
            out.status, out.error = "failed", e
    finally:
        for w in workers:
            ray.kill(w, no_restart=True)
    return out


def task_error(e: BaseException) -> BaseException:
    """A task's error as the user should read it: the worker's own exception (a SpeclabError stays one)."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


# ---- the jobs ----

@dataclass
class BenchJob:
    """`speclab bench` on a worker: the bench's models on its node (`load_bench_sets`), its prompts (`Bench`), and
    per task one prompt decoded into an in-memory trace, returned as Arrow tables."""
    cfg: object  # speclab.bench.run.BenchConfig
    paths: ModelPaths
    bench_id: str
    llamacpp: tuple | None = None  # (pld k, sps k): the llama.cpp peers, where this node has them

    @property
    def measures_dtype(self) -> bool:
        return self.paths.dtype in (None, "auto")

    def setup(self) -> int:
        from speclab.bench.llamacpp import bench_peers
        from speclab.bench.run import Bench
        from speclab.models import load_bench_sets
        target, models, sets = load_bench_sets(self.cfg, self.paths)
        peers = bench_peers(self.cfg, self.paths, target, *self.llamacpp, log=lambda s: None) if self.llamacpp \
            else None
        self.bench = Bench(self.cfg, target, models, sets, peers, bench_id=self.bench_id, log=lambda s: None)
        self.bench.warm_up()
        return len(self.bench.rows)

    def info(self) -> dict:
        b = self.bench if hasattr(self, "bench") else None
        return {"row": b.row() if b else None, "skipped": len(b.skipped) if b else 0, "cfg": self.cfg}

    def run(self, i: int, where: dict):
        import resource

        from speclab.trace import TraceStore
        if not hasattr(self, "scratch"):
            self.scratch = TraceStore(":memory:")  # this worker's runs until the driver has them
        scratch = self.scratch
        try:
            self.bench.decode(i, scratch)
            scratch.execute("UPDATE runs SET node = ?, worker = ?", [where["node"], where["worker"]])
            tables = scratch.export_runs()
        finally:
            for name in scratch.run_tables():
                scratch.execute(f"DELETE FROM {name}")
        return tables, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_bench(cl: Cluster, cfg, paths: ModelPaths, db: str, llamacpp: tuple | None = None, log=print) -> str:
    """`speclab bench --ray`: the bench decoded on the cluster's workers, merged into the trace `db` in one
    transaction (with what finished, marked, after Ctrl-C or a failure, which is raised after). -> the bench id."""

    from speclab.bench.run import Bench, new_bench_id
    from speclab.trace import TraceStore
    bench_id = new_bench_id(cfg.suite)
    job = BenchJob(cfg, paths, bench_id, llamacpp)
    out = run_tasks(cl, job, f"bench {cfg.suite}", log)
    if out.error is not None and not out.results:  # nothing finished: the trace stays as it was
        raise task_error(out.error)
    row = out.ready[0]["row"]
    if out.ready[0]["skipped"]:
        log(f"skipping {out.ready[0]['skipped']} prompt(s) longer than the context")
    parts = [tables for _, (_, (tables, _)) in sorted(out.results.items())]
    runs = [p["runs"].to_pandas() for p in parts]
    import pandas as pd
    overhead = Bench.overhead(pd.concat(runs), out.ready[0]["cfg"]) if out.status == "done" else None
    workers = sorted({(r["node"], r["worker"]) for r in out.ready})
    bench = {**row, "status": out.status, "retries": out.retries, "trace_overhead": overhead,
             "peak_rss_mb": max(rss for _, (_, (_, rss)) in out.results.items()) if out.results else None,
             "cluster": f"ray {cl.address}: {len(workers)} worker(s) of {cl.threads} thread(s) on "
                        f"{len({n for n, _ in workers})} node(s)"}
    with TraceStore(db) as store:
        store.merge_runs(parts, bench)
    if out.error is not None:
        raise task_error(out.error)
    return bench_id


@dataclass
class GridJob:
    """`speclab grid` on a worker: the method's models on its node, the grid's combinations and prompts
    (`speclab.bench.grid.Grid`), and per task one prompt's decodes of every combination and AR."""
    paths: ModelPaths
    method: str
    grid: dict
    suite: str
    limit: int
    max_new_tokens: int
    extra: list
    temperature: float = 0.0
    seed: int = 0

    def setup(self) -> int:
        from speclab.bench.grid import Grid
        from speclab.methods import get_method
        from speclab.models import load_models
        target, models = load_models(self.paths, roles=get_method(self.method).needs)
        self.g = Grid(target, models, self.method, self.grid, self.suite, self.limit, self.max_new_tokens, self.extra,
                      self.temperature, self.seed)
        self.g.warm_up()
        return len(self.g.rows)

    def info(self) -> dict:
        return {"combos": self.g.combos if hasattr(self, "g") else None}

    def run(self, i: int, where: dict):
        return self.g.decode(i)


def param_grid(cl: Cluster, paths: ModelPaths, method: str, grid: dict, suite: str, limit: int, max_new_tokens: int,
               extra: list, log=print, temperature: float = 0.0, seed: int = 0):
    """`speclab grid --ray`: every prompt's decodes on the cluster's workers (AR beside every combination on the same
    worker), summed into the grid's table as in one process (`Grid.table`)."""
    job = GridJob(paths, method, grid, suite, limit, max_new_tokens, extra, temperature, seed)
    out = run_tasks(cl, job, f"grid {method}", log)
    if out.error is not None:
        raise task_error(out.error)
    from speclab.bench.grid import Grid
    return Grid.table(out.ready[0]["combos"], [r for _, (_, r) in sorted(out.results.items())], len(extra),
                      log=log), out


@dataclass
class RouterJob:
    """`speclab train router`'s pairs on a worker: the target and both drafters on its node, in the driver's
    dtype, and per task one corpus prompt's greedy continuation profiled (`train.router.profile_one`)."""
    teacher: str
    eagle3: str
    dflash: str
    dtype: str
    prompts: list  # (domain, prompt ids) of the prompts left to profile, by task
    index: list  # each task's prompt index in the corpus
    new_tokens: int

    def setup(self) -> int:
        from speclab.core.target import Target
        from speclab.drafters.dflash import load_dflash
        from speclab.drafters.eagle3 import load_eagle3
        from speclab.methods import build_method
        from speclab.train.router import drafter_params
        self.target = Target.load(self.teacher, device="cpu", dtype=self.dtype)
        models = {"eagle3": load_eagle3(self.eagle3, self.target), "dflash": load_dflash(self.dflash, self.target)}
        self.drafters, _ = build_method("whiflash-entropy", self.target, models, drafter_params(self.target))
        return len(self.prompts)

    def info(self) -> dict:
        return {}

    def run(self, k: int, where: dict):
        from speclab.train.router import profile_one
        dom, ids = self.prompts[k]
        return profile_one(self.target, self.drafters, ids, dom, self.index[k], self.new_tokens)


def router_profiles(cl: Cluster, teacher: str, eagle3: str, dflash: str, target, prompts: list, new_tokens: int,
                    log=print):
    """`collect`'s `profiles` on the cluster: the prompts of `todo` profiled by the workers (each loads the models
    once, in `target`'s dtype, the driver's), each result `put` as it comes; a failed or interrupted collection
    raises after the results that came are kept (the cache resumes from them)."""
    def profiles(todo, put):
        todo = list(todo)
        if not todo:
            return
        job = RouterJob(teacher, eagle3, dflash, target.precision["dtype"], [prompts[i] for i in todo], todo,
                        new_tokens)
        out = run_tasks(cl, job, "profile sequences", log, on_result=lambda k, r: put(todo[k], r))
        if out.error is not None:
            raise task_error(out.error)
    return profiles


@dataclass
class ProfileJob:
    """`speclab profile`'s profiles on a worker: EAGLE-3 and DFlash beside the target on its node, in the bench's
    dtype, and per task one bench prompt profiled (`bench.routing.profile_prompt`)."""
    paths: ModelPaths
    params: dict
    items: list  # profile_prompt's arguments after the models, by task

    def setup(self) -> int:
        from speclab.methods import build_method
        from speclab.models import load_models
        self.target, models = load_models(self.paths, roles=("eagle3", "dflash"))
        self.drafters, _ = build_method("whiflash-entropy", self.target, models, self.params)
        return len(self.items)

    def info(self) -> dict:
        return {}

    def run(self, k: int, where: dict):
        from speclab.bench.routing import profile_prompt
        return profile_prompt(self.target, self.drafters, *self.items[k])


def bench_profiles(cl: Cluster, paths: ModelPaths, log=print):
    """`profile_bench`'s `profiles` on the cluster: each prompt profiled by a worker (the models of `paths`, the
    bench's dtype), returned in the items' order; raises if any is missing (a failure or Ctrl-C)."""
    def profiles(items, params):
        out = run_tasks(cl, ProfileJob(paths, params, items), "profile bench", log)
        if out.error is not None:
            raise task_error(out.error)
        return [out.results[k][1] for k in range(len(items))]
    return profiles
