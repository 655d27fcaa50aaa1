"""Checks that the running interpreter's environment holds exactly a lock's packages.

Usage: python lock_check.py locks/NAME.txt   (run with the virtualenv's own python)

Every `name==version` of the lock must be installed at that version, and nothing else may
be, but the virtualenv's own pip and setuptools. Exit 0 when it matches, 1 with the
differences otherwise (lib.sh's py_env calls it).
"""
import importlib.metadata
import re
import sys


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def main(path):
    want = {}
    with open(path) as f:
        for line in f:
            m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;\\]+)", line)
            if m:
                want[norm(m.group(1))] = m.group(3)
    have = {norm(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    wrong = [f"{n}: locked {v}, installed {have.get(n, 'none')}" for n, v in sorted(want.items()) if have.get(n) != v]
    extra = [f"{n}=={v}: not in the lock" for n, v in sorted(have.items()) if n not in want and n not in ("pip", "setuptools")]
    for line in wrong + extra:
        print(f"{path}: {line}", file=sys.stderr)
    return 1 if wrong or extra else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
