"""Worker: an embedding's ``tf.IndexedSlices`` gradient travels as its touched entries.

``python tf_indexed_slices.py`` on 2 ranks. Each rank looks up its own rows (some repeated, some
shared with the other rank) of a 1000 x 16 table beside a dense layer. With the lossless config
``none_raw``:

- ``tape``: deepreduce's DistributedGradientTape (eager and compiled) returns an IndexedSlices of
  the touched rows whose dense value equals Horovod's own DistributedGradientTape result exactly,
  and sends fewer bytes than the dense table; ``sparse_as_dense=True`` returns a dense tensor
  equal to Horovod's with ``sparse_as_dense=True``;
- ``optimizer``: the Keras DistributedOptimizer applies it like SGD on Horovod's gradient (made dense);
- ``fit``: ``model.fit`` of a Keras Embedding model reduces the embedding's gradient as
  IndexedSlices and keeps the ranks identical;
- ``residual``: with Top-r and error feedback the gradient still travels as IndexedSlices, the
  ranks agree, the residual stays sparse and survives the pipeline's state dict.

Prints ``OK slices <case> <rank>`` per case.
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
import deepreduce.tensorflow.keras as drk  # noqa: E402

ROWS, DIM = 1000, 16


def make_variables():
    rng = np.random.default_rng(0)
    return [tf.Variable(rng.standard_normal((ROWS, DIM)).astype(np.float32)),
            tf.Variable(rng.standard_normal((DIM, 3)).astype(np.float32))]


def ids_of(rank: int, step: int) -> tf.Tensor:
    """This rank's looked-up rows: some repeated, some the other rank's too."""
    rng = np.random.default_rng(100 * step + rank)
    return tf.constant(np.concatenate([rng.integers(0, ROWS, 12), [7, 7, 500]]).astype(np.int64))


def loss_of(variables, ids):
    return tf.reduce_sum(tf.square(tf.matmul(tf.gather(variables[0], ids), variables[1])))


def gradients(wrap, variables, ids, compiled: bool):
    def step(ids):
        with tf.GradientTape() as tape:
            loss = loss_of(variables, ids)
        return wrap(tape).gradient(loss, variables)

    return (tf.function(step) if compiled else step)(ids)


def check_tape(pipe) -> None:
    variables = make_variables()
    for compiled in (False, True):
        ids = ids_of(hvd.rank(), int(compiled))
        ours = gradients(lambda t: drtf.DistributedGradientTape(t, compression=pipe), variables, ids, compiled)
        theirs = gradients(lambda t: hvd.DistributedGradientTape(t), variables, ids, compiled)
        assert isinstance(ours[0], tf.IndexedSlices) and isinstance(theirs[0], tf.IndexedSlices), (ours, theirs)
        rows = ours[0].indices.numpy()
        assert np.all(np.diff(rows) > 0), rows          # touched rows, ascending, each once
        assert np.array_equal(tf.convert_to_tensor(ours[0]).numpy(), tf.convert_to_tensor(theirs[0]).numpy())
        assert np.array_equal(ours[1].numpy(), theirs[1].numpy())
        dense_ours = gradients(lambda t: drtf.DistributedGradientTape(t, compression=pipe, sparse_as_dense=True),
                               variables, ids, compiled)
        dense_theirs = gradients(lambda t: hvd.DistributedGradientTape(t, sparse_as_dense=True), variables, ids,
                                 compiled)
        assert isinstance(dense_ours[0], tf.Tensor) and not isinstance(dense_ours[0], tf.IndexedSlices)
        assert np.array_equal(dense_ours[0].numpy(), dense_theirs[0].numpy())
    stats = pipe.compression_stats()
    assert stats["wire_bytes"] < stats["dense_bytes"] / 4, stats


def check_optimizer(pipe) -> None:
    ours, theirs = make_variables(), make_variables()
    optimizer = drtf.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=pipe)
    plain = keras.optimizers.SGD(0.1)
    for step in range(2):
        ids = ids_of(hvd.rank(), step)
        with tf.GradientTape() as tape:
            loss = loss_of(ours, ids)
        optimizer.apply_gradients(zip(tape.gradient(loss, ours), ours))
        reference = gradients(lambda t: hvd.DistributedGradientTape(t), theirs, ids, False)
        # Horovod's slices repeat rows (applied one after another); ours add them first: compare densely
        plain.apply_gradients(zip([tf.convert_to_tensor(g) for g in reference], theirs))
    for a, b in zip(ours, theirs):
        assert np.array_equal(a.numpy(), b.numpy())


def check_fit(pipe) -> None:
    keras.utils.set_random_seed(hvd.rank())
    model = keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(ROWS, DIM),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    optimizer = drk.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=pipe)
    reducer, traced = optimizer._deepreduce_reducer, []
    reduce_slices = reducer._slices.reduce

    def spy(grads, names, step, reports):   # records which gradients are reduced as IndexedSlices
        traced.extend(names)
        return reduce_slices(grads, names, step, reports)

    reducer._slices.reduce = spy
    model.compile(optimizer=optimizer, loss="mse")
    rng = np.random.default_rng(hvd.rank())
    x, y = rng.integers(0, ROWS, (32, 4)), rng.standard_normal((32, 1)).astype(np.float32)
    before = pipe.compression_stats()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[drk.BroadcastGlobalVariablesCallback(0)])
    flat = np.concatenate([w.ravel() for w in model.get_weights()])
    everyone = hvd.allgather(tf.constant(flat[None, :])).numpy()
    assert np.array_equal(everyone[0], everyone[1])
    assert traced == ["grad_0"], traced     # the embedding's gradient, traced once as IndexedSlices
    sent = pipe.compression_stats()["wire_bytes"] - before["wire_bytes"]
    assert sent < 4 * ROWS * DIM, sent     # 4 steps, each far less than the dense table


def check_residual(pipe) -> None:
    from deepreduce.memory import SparseResidual

    variables = make_variables()
    for compiled in (False, True):
        grads = gradients(lambda t: drtf.DistributedGradientTape(t, compression=pipe), variables,
                          ids_of(hvd.rank(), 2 + int(compiled)), compiled)
        assert isinstance(grads[0], tf.IndexedSlices), grads[0]
        dense = tf.convert_to_tensor(grads[0]).numpy()
        everyone = hvd.allgather(tf.constant(dense[None])).numpy()
        assert np.array_equal(everyone[0], everyone[1])
    held = [r for r in pipe.core.memory._residuals.values() if isinstance(r, SparseResidual)]
    assert len(held) == 1 and 0 < held[0].positions.shape[0] < ROWS * DIM, held
    again = drtf.build(pipe.core.get_config())
    again.load_state_dict(pipe.state_dict())
    (restored,) = [r for r in again.core.memory._residuals.values() if isinstance(r, SparseResidual)]
    assert np.array_equal(restored.values, held[0].values)


def main() -> None:
    watchdog.arm(200)
    hvd.init()
    for case, check in (("tape", check_tape), ("optimizer", check_optimizer), ("fit", check_fit)):
        check(drtf.build("none_raw"))
        print(f"OK slices {case} {hvd.rank()}", flush=True)
    check_residual(drtf.build({"sparsifier": {"id": "topk", "ratio": 0.25}, "index": "raw", "value": "raw",
                               "memory": "residual", "min_numel": 0}))
    print(f"OK slices residual {hvd.rank()}", flush=True)
    watchdog.disarm()


if __name__ == "__main__":
    main()
