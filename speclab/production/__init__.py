"""Production runs in the lab: the speculative-decoding figures that vLLM, SGLang and llama.cpp export, read from
the files users save (responses, streams, Prometheus scrapes), converted to speclab's definitions
(`speclab.metrics`) and written to the trace beside speclab's own runs.

- `record`: one imported run (`EngineRun`): the engine's counts in speclab's terms, what the engine reported
  verbatim, and every conversion applied; and its rows in the trace.
- `vllm`, `sglang`, `llamacpp`: each engine's per-request objects.
- `prometheus`: two scrapes of a server's counters (vLLM, llama.cpp) as one run over the window between them.
- `files`: which files hold what (JSON, JSON lines, a saved event stream), the engine detected per response.
"""
