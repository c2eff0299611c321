"""An in-memory stand-in for torch's rendezvous Store, for the pure protocols over it (no processes)."""

import threading


class MemoryStore:
    """The calls of torch's Store that the protocol uses, with its compare_set semantics."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def set(self, key, value):
        with self.lock:
            self.data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key):
        with self.lock:
            return self.data[key]

    def check(self, keys):
        with self.lock:
            return all(k in self.data for k in keys)

    def compare_set(self, key, expected, desired):
        with self.lock:
            current = self.data.get(key)
            if (current is None and expected == "") or current == expected.encode():
                self.data[key] = desired.encode()
                return desired.encode()
            return expected.encode() if current is None else current

    def multi_get(self, keys):
        with self.lock:
            return [self.data[k] for k in keys]

    def add(self, key, amount):
        with self.lock:
            value = int(self.data.get(key, b"0")) + int(amount)
            self.data[key] = str(value).encode()
            return value
