"""The core: the target, its lean forward and precision, draft trees, sampling, verification and the decode loop."""
