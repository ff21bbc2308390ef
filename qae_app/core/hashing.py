"""The sha256 of a file, the one fingerprint qae takes: checkpoint manifests, data files, the GGUF cache key."""

import hashlib
from pathlib import Path


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks (checkpoint manifests, data fingerprints, the GGUF cache key)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
