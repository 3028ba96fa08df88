"""The package version and the transformers it runs on; setup.py reads both from this file without importing the
package, and `import optimum.habana` checks the installed transformers against the second."""

__version__ = "0.1.0"

# The attention and mask interfaces and the generate() internals this package extends: the tested range.
TRANSFORMERS_REQUIREMENT = ">=5.23,<5.24"
