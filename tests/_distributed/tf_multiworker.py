"""Train a tiny Keras model with MultiWorkerMirroredStrategy across the processes of one job.

Run as ``nprocs`` processes under gpuport's supervisor, which gives each one TF_CONFIG (the cluster
on 127.0.0.1 and its own task). Each worker trains on its own synthetic data; the all-reduce of the
gradients keeps the weights the same everywhere. Each worker saves its final weights, flattened and
concatenated, to ``tf-weights-<task index>.npy`` in $GPUPORT_OUTPUT_DIR (or the working directory),
for a test to compare.

A custom training loop, not ``model.fit``: Keras 3's fit fails under MultiWorkerMirroredStrategy
(it reduces the first batch eagerly, which the strategy cannot do: "Attempt to convert a value
(PerReplica...) to a Tensor", keras-team/keras#20585).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter would bury the job's log

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

STEPS = 10
BATCH = 16  # per worker

# The strategy first: it starts this worker's gRPC server and must exist before any other op runs.
# RING: collectives over gRPC between the workers (NCCL needs GPUs, and AUTO may pick it).
strategy = tf.distribute.MultiWorkerMirroredStrategy(
    communication_options=tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING
    )
)
task = json.loads(os.environ["TF_CONFIG"])["task"]
index = int(task["index"])
global_batch = BATCH * strategy.num_replicas_in_sync
print(f"{task['type']} {index}: {strategy.num_replicas_in_sync} replicas", flush=True)


def dataset(context: tf.distribute.InputContext) -> tf.data.Dataset:
    # Different data on every worker: equal weights at the end are the all-reduce's doing, not chance.
    rng = np.random.default_rng(100 + context.input_pipeline_id)
    x = rng.normal(size=(STEPS * BATCH, 8)).astype("float32")
    y = x @ np.arange(1, 9, dtype="float32")[:, None]
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(context.get_per_replica_batch_size(global_batch)).repeat()


with strategy.scope():
    keras.utils.set_random_seed(index)  # different initial values too: the strategy must sync them
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)  # its variables now, not inside the tf.function
batches = iter(strategy.distribute_datasets_from_function(dataset))


@tf.function
def train_step(batches) -> tf.Tensor:
    def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            errors = tf.square(model(x, training=True) - y)[:, 0]
            loss = tf.nn.compute_average_loss(errors, global_batch_size=global_batch)
        gradients = tape.gradient(loss, model.trainable_variables)
        # Keras's optimizer sums the gradients over all replicas (the all-reduce) before applying them.
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(step, args=next(batches)), axis=None)


for number in range(STEPS):
    loss = float(train_step(batches))
    if number in (0, STEPS - 1):
        print(f"step {number} loss {loss:.4f}", flush=True)

weights = np.concatenate([w.ravel() for w in model.get_weights()])
out = Path(os.environ.get("GPUPORT_OUTPUT_DIR") or ".")
np.save(out / f"tf-weights-{index}.npy", weights)
print(f"saved {weights.size} weights, sha256 {hashlib.sha256(weights.tobytes()).hexdigest()}", flush=True)
