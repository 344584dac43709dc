"""The gpuport daemon: owns the GPUs, a state dir, a SQLite DB; serves gRPC and HTTP.

Install it with ``pip install 'gpuport[server]'`` and start it with ``gpuport server``.
"""
