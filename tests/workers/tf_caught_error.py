"""Worker: one rank's encode error, caught by the user, leaves no TensorFlow rank out of phase.

``python tf_caught_error.py`` on 2 ranks. At step 1 rank 1's float64 gradient holds finite values
beyond float32's range, so its encode fails. The rank still joins the step's collectives (it sends
the protocol's failure payload), every rank raises (eagerly a NonFiniteGradientError; inside
``tf.function`` TensorFlow's UnknownError carrying its text), the loop of the README's
skip-the-step pattern goes on, and the next steps work and keep the ranks identical. Run for an
eager tape step, a compiled one and the Keras DistributedOptimizer, each with error feedback under
``nonfinite: raise`` (the residuals of the failed step are undone) and with the custom-op config
under ``propagate``. Prints ``OK caught_error <mode> <config> <rank>`` per case.
"""
import os
import sys

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import watchdog  # noqa: E402

import deepreduce.tensorflow as drtf  # noqa: E402
from deepreduce.errors import NonFiniteGradientError  # noqa: E402

CONFIGS = {
    "raise": {"sparsifier": {"id": "topk", "ratio": 0.5}, "index": "raw", "value": "raw", "memory": "residual",
              "min_numel": 0, "nonfinite": "raise"},
    "propagate": {"sparsifier": {"id": "topk", "ratio": 0.5}, "index": "raw", "value": "raw",
                  "memory": "residual", "min_numel": 0},
}
STEPS = 4


def run(mode: str, config: dict):
    """STEPS steps of a small float64 model; returns (the steps skipped, their messages, the final
    weights, whether they moved)."""
    pipe = drtf.build(config)
    rng = np.random.default_rng(0)
    variables = [tf.Variable(rng.standard_normal((8, 300)), dtype=tf.float64),
                 tf.Variable(rng.standard_normal((300, 2)) * 0.1, dtype=tf.float64)]
    optimizer = keras.optimizers.SGD(0.01)
    distributed = drtf.DistributedOptimizer(keras.optimizers.SGD(0.01), compression=pipe)

    def loss_of(x, scale):
        return tf.reduce_sum(tf.square(tf.matmul(tf.tanh(tf.matmul(x, variables[0])), variables[1]))) * scale

    def tape_step(x, scale):
        with tf.GradientTape() as tape:
            loss = loss_of(x, scale)
        grads = drtf.DistributedGradientTape(tape, compression=pipe).gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))

    def optimizer_step(x, scale):
        with tf.GradientTape() as tape:
            loss = loss_of(x, scale)
        distributed.apply_gradients(zip(tape.gradient(loss, variables), variables))

    step_fn = {"eager": tape_step, "function": tf.function(tape_step), "optimizer": optimizer_step}[mode]
    initial = np.concatenate([v.numpy().ravel() for v in variables])
    skipped, messages = [], []
    for step in range(STEPS):
        x = tf.constant(np.random.default_rng(step * 10 + hvd.rank()).standard_normal((4, 8)))
        scale = tf.constant(1e300 if (step == 1 and hvd.rank() == 1) else 1.0, tf.float64)
        try:
            step_fn(x, scale)
        except (NonFiniteGradientError, tf.errors.UnknownError) as exc:
            skipped.append(step)
            messages.append(str(exc))
    weights = np.concatenate([v.numpy().ravel() for v in variables])
    return skipped, messages, weights, not np.array_equal(weights, initial)


def main() -> None:
    watchdog.arm(200)
    hvd.init()
    for mode in ("eager", "function", "optimizer"):
        for label, config in CONFIGS.items():
            skipped, messages, weights, changed = run(mode, config)
            assert skipped == [1], (mode, label, skipped, messages)
            assert "rank 1 could not encode" in messages[0] and "float32" in messages[0], messages[0]
            everyone = hvd.allgather(tf.constant(weights[None, :])).numpy()
            assert np.array_equal(everyone[0], everyone[1]), (mode, label, "ranks differ")
            assert changed, (mode, label, "no step was applied")
            print(f"OK caught_error {mode} {label} {hvd.rank()}", flush=True)
    watchdog.disarm()


if __name__ == "__main__":
    main()
