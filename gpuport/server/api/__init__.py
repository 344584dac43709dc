"""The server's two doors: gRPC servicers and HTTP routes. They authenticate, validate, call a service."""
