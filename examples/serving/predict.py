"""Ask a deployed digits model for predictions over KServe v2's REST API, with nothing but the
standard library and numpy: python predict.py HTTP_URL TOKEN CERT [MODEL]

The held-out digits (the same split as keras_digits/train.py) go in one request as JSON; the
answer's class probabilities are scored against the labels. Any KServe v2 client (tritonclient,
curl) works the same way: the server's address, a Bearer token, its certificate.
"""

import json
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "keras_digits"))
from train import data  # noqa: E402  (the same split, from the same seed)

url, token, cert = sys.argv[1:4]
model = sys.argv[4] if len(sys.argv) > 4 else "digits"
_, x_test, _, y_test = data()
body = {"inputs": [{"name": "input", "shape": list(x_test.shape), "datatype": "FP32", "data": x_test.ravel().tolist()}]}
metadata = urllib.request.Request(f"{url}/v2/models/{model}", headers={"Authorization": f"Bearer {token}"})
context = ssl.create_default_context(cafile=cert)
with urllib.request.urlopen(metadata, context=context) as reply:
    body["inputs"][0]["name"] = json.load(reply)["inputs"][0]["name"]  # whatever the model calls its input
request = urllib.request.Request(
    f"{url}/v2/models/{model}/infer",
    data=json.dumps(body).encode(),
    headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
)
try:
    with urllib.request.urlopen(request, context=context) as reply:
        out = json.load(reply)["outputs"][0]
except urllib.error.HTTPError as e:  # the protocol's {"error": ...}
    sys.exit(f"{model}: HTTP {e.code}: {json.load(e).get('error')}")
probabilities = np.array(out["data"]).reshape(out["shape"])
accuracy = float((probabilities.argmax(axis=1) == y_test).mean())
print(f"{model}: {len(y_test)} digits in one request over KServe v2 REST, accuracy {accuracy:.4f}")
