"""The one exception tree of Jet.

Every error Jet raises on purpose derives from `JetError`; redis-py errors are
translated into `QueueError` subclasses at the `jet.queues` boundary, so code
above it never imports redis to catch something. An error class with
`fatal = True` means "retrying or restarting cannot fix this" (a bad config,
wrong credentials, the wrong kind of server): a role that hits one exits with
`jet.supervisor.EXIT_FATAL` and the supervisor stops instead of restarting it.
"""


class JetError(Exception):
    """Root of every error Jet raises on purpose."""

    fatal = False


def is_fatal(e: BaseException) -> bool:
    return bool(getattr(e, "fatal", False))


class ConfigError(JetError):
    """A configuration value is missing, unknown or of the wrong type; the message names the key."""

    fatal = True  # a role that hits it ends at once: restarting it cannot help (jet.supervisor)


class CodecError(JetError):
    """An entry could not be encoded or decoded: malformed, unknown schema version or too large."""


class QueueError(JetError):
    """Something went wrong talking to Redis."""


class ConnectError(QueueError):
    """The server cannot be reached (the message names the URL, password redacted)."""


class AuthError(QueueError):
    """The server refused the credentials (or, NOPERM, a command for this ACL user): waiting does not
    help, so it is never retried. Not a ConnectError, so no reconnect loop swallows it."""

    fatal = True


class ServerVersionError(QueueError):
    """The server is older than the minimum Redis API Jet needs (7.0)."""

    fatal = True


class ServerError(QueueError):
    """The server is not one Jet can work with: it does not speak RESP, or it loses the scripts it
    was just sent (NOSCRIPT right after SCRIPT LOAD: a load balancer over independent servers)."""

    fatal = True


class ClusterError(QueueError):
    """A Redis Cluster answered MOVED/ASK (or CROSSSLOT) to a client that cannot follow it."""

    fatal = True


class Stopped(JetError):
    """Stop was requested (SIGTERM) while waiting for something, e.g. for the server to come up."""


class BackpressureTimeout(QueueError):
    """A bounded stream stayed full for longer than the producer was told to wait."""


class WeightsError(JetError):
    """A weights file is missing, fails its sha256 check, or does not fit the model."""


class GenerationError(JetError):
    """An inference worker answered a generation request with an error (the message says why)."""


class GenerationTimeout(GenerationError):
    """No reply to a generation request within its timeout, after every retry."""
