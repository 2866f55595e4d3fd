"""Build the krew archive of ``kubectl trainguard`` and write its sha256 into the manifest.

The archive holds the launcher ``plugins/kubectl-trainguard`` (it runs the installed
``trainguard`` package) and the license notice; it is built byte-for-byte reproducibly
(fixed mtimes, owner and order), so the manifest's sha256 can be checked from the tree::

    python plugins/build_krew.py OUT_DIR          # writes OUT_DIR/kubectl-trainguard.tar.gz
    python plugins/build_krew.py OUT_DIR --update # ... and updates plugins/trainguard.yaml

Publish the archive at the manifest's ``uri`` for the release (``spec.version``).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import re
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARCHIVE = "kubectl-trainguard.tar.gz"
MEMBERS = (("kubectl-trainguard", 0o755), ("LICENSE-NOTICE", 0o644))
NOTICE = b"trainguard is licensed under the Apache License 2.0.\n"


def build_archive() -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, mode in MEMBERS:
            data = (HERE / name).read_bytes() if name != "LICENSE-NOTICE" else NOTICE
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, filename="") as gz:
        gz.write(raw.getvalue())
    return out.getvalue()


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    data = build_archive()
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    (out / ARCHIVE).write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    print(f"{out / ARCHIVE} sha256 {digest}")
    if "--update" in argv:
        manifest = HERE / "trainguard.yaml"
        text = re.sub(r"sha256: [0-9a-f]{64}", f"sha256: {digest}", manifest.read_text())
        manifest.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
