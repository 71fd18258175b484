"""What the ingress and the proxy (and the web chat) share at the HTTP edge: bearer keys, the body
cap, OpenAI's error envelope and its handlers, and the pieces of a stream that ends cleanly."""

from .body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from .disconnect import ClientDisconnected, until_disconnected
from .errors import ErrorDetail, ErrorResponse, error_envelope, error_response, install_error_handlers
from .keys import ApiKeyGuard, bearer_token, is_one_of
from .streaming import SSE_DONE, ClosingStreamingResponse, sse_error
from .validation import describe_validation_error

__all__ = ["DEFAULT_MAX_BODY_BYTES", "SSE_DONE", "ApiKeyGuard", "BodyLimit", "ClientDisconnected",
           "ClosingStreamingResponse", "ErrorDetail", "ErrorResponse", "bearer_token", "describe_validation_error",
           "error_envelope", "error_response", "install_error_handlers", "is_one_of", "sse_error",
           "until_disconnected"]
