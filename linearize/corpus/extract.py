"""Extractors: one small function per input format, each ``(path) -> iterator of document texts``.

They read files only (gzip transparently) and never run anything they read. Formats: HTML
(stdlib ``html.parser``, navigation/script/style dropped), reST, roff man pages, Perl POD, SWORD
OSIS modules, dictd dictionaries, WordNet data files, fortune files, plain text and source code.
"""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser
from pathlib import Path

from .documents import read_text, tidy
from .sword import extract_osis

# --- HTML ----------------------------------------------------------------------------------------

SKIP_TAGS = {"script", "style", "nav", "header", "footer", "noscript", "svg", "form", "button", "template", "head"}
# class/id/role words that mark navigation chrome in Sphinx, javadoc, rustdoc, haddock and DocBook pages
SKIP_MARKS = {"sphinxsidebar", "sidebar", "related", "navbar", "navigation", "breadcrumbs", "headerlink",
              "sidebar-elems", "top-nav", "sub-nav", "package-header", "footer", "navheader", "navfooter",
              "toc", "search", "banner", "contentinfo", "skip-nav", "copyright"}
BLOCK_TAGS = {"p", "div", "br", "li", "ul", "ol", "dl", "dt", "dd", "tr", "table", "section", "article",
              "h1", "h2", "h3", "h4", "h5", "h6", "pre", "blockquote", "hr", "main", "body", "title"}
VOID_TAGS = {"br", "hr", "img", "meta", "link", "input", "wbr", "area", "base", "col", "embed", "source", "track"}


class _TextParser(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.skip: tuple[str, int] | None = None  # (tag that opened the skipped region, nesting depth)
        self.pre = 0

    def _skipped(self, tag: str, attrs) -> bool:
        if tag in SKIP_TAGS:
            return True
        words = set()
        for key, value in attrs:
            if key in ("class", "id", "role") and value:
                words.update(value.lower().split())
        return bool(words & SKIP_MARKS)

    def handle_starttag(self, tag, attrs):
        if self.skip is not None:
            if tag == self.skip[0]:
                self.skip = (tag, self.skip[1] + 1)
            return
        if tag not in VOID_TAGS and self._skipped(tag, attrs):
            self.skip = (tag, 1)
            return
        if tag == "pre":
            self.pre += 1
        if tag in BLOCK_TAGS:
            self.out.append("\n")
        if tag == "li":
            self.out.append("- ")

    def handle_endtag(self, tag):
        if self.skip is not None:
            if tag == self.skip[0]:
                depth = self.skip[1] - 1
                self.skip = None if depth == 0 else (tag, depth)
            return
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in BLOCK_TAGS:
            self.out.append("\n")

    def handle_data(self, data):
        if self.skip is not None:
            return
        self.out.append(data if self.pre else re.sub(r"\s+", " ", data))


def html_text(source: str) -> str:
    """Visible text of an HTML page; script, style, nav, header, footer and sidebars dropped."""
    p = _TextParser()
    p.feed(source)
    p.close()
    lines = [line.strip() if not line.startswith("    ") else line.rstrip() for line in "".join(p.out).split("\n")]
    return tidy("\n".join(lines))


def extract_html(path: Path):
    yield html_text(read_text(path))


# --- reST ----------------------------------------------------------------------------------------

_ROLE = re.compile(r":[\w:+-]+:`([^`]*)`")
_DROP_DIRECTIVES = {"toctree", "index", "only", "raw", "image", "figure", "include", "kernel-doc",
                    "kernel-include", "kernel-feat", "kernel-abi", "contents", "highlight", "meta",
                    "currentmodule", "module", "autosummary", "plot", "literalinclude", "sectionauthor"}


def _role(m: re.Match) -> str:
    inner = m.group(1)
    target = re.match(r"(.*?)\s*<[^<>]*>$", inner, re.S)
    text = target.group(1) if target and target.group(1) else inner
    return text.lstrip("~!")


def rest_text(source: str) -> str:
    """reST with its markup thinned: roles become their text, labels, comments and structural
    directives (toctree, index, include, ...) dropped; prose, code blocks and tables kept."""
    out, dropping = [], None
    for line in source.splitlines():
        if dropping is not None:  # inside a dropped directive: its indented body goes too
            if not line.strip() or line[: dropping + 1].isspace():
                continue
            dropping = None
        m = re.match(r"(\s*)\.\.\s+([\w:-]+)::", line)
        if m and m.group(2) in _DROP_DIRECTIVES:
            dropping = len(m.group(1))
            continue
        if re.match(r"\s*\.\.\s+_[^:]*:", line) or re.match(r"\s*\.\.\s+\|", line):
            continue  # link targets, substitution definitions
        if re.match(r"\s*\.\.(\s|$)", line) and "::" not in line:
            dropping = len(line) - len(line.lstrip())  # a comment, with its indented continuation
            continue
        if re.match(r"\s+:[\w-]+:(\s|$)", line) and out and "::" in out[-1]:
            continue  # a directive's option line
        out.append(_ROLE.sub(_role, line))
    return tidy("\n".join(out))


def extract_rest(path: Path):
    yield rest_text(read_text(path))


# --- roff (man pages) ----------------------------------------------------------------------------

_ROFF_ESCAPES = [
    (re.compile(r"\\f(\[[^\]]*\]|\(..|.)"), ""),  # font changes
    (re.compile(r"\\s[+-]?\d+"), ""),  # size changes
    (re.compile(r"\\\*(\(..|\[[^\]]*\]|.)"), ""),  # string registers
    (re.compile(r"\\\((em|en)"), "-"),
    (re.compile(r"\\\((aq|cq|oq)"), "'"),
    (re.compile(r"\\\((dq|lq|rq)"), '"'),
    (re.compile(r"\\\(bu"), "*"),
    (re.compile(r"\\\(co"), "(c)"),
    (re.compile(r"\\\(..|\\\[[^\]]*\]"), ""),  # other named glyphs
    (re.compile(r"\\[&|^%:]"), ""),
    (re.compile(r"\\[-~ 0]"), lambda m: "-" if m.group(0) == "\\-" else " "),
    (re.compile(r"\\e"), lambda m: "\\"),
]


def _roff_inline(text: str) -> str:
    for pattern, repl in _ROFF_ESCAPES:
        text = pattern.sub(repl, text)
    return text


def _roff_args(rest: str) -> list[str]:
    return [a[1:-1] if len(a) > 1 and a[0] == a[-1] == '"' else a for a in re.findall(r'"[^"]*"|\S+', rest)]


def roff_text(source: str) -> str:
    """A man page as text: filled paragraphs (lines joined, as man does), headings and font macros
    keep their words, ``.nf``/``.EX`` blocks keep their lines, other requests and comments go,
    inline escapes are resolved or dropped."""
    out: list[str] = []
    para: list[str] = []
    nofill = False

    def flush():
        if para:
            out.append(" ".join(para))
            para.clear()

    for line in source.splitlines():
        if not line.startswith(("'", ".")):
            text = _roff_inline(line)
            if nofill:
                out.append(text)
            elif text.strip():
                para.append(text.strip())
            else:
                flush()
                out.append("")
            continue
        m = re.match(r"[.']\s*(\S*)\s*(.*)", line)
        name, rest = m.group(1), m.group(2)
        if name.startswith('\\"') or name == "":
            continue
        if name in ("B", "I", "SM", "SB"):
            para.append(_roff_inline(" ".join(_roff_args(rest))))
        elif name in ("BR", "RB", "IR", "RI", "BI", "IB"):
            para.append(_roff_inline("".join(_roff_args(rest))))
        elif name in ("nf", "EX"):
            flush()
            nofill = True
        elif name in ("fi", "EE"):
            nofill = False
        elif name in ("SH", "SS", "TH", "PP", "LP", "P", "TP", "IP", "HP", "sp", "br"):
            flush()
            if name in ("SH", "SS"):
                out += ["", _roff_inline(" ".join(_roff_args(rest))), ""]
            elif name == "TH":
                out.append(" ".join(_roff_args(rest)[:2]))
            else:
                out.append("")
                if name == "IP" and rest:
                    para.append(_roff_inline(_roff_args(rest)[0]))
        # every other request (.in, .so, .de, .RS ...) carries no text of its own
    flush()
    return tidy("\n".join(out))


def extract_roff(path: Path):
    yield roff_text(read_text(path))


# --- POD -----------------------------------------------------------------------------------------

_POD_CODE = re.compile(r"([A-Z])<([^<>]*)>")
_POD_WIDE = re.compile(r"([A-Z])<<+\s+(.*?)\s+>>+", re.S)
_POD_ENTITIES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/", "quot": '"', "amp": "&"}


def _pod_code(m: re.Match) -> str:
    code, inner = m.group(1), m.group(2)
    if code in ("X", "Z"):
        return ""
    if code == "E":
        return _POD_ENTITIES.get(inner, html.unescape(f"&{inner};") if not inner.isdigit() else chr(int(inner)))
    if code == "L":
        return inner.split("|", 1)[0] if "|" in inner else inner.replace('"', "")
    return inner


def pod_text(source: str) -> str:
    """Perl POD as text: ``=head``/``=item`` keep their words, other commands go, formatting
    codes (``B<>``, ``C<< >>``, ``L<text|link>``, ``E<lt>``) become their text."""
    out, skipping = [], False
    for line in source.splitlines():
        m = re.match(r"=(\w+)\s*(.*)", line)
        if m:
            cmd, rest = m.groups()
            if cmd == "begin":
                skipping = True
            elif cmd == "end":
                skipping = False
            elif cmd.startswith("head") or cmd == "item":
                out += ["", rest, ""]
            continue
        if not skipping:
            out.append(line)
    text = _POD_WIDE.sub(lambda m: _pod_code(m) if m.group(1) in "XZE" else m.group(2), "\n".join(out))
    for _ in range(4):  # nested codes, innermost first
        text = _POD_CODE.sub(_pod_code, text)
    return tidy(text)


def extract_pod(path: Path):
    yield pod_text(read_text(path))


# --- dictionaries, WordNet, fortunes, plain text, code -------------------------------------------

def extract_dictd(path: Path):
    """A dictd ``.dict.dz``: plain entries separated by blank lines; split later by length."""
    text = read_text(path)
    yield tidy(text)


_WN_POS = {"n": "noun", "v": "verb", "a": "adjective", "s": "adjective", "r": "adverb"}


def wordnet_text(source: str) -> str:
    """WordNet ``data.*`` lines as ``word, word (pos): gloss``; the license header (lines that
    start with two spaces) and the pointer fields dropped."""
    out = []
    for line in source.splitlines():
        if line.startswith("  ") or "|" not in line:
            continue
        fields, gloss = line.split("|", 1)
        parts = fields.split()
        pos, count = parts[2], int(parts[3], 16)
        words = [parts[4 + 2 * i].replace("_", " ") for i in range(count)]
        out.append(f"{', '.join(words)} ({_WN_POS.get(pos, pos)}): {gloss.strip()}")
    return "\n".join(out)


def extract_wordnet(path: Path):
    yield wordnet_text(read_text(path))


def extract_fortune(path: Path):
    """A fortune file: quotes separated by ``%`` lines, kept together (split later by length)."""
    quotes = [q.strip("\n") for q in re.split(r"^%$", read_text(path), flags=re.M)]
    yield tidy("\n\n".join(q for q in quotes if q.strip()))


def extract_plain(path: Path):
    yield tidy(read_text(path))


def extract_code(path: Path):
    """Source text as is, unless it looks generated: very long lines or a mean line over 100."""
    text = read_text(path)
    lines = text.splitlines() or [""]
    if max(map(len, lines)) > 1000 or len(text) / len(lines) > 100:
        return
    yield text.rstrip() + "\n"


EXTRACTORS = {
    "html": extract_html, "rest": extract_rest, "roff": extract_roff, "pod": extract_pod,
    "osis": extract_osis, "dictd": extract_dictd, "wordnet": extract_wordnet,
    "fortune": extract_fortune, "plain": extract_plain, "code": extract_code,
}
