from speclab.cli import main

raise SystemExit(main())
