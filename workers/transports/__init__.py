"""Exchanges between ranks: host shared memory, torch.distributed, and the exchange probe."""
