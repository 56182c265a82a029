"""The package version (one home, read by the package and by exports)."""

__version__ = "0.1.0"
