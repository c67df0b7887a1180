"""The VAE split decode's coordinator side: ComfyUI's temporal chunk plan and the decode engine."""
