"""Benchmarks behind `kvtier bench ...`."""
