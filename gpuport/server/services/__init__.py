"""The server's rules: each service owns one noun, talks to the store, and raises GpuportErrors."""
