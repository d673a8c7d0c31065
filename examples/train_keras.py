"""The main job with Keras ``model.fit``: data-parallel ResNet-20 on the digits images, gradients as DeepReduce containers.

Run with N ranks under Horovod, e.g.::

    horovodrun -np 2 -H localhost:2 python examples/train_keras.py --config topk_raw
    horovodrun -np 2 -H localhost:2 python examples/train_keras.py --baseline    # hvd.allreduce, no compression

The model, data, schedule and per-epoch line are examples/train_tf.py's
(:mod:`experiments.tf_job`); training is Keras 3's ``model.fit`` with
``deepreduce.tensorflow.keras.DistributedOptimizer`` given the config path, and the callbacks
``BroadcastGlobalVariablesCallback`` (every rank starts from rank 0's weights) and
``MetricAverageCallback`` (the epoch's loss averaged over ranks). Each rank fits on its shard
of every epoch (:func:`experiments.digits.shard`); rank 0 prints the line of the PyTorch job.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from typing import List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from experiments.tf_job import cosine_lr, epoch_line, epoch_record, run_job, save_metrics  # noqa: E402,E501
from experiments.tf_job import start as start_job


def shard_batches(x, y, rank: int, size: int, batch_size: int, steps: int, seed: int):
    """Endless (images, labels) batches: each epoch ``steps`` batches of this rank's shard."""
    from experiments.digits import shard

    for epoch in itertools.count():
        indices = shard(len(y), rank, size, epoch, seed=seed)
        for step in range(steps):
            batch = indices[step * batch_size:(step + 1) * batch_size]
            yield x[batch], y[batch]


def train(args: argparse.Namespace) -> List[dict]:
    """Run the job on the current Horovod world; returns rank 0's per-epoch metrics."""
    job = start_job(args)
    tf, hvd, keras, model, base_lr = job.tf, job.hvd, job.keras, job.model, job.base_lr
    x_train, y_train, x_test, y_test = job.x_train, job.y_train, job.x_test, job.y_test
    import deepreduce.tensorflow as drtf
    import deepreduce.tensorflow.keras as drk

    # weight decay inside the optimizer, after the reduction (as torch's SGD): it is not communicated
    # the config path itself (the optimizer builds its pipeline once); a built pipeline for another backend
    compression = None if args.baseline else \
        args.config if args.tf_backend == "auto" else drtf.build(args.config, backend=args.tf_backend)
    optimizer = drk.DistributedOptimizer(
        keras.optimizers.SGD(learning_rate=base_lr, momentum=args.momentum, weight_decay=args.weight_decay),
        compression=compression)
    # graph mode, not XLA: the reduction runs Horovod and deepreduce ops
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    steps = len(y_train) // hvd.size() // args.batch_size
    if args.max_steps:
        steps = min(steps, args.max_steps)
    dense_bytes_per_step = 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    history: List[dict] = []

    class EpochLine(keras.callbacks.Callback):
        """Test accuracy, relative volume (averaged over ranks) and the epoch line on rank 0."""

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()
            self.wire_before = optimizer.compression_stats().get("wire_bytes", 0)

        def on_epoch_end(self, epoch, logs=None):
            wire = optimizer.compression_stats().get("wire_bytes", 0) - self.wire_before
            volume = 1.0 if args.baseline else wire / max(1, dense_bytes_per_step * steps)
            volume = float(hvd.allreduce(tf.constant(volume), name="epoch_volume"))
            predictions = np.argmax(self.model.predict(x_test, batch_size=256, verbose=0), axis=1)
            record = epoch_record(epoch + 1, logs["loss"], (predictions == y_test).mean(), volume,
                                  time.perf_counter() - self.start)
            history.append(record)
            if hvd.rank() == 0:
                print(epoch_line(record), flush=True)

    callbacks = [drk.BroadcastGlobalVariablesCallback(root_rank=0),
                 keras.callbacks.LearningRateScheduler(lambda epoch: cosine_lr(base_lr, epoch, args.epochs)),
                 drk.MetricAverageCallback(),    # before EpochLine: it prints the averaged loss
                 EpochLine()]
    model.fit(shard_batches(x_train, y_train, hvd.rank(), hvd.size(), args.batch_size, steps, args.seed),
              steps_per_epoch=steps, epochs=args.epochs, callbacks=callbacks, shuffle=False, verbose=0)
    save_metrics(args, job, "keras", history)
    return history


def main(argv: Optional[List[str]] = None) -> int:
    return run_job(train, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
