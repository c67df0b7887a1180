"""The VAE split decode's rank program: messages and the chunk decoder."""
