"""Serving: a closed loop of requests decoded in a batch (`speclab.core.batch`) under one draft-length policy
(`speclab.serve.policies`), live: each batched step's verification slots per request, and the serving figures
(throughput, per-user tokens/s, TTFT, TPOT) as the requests finish. Every request is a run in the trace (one
session), so the explorer lists them."""
from __future__ import annotations

import time
import uuid

import gradio as gr

from app.lab import Lab, answers, waiting
from speclab import viz
from speclab.bench.suites import load_suite
from speclab.checks import Bound, check_number
from speclab.core.batch import Batch
from speclab.core.sampling import Sampling
from speclab.errors import InvalidInput
from speclab.generate import encode_prompt
from speclab.methods import method_params
from speclab.metrics import serving_metrics
from speclab.serve.load import closed_steps, drafters_for
from speclab.serve.policies import StepCost, build_policy, needs_cost, parse_policy
from speclab.serve.record import ServeRecorder, served_row

POLICIES = ["none", "fixed:k=2", "fixed:k=4", "fixed:k=8", "table", "goodput:k=8", "dspark:k=8"]
STREAM_EVERY_S = 0.5


class Serving:
    def __init__(self, lab: Lab):
        self.lab = lab
        self.costs: dict[tuple[int, str], StepCost] = {}  # profiled once per target and method (what drafting adds
        # to a step is the method's), on the first policy that needs it

    def method(self) -> str:
        """DFlash (blocks of up to 8 drafts) when the lab has it, else prompt lookup."""
        return "dflash:block_size=9" if self.lab.models.get("dflash") is not None else "pld"

    def _check(self, policy, concurrency, requests, max_new):
        name, _ = parse_policy(str(policy or ""))
        if name == "dspark":
            m = self.lab.models.get("dflash")
            if m is None or not m.has_confidence:
                raise InvalidInput("dspark needs DSpark's confidence head on the DFlash drafter (speclab train dspark)")
        return (check_number("concurrency", concurrency, int, Bound(1, 32)),
                check_number("requests", requests, int, Bound(1, 64)),
                check_number("max new tokens", max_new, int, Bound(1, 512)))

    @answers(3)
    def serve(self, policy, concurrency, requests, max_new):
        """Generator for the Serve button: checks, waits its turn for the models, then streams the steps."""
        concurrency, requests, max_new = self._check(policy, concurrency, requests, max_new)
        lab = self.lab
        ticket = lab.line.join()
        try:
            while n := lab.line.ahead(ticket):
                yield waiting(n), gr.skip(), gr.skip()
            yield from self._serve(str(policy), concurrency, requests, max_new)
        finally:
            lab.line.leave(ticket)

    def _serve(self, policy: str, concurrency: int, requests: int, max_new: int):
        lab, method = self.lab, self.method()
        rows = (load_suite("zoo", -(-requests // 4)) * 2)[:requests]  # the categories in turn
        prompts = [encode_prompt(lab.target, r["prompt"]) for r in rows]
        params = method_params(method, {}, lab.target)
        key = (id(lab.target), method)
        if needs_cost(policy) and key not in self.costs:
            yield "profiling the batched step once (the policy's step-time model) ...", gr.skip(), gr.skip()
            self.costs[key] = StepCost.profile(lab.target, make_drafters=drafters_for("fixed", method, lab.target,
                                                                                       lab.models, params))
        cost = self.costs.get(key)
        session = f"app-serve-{uuid.uuid4().hex[:8]} {policy} c={concurrency}"

        recorder = ServeRecorder(lab.store, lab.target.tokenizer, session, policy, lambda st: served_row(
            lab.target, method, params, policy, st, rows[st.req.rid], concurrency=concurrency,
            max_new_tokens=max_new))
        make = drafters_for(policy, method, lab.target, lab.models, params)
        batch = Batch(lab.target, make, build_policy(policy, None if cost is None else StepCost(**vars(cost))),
                      Sampling(), recorder=recorder)  # a copy: goodput learns its draft cost into it
        steps, last, t0 = [], 0.0, batch.now()
        try:
            for ev in closed_steps(batch, prompts, concurrency, max_new):
                steps.append(ev)
                if time.perf_counter() - last > STREAM_EVERY_S:
                    last = time.perf_counter()
                    yield (f"serving: {len(batch.done)} of {requests} requests done, step {ev.step}, "
                           f"{len(ev.rids)} in flight", viz.step_slots(steps, f"{policy}, concurrency {concurrency}"),
                           gr.skip())
        finally:  # a closed page (the generator closed) or an error: the requests in flight end cancelled
            batch.close()
            recorder.flush()
        m = serving_metrics(list(batch.done.values()), batch.now() - t0)
        table = viz.metrics_table({k: m[k] for k in ("requests", "output_tokens", "throughput_tok_s",
                                                     "per_user_tok_s", "ttft_p50_ms", "ttft_p95_ms",
                                                     "tpot_p50_ms", "tpot_p95_ms", "itl_p50_ms")})
        yield (f"done: {requests} requests, session `{session}` in the trace (the explorer lists its runs)",
               viz.step_slots(steps, f"{policy}, concurrency {concurrency}"), table)


def build(lab: Lab) -> dict:
    serving = Serving(lab)
    gr.Markdown(f"A closed loop: *concurrency* clients, each sending its next prompt (the zoo suite) when its last "
                f"request completes; every batched step is ONE target forward over all requests' rows. Drafter: "
                f"`{serving.method()}`.", elem_classes=["speclab-params"])
    with gr.Row():
        policy = gr.Dropdown(POLICIES, value="fixed:k=4", label="policy (none, fixed:k=K, table, goodput:k=K, "
                             "dspark:k=K)", allow_custom_value=True, elem_id="serve_policy")
        concurrency = gr.Number(4, label="concurrency (1 to 32)", elem_id="serve_conc")
        requests = gr.Number(8, label="requests (1 to 64)", elem_id="serve_requests")
        max_new = gr.Number(48, label="max new tokens (1 to 512)", elem_id="serve_max_new")
    run = gr.Button("Serve", variant="primary", elem_id="serve_run")
    status = gr.Markdown("", elem_id="serve_status")
    slots = gr.Plot(label="verification slots per request, step by step", elem_id="serve_slots")
    figures = gr.HTML("", elem_id="serve_figures")
    event = run.click(serving.serve, [policy, concurrency, requests, max_new], [status, slots, figures],
                      concurrency_limit=None)
    return {"run": event}
