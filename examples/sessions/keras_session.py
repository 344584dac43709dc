"""A Keras model trained and kept on the server: the data is sent once, the model never travels.

Run it after `gpuport login` (make demo does):  python keras_session.py
"""

import os

import numpy as np
from sklearn.datasets import load_digits

import gpuport


def fit(x, y, epochs):
    """Runs in the session's worker, next to the GPU: x and y are the arrays put there."""
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential(
        [tf.keras.Input((64,)), tf.keras.layers.Dense(64, activation="relu"), tf.keras.layers.Dense(10)]
    )
    model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(x, y, epochs=epochs, batch_size=64, verbose=0)
    print(f"worker {os.getpid()}: fitted {model.count_params()} parameters")  # shows up here, live
    return model


def accuracy(model, x, y):
    return float(model.evaluate(x, y, verbose=0)[1])


def main() -> None:
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    with gpuport.connect() as gpu, gpu.session(name="digits-demo") as s:
        xs, ys = s.put(x[:1500], name="x"), s.put(y[:1500], name="y")  # sent once
        model = s.call(fit, xs, ys, 20, keep="model")  # the model stays in the worker
        print("kept:", model)
        print("train accuracy:", round(s.call(accuracy, model, xs, ys), 3))  # no data sent again
        print("test accuracy: ", round(s.call(accuracy, model, x[1500:], y[1500:]), 3))
        s.close()  # a named session would otherwise wait for its idle timeout


if __name__ == "__main__":
    main()
