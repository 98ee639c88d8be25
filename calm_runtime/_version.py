"""The package version (one place; the package root and the manifests read it)."""

__version__ = "0.1.0"
