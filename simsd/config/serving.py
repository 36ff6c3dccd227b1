"""The server's limits and grace periods that its options default to (``simsd serve``). Torch-free."""

#: the server's default request body limit (``simsd serve --max-request-bytes``): far above any
#: prompt a context holds (a 128k-token prompt as JSON ids is under 1 MiB), far below the memory
#: a body costs
MAX_REQUEST_BYTES = 8 * 2 ** 20
#: seconds the requests in flight may take to finish after SIGTERM/SIGINT before the server
#: cancels them (``simsd serve --shutdown-timeout``; Kubernetes' default grace period is 30 s)
SHUTDOWN_TIMEOUT = 30.0
