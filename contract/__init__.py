"""The contract between export (writer) and service (reader): manifest and graph conventions.

It belongs to neither side, so neither imports the other: only the standard library and numpy
here, never torch, the models package, export or service.
"""
