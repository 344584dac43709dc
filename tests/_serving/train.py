"""A gpuport job: fit a small Keras MLP on a seeded toy problem and save it for serving, as
model/mlp.keras and as a SavedModel in model/savedmodel (what `gpuport deploy` takes)."""

import os

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402

rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype("float32")
y = (x[:, 0] + x[:, 1] > 0).astype("int64")  # two classes, easy to learn
keras.utils.set_random_seed(0)
model = keras.Sequential(
    [
        keras.Input(shape=(8,), name="features"),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(2, name="logits"),
    ]
)
model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
history = model.fit(x, y, epochs=30, batch_size=64, verbose=0)
os.makedirs("model", exist_ok=True)
model.save("model/mlp.keras")
model.export("model/savedmodel", verbose=False)
np.save("model/probe.npy", x[:4])
np.save("model/expected.npy", model.predict(x[:4], verbose=0))
print(f"accuracy {history.history['accuracy'][-1]:.3f}", flush=True)
