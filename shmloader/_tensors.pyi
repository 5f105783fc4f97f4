import torch

TORCH_VERSION: str

def stack_into(samples: object, out: torch.Tensor, /) -> bool: ...

def from_array(array: object, /) -> torch.Tensor: ...
