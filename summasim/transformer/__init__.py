"""Transformer layers: serial ops with hand-written backward passes, the serial
GPT-2 style reference model, and the optimizers and training loop.

``ops`` (forward/backward pairs with injectable reductions), ``model`` (Config,
init_params, forward, backward), ``train`` (SGD, Adam, train, the copy task),
``bench`` (one-layer timing and peak memory, optionally against PyTorch).
"""

from .model import Config, backward, forward, init_params, logits, param_shapes

__all__ = ["Config", "init_params", "forward", "backward", "logits", "param_shapes"]
