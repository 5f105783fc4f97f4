import torch

TORCH_VERSION: str

def stack_into(samples: object, out: torch.Tensor, /) -> bool: ...
