"""speclab: a laboratory for speculative decoding. See README.md and docs/ARCHITECTURE.md."""
import os

# No code path downloads weights or data at run time: models come from local directories or the local cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from speclab.core.target import Target
from speclab.errors import InvalidInput, ModelNotFound, SpeclabError, TraceError
from speclab.generate import GenerationResult, generate
from speclab.trace import TraceStore

__all__ = ["generate", "GenerationResult", "Target", "TraceStore", "SpeclabError", "InvalidInput",
           "ModelNotFound", "TraceError"]
__version__ = "0.1.0"
