"""The package version: one definition, read by the package, its run folders and exports."""

__version__ = "0.1.0"
