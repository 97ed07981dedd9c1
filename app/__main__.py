"""`python -m app`: the speclab app (see app/app.py)."""
import sys

from app.app import main

sys.exit(main())
