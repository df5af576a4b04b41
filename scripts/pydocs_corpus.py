"""Build an offline training corpus from the Python documentation's reST sources.

    apt-get download python3.11-doc && dpkg -x python3.11-doc_*.deb /tmp/pydoc
    python scripts/pydocs_corpus.py /tmp/pydoc/usr/share/doc/python3.11/html/_sources data/python-docs.jsonl

One JSON line per documentation page ({"text": ..., "path": ...}), pages sorted by path, so a recipe's
``data.source: data/python-docs.jsonl`` packs whole pages and holds some out. About 12 MB of prose.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", type=Path, help="the html/_sources folder of the python3.X-doc package")
    p.add_argument("output", type=Path)
    p.add_argument("--min-chars", type=int, default=200, help="skip pages shorter than this")
    args = p.parse_args()
    pages = sorted(args.sources.rglob("*.txt"))
    if not pages:
        p.exit(2, f"error: no .txt pages under {args.sources}; pass the package's html/_sources folder\n")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_name(args.output.name + ".tmp")
    n = chars = 0
    with tmp.open("w") as f:
        for page in pages:
            text = page.read_text(errors="replace").strip()
            if len(text) >= args.min_chars:
                f.write(json.dumps({"text": text, "path": str(page.relative_to(args.sources))}) + "\n")
                n, chars = n + 1, chars + len(text)
    tmp.replace(args.output)
    print(f"{n} pages, {chars / 1e6:.1f} M characters -> {args.output}")


if __name__ == "__main__":
    main()
