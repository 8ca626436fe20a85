"""The package version, in a module of its own so that any layer can read it (``auditor.__version__`` re-exports
it; pyproject.toml carries the same number)."""

__version__ = "0.1.0"
