"""Core helpers: device choice and memory readings, and turning a model name or file into a loaded Gaudi model."""
