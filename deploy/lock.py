"""Write constraints.txt from a pip installation report (`make lock`).

    pip install --dry-run --ignore-installed --report REPORT ... && python deploy/lock.py REPORT

Every package the resolver picked is pinned to the version it picked, so `make install`
and the Docker images install the set the suite last passed with, not whatever the index
has that day. The project's own editable packages are left out, and a local version label
(torch's `+cpu`) is dropped: `torch==2.13.0` matches the CPU wheel here and in the images.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HEADER = """\
# Tested versions of every package `make install` puts in .venv (pip constraints: a pin
# here applies only when something asks for the package). Regenerate with `make lock`,
# then run `make test`. The Dockerfile installs with the same file.
"""


def pins(report: dict[str, object]) -> list[str]:
    """The `name==version` lines for a pip `--report`, sorted, own packages left out."""
    lines = set()
    for item in report["install"]:  # type: ignore[attr-defined]
        meta = item["metadata"]
        name, version = re.sub(r"[-_.]+", "-", meta["name"]).lower(), meta["version"]
        if name.startswith("laneway"):
            continue
        lines.add(f"{name}=={version.split('+')[0]}")
    return sorted(lines)


def main(argv: list[str]) -> int:
    report = json.loads(Path(argv[1]).read_text())
    out = Path(argv[2]) if len(argv) > 2 else Path("constraints.txt")
    out.write_text(HEADER + "\n".join(pins(report)) + "\n")
    print(f"{out}: {len(pins(report))} pins")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
