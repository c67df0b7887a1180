"""The HTTP side of the status: routes and the standalone server."""
