"""Transformer layers: serial ops with hand-written backward passes, the serial
GPT-2 style reference model, and the optimizers and training loop.

``ops`` (forward/backward pairs with injectable reductions), ``model`` (Config,
init_params, forward, backward), ``flash`` (the attention core blockwise), ``fused``
(CuPy kernels for the elementwise chains), ``precision`` (mixed precision), ``train``
(SGD, Adam, train, the copy task); the tensor-parallel schemes ``megatron``,
``optimus`` (2D and 2.5D) and ``tp3d`` with their registry ``schemes``; ``composed``
(data, pipeline and ZeRO parallelism around them). One-layer timing lives in
:mod:`summasim.bench.layer`.
"""

from .model import Config, backward, forward, init_params, logits, param_shapes

__all__ = ["Config", "init_params", "forward", "backward", "logits", "param_shapes"]
