"""Builds memledger's wheel: the Python module, the `memledger` command and the shared
libraries the module needs that a fresh machine may lack (Abseil's, libatomic), bundled
in memledger.libs/ beside it, which the module's RUNPATH ($ORIGIN/memledger.libs) names.
No LibTorch: the estimator, planner and C ABI need none.

    make_wheel.py --out memledger-V-cp311-cp311-linux_x86_64.whl --module memledger.so \
        --cli memledger_cli.py --version V
"""

import argparse
import base64
import hashlib
import os
import re
import subprocess
import sys
import zipfile

# Libraries bundled from the build machine: what Debian's runtime packages hold and a
# machine without the -dev packages (or Bazel) may miss. libc, libm, libstdc++ and
# libgcc_s are every Linux's.
BUNDLED = re.compile(r"^(libabsl_\S+|libatomic\.so\.\d+)$")
EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed timestamps: the same inputs, the same wheel


def needed_libraries(module):
    """(soname, path) of the module's bundled dependencies, as the loader resolves them."""
    out = subprocess.run(["ldd", module], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "=>" and BUNDLED.match(parts[0]):
            if parts[2] == "not":
                sys.exit(f"make_wheel: {parts[0]} is not found for {module}")
            found.append((parts[0], parts[2]))
    return sorted(found)


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--module", required=True)
    parser.add_argument("--cli", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--help_text", action="append", default=[], metavar="COMMAND=PATH",
                        help="a Bazel CLI's --help, which `memledger COMMAND --help` shows")
    args = parser.parse_args()
    dist_info = f"memledger-{args.version}.dist-info"
    files = []  # (name in the wheel, bytes, executable)
    with open(args.module, "rb") as f:
        files.append(("memledger.so", f.read(), True))
    with open(args.cli, "rb") as f:
        files.append(("memledger_cli.py", f.read(), False))
    # memledger_help.py: HELP, each command's Bazel CLI --help, as the command shows it.
    helps = {}
    for item in args.help_text:
        command, _, path = item.partition("=")
        with open(path, encoding="utf-8") as f:
            helps[command] = f.read()
    files.append(("memledger_help.py",
                  (f'"""The Bazel CLIs\' --help, for `memledger COMMAND --help`."""\n\n'
                   f"HELP = {helps!r}\n").encode(), False))
    for soname, path in needed_libraries(args.module):
        with open(os.path.realpath(path), "rb") as f:
            files.append((f"memledger.libs/{soname}", f.read(), True))
    metadata = (
        "Metadata-Version: 2.1\n"
        "Name: memledger\n"
        f"Version: {args.version}\n"
        "Summary: Training memory of Transformers, predicted byte for byte.\n"
        "Requires-Python: ==3.11.*\n")
    wheel = ("Wheel-Version: 1.0\n"
             "Generator: memledger make_wheel\n"
             "Root-Is-Purelib: false\n"
             "Tag: cp311-cp311-linux_x86_64\n")
    entry_points = "[console_scripts]\nmemledger = memledger_cli:main\n"
    for name, text in (("METADATA", metadata), ("WHEEL", wheel),
                       ("entry_points.txt", entry_points)):
        files.append((f"{dist_info}/{name}", text.encode(), False))
    record = [record_line(name, data) for name, data, _ in files]
    record.append(f"{dist_info}/RECORD,,")
    files.append((f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode(), False))
    tmp = args.out + ".tmp"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data, executable in files:
            info = zipfile.ZipInfo(name, date_time=EPOCH)
            info.external_attr = (0o755 if executable else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
