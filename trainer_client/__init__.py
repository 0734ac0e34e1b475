"""What a trainer process imports: `RolloutClient` to reach a running service, `to_torch` for its batches."""

from trainer_client.client import RolloutClient
from trainer_client.tensors import to_torch

__all__ = ["RolloutClient", "to_torch"]
