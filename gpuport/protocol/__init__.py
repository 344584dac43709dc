"""What client and server share: the wire (gRPC stubs), the error table, units and TLS identity."""
