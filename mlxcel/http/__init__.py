"""HTTP: the quart-trio app and ``serve()``."""

from mlxcel.config import ServerConfig
from mlxcel.http.app import create_app
from mlxcel.http.serve import serve

__all__ = ["ServerConfig", "create_app", "serve"]
