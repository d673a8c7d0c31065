"""The main job in TensorFlow: data-parallel ResNet-20 on the digits images, gradients as DeepReduce containers.

Run with N ranks under Horovod, e.g.::

    horovodrun -np 2 -H localhost:2 python examples/train_tf.py --config topk_raw
    horovodrun -np 2 -H localhost:2 python examples/train_tf.py --baseline     # hvd.allreduce, no compression

A custom training loop: a ``tf.function`` train step that wraps its tape in
``deepreduce.tensorflow.DistributedGradientTape`` (Horovod's TF2 pattern), with
``optimizer.iterations`` as the step. ``examples/train_keras.py`` is the same job with
``model.fit``. Each epoch rank 0 prints the same line as the PyTorch job (experiments/train.py):
training loss averaged over ranks, test accuracy, relative data volume (bytes put on the wire
over dense float32 bytes, averaged over ranks) and wall time.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from experiments.tf_job import cosine_lr, epoch_line, epoch_record, run_job, save_metrics  # noqa: E402,E501
from experiments.tf_job import start as start_job


def train(args: argparse.Namespace) -> List[dict]:
    """Run the job on the current Horovod world; returns rank 0's per-epoch metrics."""
    job = start_job(args)
    tf, hvd, keras, model, base_lr = job.tf, job.hvd, job.keras, job.model, job.base_lr
    x_train, y_train, x_test, y_test = job.x_train, job.y_train, job.x_test, job.y_test
    import deepreduce.tensorflow as drtf
    from deepreduce.tensorflow.keras import broadcast_variables
    from experiments.digits import shard

    broadcast_variables(model.variables, root_rank=0)   # start every rank from rank 0's weights
    # weight decay inside the optimizer, after the reduction (as torch's SGD): it is not communicated
    optimizer = keras.optimizers.SGD(learning_rate=base_lr, momentum=args.momentum, weight_decay=args.weight_decay)
    # built once here: the tape created inside train_step would also accept the config path itself
    pipe = None if args.baseline else drtf.build(args.config, backend=args.tf_backend)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        tape = drtf.DistributedGradientTape(tape, compression=pipe, step=optimizer.iterations)
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    @tf.function
    def predict(x):
        return tf.argmax(model(x, training=False), axis=1)

    history = []
    dense_bytes_per_step = 4 * sum(int(np.prod(v.shape)) for v in variables)
    for epoch in range(args.epochs):
        start = time.perf_counter()
        optimizer.learning_rate.assign(cosine_lr(base_lr, epoch, args.epochs))
        before = 0 if pipe is None else pipe.stats.wire_bytes
        indices = shard(len(y_train), hvd.rank(), hvd.size(), epoch, seed=args.seed)
        steps = len(indices) // args.batch_size
        if args.max_steps:
            steps = min(steps, args.max_steps)
        losses = []
        for step in range(steps):
            batch = indices[step * args.batch_size:(step + 1) * args.batch_size]
            losses.append(float(train_step(tf.constant(x_train[batch]), tf.constant(y_train[batch]))))
        volume = 1.0 if pipe is None else (pipe.stats.wire_bytes - before) / max(1, dense_bytes_per_step * steps)
        mean_loss = float(hvd.allreduce(tf.constant(float(np.mean(losses))), name="epoch_loss"))
        mean_volume = float(hvd.allreduce(tf.constant(volume), name="epoch_volume"))
        predictions = np.concatenate([predict(tf.constant(x_test[i:i + 256])).numpy()
                                      for i in range(0, len(x_test), 256)])
        record = epoch_record(epoch + 1, mean_loss, (predictions == y_test).mean(), mean_volume,
                              time.perf_counter() - start)
        history.append(record)
        if hvd.rank() == 0:
            print(epoch_line(record), flush=True)
    save_metrics(args, job, "tensorflow", history)
    return history


def main(argv: Optional[List[str]] = None) -> int:
    return run_job(train, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
