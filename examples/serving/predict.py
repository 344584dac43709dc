"""Ask a deployed digits model for predictions over KServe v2's REST API, with nothing but the
standard library and numpy: python predict.py HTTP_URL TOKEN CERT [MODEL]

The held-out digits (the same split as keras_digits/train.py) go as JSON, in requests of at most the
model's max batch size (from its configuration: a longer request is refused, as Triton does); the
answers' class probabilities are scored against the labels. Any KServe v2 client (tritonclient,
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
context = ssl.create_default_context(cafile=cert)


def ask(path: str, body: dict | None = None) -> dict:
    """GET (or POST ``body`` to) ``path`` under /v2/models/MODEL; the answer's JSON."""
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/v2/models/{model}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, context=context) as reply:
            return json.load(reply)
    except urllib.error.HTTPError as e:  # the protocol's {"error": ...}
        sys.exit(f"{model}: HTTP {e.code}: {json.load(e).get('error')}")


name = ask("")["inputs"][0]["name"]  # whatever the model calls its input
rows = ask("/config")["max_batch_size"] or len(x_test)  # 0: no batching, any number of rows in one request
answers = []
for start in range(0, len(x_test), rows):
    part = x_test[start : start + rows]
    tensor = {"name": name, "shape": list(part.shape), "datatype": "FP32", "data": part.ravel().tolist()}
    out = ask("/infer", {"inputs": [tensor]})["outputs"][0]
    answers.append(np.array(out["data"]).reshape(out["shape"]))
probabilities = np.concatenate(answers)
accuracy = float((probabilities.argmax(axis=1) == y_test).mean())
print(f"{model}: {len(y_test)} digits in {len(answers)} requests over KServe v2 REST, accuracy {accuracy:.4f}")
