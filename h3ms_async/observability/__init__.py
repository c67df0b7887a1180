"""Status JSON, HTTP routes and the standalone server."""
