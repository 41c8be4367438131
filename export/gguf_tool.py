"""GGUF metadata, read and written with the gguf-py of the llama.cpp build (run as a script, its gguf-py first on
PYTHONPATH, so the reader and writer know every architecture and tensor type that build does).

    python gguf_tool.py info FILE            -> one JSON object on stdout
    python gguf_tool.py add-meta IN OUT KV   -> OUT: IN with the string keys of the JSON file KV added

``info`` gives the architecture, the scalar keys (arrays by length, except short integer arrays), the token
list's length and SHA-256 (as written, and with SentencePiece's space marker read as a space), and each
tensor's name, type and shape. ``export/llamacpp.py`` runs it.
"""

from __future__ import annotations

import hashlib
import json
import sys


def info(path: str) -> dict:
    import gguf

    r = gguf.GGUFReader(path)
    kv: dict = {}
    tokens_sha, norm_sha, n_tokens = None, None, None
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        t = f.types[0] if f.types else None
        if t == gguf.GGUFValueType.ARRAY:
            if f.name == "tokenizer.ggml.tokens":
                toks = f.contents()
                n_tokens = len(toks)
                tokens_sha = hashlib.sha256("\n".join(toks).encode()).hexdigest()
                # the same ids spelled alike: SentencePiece's space marker as a space (a file converted from a
                # tokenizer.json spells the whitespace tokens an SPM file holds as spaces with it)
                norm_sha = hashlib.sha256("\n".join(t.replace("\u2581", " ") for t in toks).encode()).hexdigest()
                continue
            n = len(f.data)
            if n <= 64 and f.types[-1] != gguf.GGUFValueType.STRING:
                kv[f.name] = f.contents()
            else:
                kv[f.name] = f"<array of {n}>"
            continue
        v = f.contents()
        kv[f.name] = v if isinstance(v, (int, float, str, bool)) else str(v)
    tensors = [{"name": t.name, "type": t.tensor_type.name, "shape": [int(x) for x in t.shape],
                "bytes": int(t.n_bytes)} for t in r.tensors]
    return {"path": path, "architecture": kv.get("general.architecture"), "kv": kv, "n_tokens": n_tokens,
            "tokens_sha256": tokens_sha, "tokens_spelled_sha256": norm_sha, "tensors": tensors,
            "tensor_bytes": sum(t["bytes"] for t in tensors)}


def add_meta(src: str, dst: str, kv_file: str) -> None:
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    with open(kv_file) as f:
        kv = json.load(f)
    r = gguf.GGUFReader(src)
    arch = r.fields[gguf.Keys.General.ARCHITECTURE].contents()
    w = gguf.GGUFWriter(dst, arch=arch, endianess=r.endianess)
    new = {k: MetadataDetails(gguf.GGUFValueType.STRING, str(v)) for k, v in kv.items()}
    import logging
    logging.getLogger("gguf-new-metadata").setLevel(logging.WARNING)
    copy_with_new_metadata(r, w, new, [])


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "info":
        print(json.dumps(info(argv[1])))
        return 0
    if len(argv) == 4 and argv[0] == "add-meta":
        add_meta(argv[1], argv[2], argv[3])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
