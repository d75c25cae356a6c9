"""Batching helpers: ``boxes`` collates detection targets."""
