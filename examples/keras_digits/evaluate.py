"""Score a trained digits model on the held-out test split: python evaluate.py MODEL.keras"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
from train import data  # noqa: E402  (the same split, from the same seed)

_, x_test, _, y_test = data()
model = tf.keras.models.load_model(sys.argv[1])
_, accuracy = model.evaluate(x_test, y_test, verbose=0)
print(f"test accuracy of {sys.argv[1]}: {accuracy:.4f} on {len(x_test)} digits")
