"""Model serving: deployed models, their replicas, and the dynamic batcher in front of them."""
