"""The runtime every rank program shares: the coordinator's event loop, channels, the worker pool,
run dirs, GPU plans and the shared-memory weight store."""
