"""Put on a job's PYTHONPATH: its sitecustomize runs before the job's own code (see there)."""
