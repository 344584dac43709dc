"""Train a small Keras classifier on scikit-learn's bundled 8x8 digits (no download).

    gpuport run --gpus 1 --output model/ -- python train.py --epochs 20

Saves the model to model/digits.keras and the test accuracy to $GPUPORT_OUTPUT_DIR/metrics.json
(or ./metrics.json when run locally). evaluate.py scores the downloaded model.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter, not the training log

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

SEED = 0


def data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]  # 1,797 images of 8x8, one channel
    return train_test_split(x, digits.target, test_size=0.25, random_state=SEED, stratify=digits.target)


def model() -> tf.keras.Model:
    return tf.keras.Sequential(
        [
            tf.keras.Input((8, 8, 1)),
            tf.keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dropout(0.2),
            tf.keras.layers.Dense(10, activation="softmax"),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    tf.keras.utils.set_random_seed(SEED)
    gpus = tf.config.list_physical_devices("GPU")
    print(f"TensorFlow {tf.__version__} on {len(gpus)} GPU(s): {[g.name for g in gpus] or 'CPU only'}")
    x_train, x_test, y_train, y_test = data()
    print(f"digits: {len(x_train)} to train, {len(x_test)} to test")

    net = model()
    net.compile(tf.keras.optimizers.Adam(args.lr), "sparse_categorical_crossentropy", metrics=["accuracy"])
    start = time.perf_counter()
    net.fit(x_train, y_train, epochs=args.epochs, batch_size=args.batch_size, validation_split=0.1, verbose=2)
    loss, accuracy = net.evaluate(x_test, y_test, verbose=0)
    print(f"trained in {time.perf_counter() - start:.1f}s; test accuracy {accuracy:.4f}")

    os.makedirs("model", exist_ok=True)
    net.save("model/digits.keras")
    with open(os.path.join(os.environ.get("GPUPORT_OUTPUT_DIR", "."), "metrics.json"), "w") as f:
        json.dump({"test_accuracy": accuracy, "test_loss": loss, "epochs": args.epochs}, f)


if __name__ == "__main__":
    main()
