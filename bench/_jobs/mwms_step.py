"""A TensorFlow MultiWorkerMirroredStrategy training step, timed: run on every worker with TF_CONFIG.

Prints ``step median MS`` (the median of steps WARMUP..STEPS, after the first ones that build the
graph) on worker 0. bench_ray.py runs it through gpuport over 2 nodes and by hand on the same nodes.
"""

from __future__ import annotations

import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

STEPS, WARMUP, BATCH = 60, 10, 256

strategy = tf.distribute.MultiWorkerMirroredStrategy(
    communication_options=tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING
    )
)
index = int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
global_batch = BATCH * strategy.num_replicas_in_sync
rng = np.random.default_rng(index)
x = rng.normal(size=(BATCH, 64)).astype("float32")
y = x @ rng.normal(size=(64, 1)).astype("float32")
data = iter(
    strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(global_batch))
)
with strategy.scope():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)


@tf.function
def train_step(batch) -> tf.Tensor:
    def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                tf.square(model(x, training=True) - y)[:, 0], global_batch_size=global_batch
            )
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(step, args=batch), axis=None)


times = []
for number in range(STEPS):
    start = time.perf_counter()
    float(train_step(next(data)))
    times.append(time.perf_counter() - start)
if index == 0:
    print(f"step median {statistics.median(times[WARMUP:]) * 1000:.2f} ms", flush=True)
