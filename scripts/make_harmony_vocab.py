"""Writes tests/fixtures/harmony/o200k_base.tiktoken.xz: GPT-OSS's vocabulary for the tests.

``openai-harmony`` reads the ``o200k_base`` ranks from a file it downloads, or from the
folder ``TIKTOKEN_ENCODINGS_BASE`` names; it checks the file's SHA-256, so only the exact
published file loads. The tests have no network, so the repository keeps that file,
xz-compressed (1.2 MB). This script rebuilds it from the npm package ``tiktoken``
(``npm pack tiktoken@1.0.22``), whose ``encoders/o200k_base.json`` holds the same ranks as
one line: a placeholder, the first rank (0), then every token's base64 in rank order::

    npm pack tiktoken@1.0.22 && tar xzf tiktoken-1.0.22.tgz
    python scripts/make_harmony_vocab.py package/encoders/o200k_base.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
from pathlib import Path

#: The SHA-256 openai-harmony (and tiktoken) expect of o200k_base.tiktoken.
SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "harmony"


def tiktoken_file(npm_json: Path) -> bytes:
    """The ``.tiktoken`` text (``base64 rank`` per line) of the npm package's ranks."""
    parts = json.loads(npm_json.read_text())["bpe_ranks"].split(" ")
    if parts[1] != "0":
        raise SystemExit(f"{npm_json}: the ranks do not start at 0; not the expected layout")
    text = "".join(f"{token} {rank}\n" for rank, token in enumerate(parts[2:])).encode()
    digest = hashlib.sha256(text).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"{npm_json}: gives SHA-256 {digest}, not o200k_base's {SHA256}")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("npm_json", type=Path, help="encoders/o200k_base.json of npm's tiktoken")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / "o200k_base.tiktoken.xz"
    out.write_bytes(lzma.compress(tiktoken_file(args.npm_json), preset=9))
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
