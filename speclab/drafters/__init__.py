"""Drafters: one module each behind the protocol in `base.py`; the registry is `speclab.methods`."""
