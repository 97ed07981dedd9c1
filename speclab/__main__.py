"""`python -m speclab ...` is the `speclab` command."""
from speclab.cli import main

raise SystemExit(main())
