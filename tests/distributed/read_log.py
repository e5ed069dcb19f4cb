"""`recorded_reads()`: every safetensors read made inside it, as (key, "whole" | "part", bytes)."""

import contextlib

from dspark.loader import SafetensorsReader


@contextlib.contextmanager
def recorded_reads():
    reads = []
    whole, part = SafetensorsReader.get, SafetensorsReader.get_part

    def get(self, key):
        t = whole(self, key)
        reads.append((key, "whole", t.numel() * t.element_size()))
        return t

    def get_part(self, key, axis, start, stop):
        t = part(self, key, axis, start, stop)
        reads.append((key, "part", t.numel() * t.element_size()))
        return t

    SafetensorsReader.get, SafetensorsReader.get_part = get, get_part
    try:
        yield reads
    finally:
        SafetensorsReader.get, SafetensorsReader.get_part = whole, part
