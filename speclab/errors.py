"""The errors speclab raises for bad input: each message says what was wrong and where it looked."""


class SpeclabError(Exception):
    """Base class: bad input or state the user can fix; the CLI prints the message without a traceback."""


class ModelNotFound(SpeclabError):
    pass


class InvalidInput(SpeclabError):
    pass


class TraceError(SpeclabError):
    pass
