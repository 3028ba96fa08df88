"""Helpers shared by the optimum-habana example scripts (model resolution, caching)."""
