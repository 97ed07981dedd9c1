"""Batched serving above the batched decode loop (`speclab.core.batch`): draft-length policies (`policies`) and
load generators with the serve bench (`load`)."""
