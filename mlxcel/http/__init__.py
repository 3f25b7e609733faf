"""HTTP: the quart-trio app and ``serve()``."""

from mlxcel.http.app import create_app
from mlxcel.http.serve import serve

__all__ = ["create_app", "serve"]
