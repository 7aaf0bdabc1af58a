"""The server's limits on one request, with their defaults (``diffdraft serve``'s options); kept
free of the web stack so the command line can name the defaults without importing it.
:mod:`diffdraft.serve.admission` applies them."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
"""4 MiB: a 128k-token context of text is about 0.5 M characters, under 4 MiB even JSON-escaped
(up to 6 bytes a character)."""
DEFAULT_MAX_TOKENS_CAP = 4096
DEFAULT_BODY_SECONDS = 30.0
DEFAULT_HEADER_SECONDS = 10.0
MAX_STOP_STRINGS = 16
"""Stop strings one request may give (OpenAI's API takes 4): each is searched for in the output after
every round, in the thread that runs every request's rounds, so a body of many thousands stalled all
of them. Not an option: no client needs more."""
MAX_STOP_CHARS = 256
"""Characters one stop string may have (the same reason)."""


@dataclass(frozen=True)
class ServerLimits:
    """The server's limits on one request (``diffdraft serve``'s options of the same names)."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """A larger body gets 413, refused from its Content-Length or once that much has arrived."""
    max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP
    """A request asking for more completion tokens gets 400, as OpenAI's API answers a
    ``max_tokens`` over a model's output limit; a request without ``max_tokens`` gets at most this."""
    body_timeout: float = DEFAULT_BODY_SECONDS
    """A body still arriving after this long gets 408 (a slow sender holds a connection, no more)."""
    header_timeout: float = DEFAULT_HEADER_SECONDS
    """A connection waiting this long for a request's headers, since it opened or since its last
    response, is closed (:mod:`diffdraft.serve.request_deadline`)."""

    def __post_init__(self) -> None:
        if (
            self.max_request_bytes < 1
            or self.max_tokens_cap < 1
            or not self.body_timeout > 0
            or not self.header_timeout > 0
        ):
            raise ValueError(
                "need max_request_bytes >= 1, max_tokens_cap >= 1, body_timeout > 0 and header_timeout > 0, "
                f"got {self.max_request_bytes}, {self.max_tokens_cap}, {self.body_timeout} and "
                f"{self.header_timeout}"
            )
