"""The one exception tree of Jet.

Every error Jet raises on purpose derives from `JetError`; redis-py errors are
translated into `QueueError` subclasses at the `jet.queues` boundary, so code
above it never imports redis to catch something.
"""


class JetError(Exception):
    """Root of every error Jet raises on purpose."""


class ConfigError(JetError):
    """A configuration value is missing, unknown or of the wrong type; the message names the key."""


class CodecError(JetError):
    """An entry could not be encoded or decoded: malformed, unknown schema version or too large."""


class QueueError(JetError):
    """Something went wrong talking to Redis."""


class ConnectError(QueueError):
    """The server cannot be reached (the message names the URL, password redacted)."""


class ServerVersionError(QueueError):
    """The server is older than the minimum Redis API Jet needs (7.0)."""


class BackpressureTimeout(QueueError):
    """A bounded stream stayed full for longer than the producer was told to wait."""


class WeightsError(JetError):
    """A weights file is missing, fails its sha256 check, or does not fit the model."""


class GenerationError(JetError):
    """An inference worker answered a generation request with an error (the message says why)."""


class GenerationTimeout(GenerationError):
    """No reply to a generation request within its timeout, after every retry."""
