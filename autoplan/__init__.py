"""autoplan: plans and runs the parallel training of transformer models.

The search path (specs, cost model, search, plan, CLI) imports neither torch.distributed nor triton, and
planning a preset model does not import torch at all.
"""

__version__ = "0.1.0"
