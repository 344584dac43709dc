"""The ``gpuport`` command: a click app on top of the client (``gpuport server`` loads the server lazily)."""
