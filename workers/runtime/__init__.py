"""What every worker process runs whatever its rank program: wire protocol, auth, shared memory, the
handler table, the ComfyUI host bridge."""
