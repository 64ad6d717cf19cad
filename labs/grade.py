"""Grade a lab by its number: the student's file, or the reference solution.

    python labs/grade.py 1                  # labs/01-collectives/student.py
    python labs/grade.py 2 path/to/file.py  # any file with the lab's functions
    python labs/grade.py --reference all    # every lab's solution.py (make labs-reference)

``make lab N=k`` runs the first form. Each lab's own ``grade.py`` does the work.
"""
import argparse
import glob
import os
import subprocess
import sys

LABS = os.path.dirname(os.path.abspath(__file__))


def lab_dirs() -> dict:
    """Lab number -> its folder (``labs/NN-name``)."""
    found = {}
    for path in sorted(glob.glob(os.path.join(LABS, "[0-9][0-9]-*"))):
        if os.path.exists(os.path.join(path, "grade.py")):
            found[int(os.path.basename(path)[:2])] = path
    return found


def grade(folder: str, *args: str) -> int:
    return subprocess.run([sys.executable, os.path.join(folder, "grade.py"), *args]).returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lab", help="the lab's number, or 'all' with --reference")
    ap.add_argument("file", nargs="?", help="the file to grade (default: the lab's student.py)")
    ap.add_argument("--reference", action="store_true", help="grade the reference solution")
    args = ap.parse_args()
    labs = lab_dirs()
    wanted = sorted(labs) if args.lab == "all" else [int(args.lab)] if args.lab.isdigit() else []
    missing = [k for k in wanted if k not in labs]
    if not wanted or missing:
        print(f"no lab {args.lab}: the labs are {', '.join(map(str, sorted(labs)))}")
        return 2
    failed = []
    for k in wanted:
        if args.reference:
            status = grade(labs[k], os.path.join(labs[k], "solution.py"), "--out",
                           os.path.join(labs[k], "runs", "solution.h5"))
        else:
            status = grade(labs[k], *([args.file] if args.file else []))
        if status:
            failed.append(k)
    if len(wanted) > 1:
        print(f"{len(wanted) - len(failed)} of {len(wanted)} labs passed"
              + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
