from __future__ import annotations

import gpuport


def test_all_lists_exactly_the_public_members() -> None:
    exported = {name for name in dir(gpuport) if not name.startswith("_")}
    # Subpackages are importable as attributes, but they are not the public API.
    exported -= {"client", "protocol", "defaults", "cli", "server"}
    assert exported == set(gpuport.__all__) - {"__version__"}
    for name in gpuport.__all__:
        assert getattr(gpuport, name) is not None


def test_every_error_is_a_gpuport_error_with_a_docstring() -> None:
    errors = [
        getattr(gpuport, n)
        for n in gpuport.__all__
        if n.endswith(
            ("Error", "Mismatch", "Denied", "Found", "Request", "Unavailable", "Unreachable", "Failed", "Conflict")
        )
    ]
    assert len(errors) == 14
    for cls in errors:
        assert issubclass(cls, gpuport.GpuportError)
        assert cls.__doc__


def test_the_four_connection_errors_are_distinct() -> None:
    four = {gpuport.ServerUnreachable, gpuport.TLSError, gpuport.FingerprintMismatch, gpuport.AuthenticationError}
    assert len(four) == 4
    assert issubclass(gpuport.FingerprintMismatch, gpuport.TLSError)
    assert not issubclass(gpuport.AuthenticationError, gpuport.ConnectionFailed)
