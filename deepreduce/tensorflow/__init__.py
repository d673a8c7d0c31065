"""deepreduce for TensorFlow: graph-op pipelines, ``DistributedGradientTape``, ``DistributedOptimizer``, GradiVeQ.

::

    import deepreduce.tensorflow as drtf
    pipe = drtf.build("configs/topk_raw.yaml")          # holds residuals and counters
    payload = pipe.encode(grad, name="grad_0", step=optimizer.iterations)   # 1-D tf.uint8
    dense = pipe.decode(payload)                         # float32, grad's shape

    tape = drtf.DistributedGradientTape(tape, compression="configs/topk_raw.yaml")   # Horovod's arguments

Encode and decode are graph ops (they run at every step inside ``tf.function``), and the bytes
are the NumPy core's, so containers are identical across the NumPy core and the PyTorch and
TensorFlow bindings. The distributed wrappers need ``horovod.tensorflow``; the pipeline does not.
Keras 3 callbacks and ``broadcast_variables``: :mod:`deepreduce.tensorflow.keras`.
"""
from .gradiveq import GradiVeQ
from .ops import available as ops_available
from .optimizer import DistributedOptimizer
from .pipeline import TFPipeline, build, shared
from .tape import DistributedGradientTape

__all__ = ["build", "shared", "TFPipeline", "DistributedGradientTape", "DistributedOptimizer", "GradiVeQ",
           "ops_available"]
