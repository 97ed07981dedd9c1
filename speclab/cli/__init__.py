"""`speclab` command line, one module per command group: `decode` (generate, stats), `bench` (bench, grid), `costs`
(costs forward | catchup | switch | block | kernels), `routing` (profile, sweep, calibrate, routing), `train` (train,
zoo); `common` (one-line errors, bounded numbers, prompt files, the one report writer) and `main` (the parser and
`main`). Commands parse, call library functions and write what they return."""
from speclab.cli.main import main

__all__ = ["main"]
