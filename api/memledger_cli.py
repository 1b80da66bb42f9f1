"""memledger: the wheel's command, over the C ABI (api/memledger.h).

    memledger predict --model=llama-3-8b --seq=4096 [--format=table]
    memledger plan --model=tiny-llama --budget_gib=0.01
    memledger search --model=llama-3-70b --seq=8192 --gpus=64 --global_batch=256 [--chart_svg=PATH]

Flags are the Bazel CLIs' request fields, written as they are: --name=value, --name value,
--flag and --noflag for booleans. Output is what the Bazel CLIs print; the exit status 0,
2 for bad input (one line on stderr; an output file that cannot be written, or that is
another output or an input, and standard output that cannot be written, a closed pipe
too), 3 when no plan or layout fits, 1 otherwise.
`memledger predict --help` (plan, search) lists each command's flags by group with their
meanings and defaults.
"""

import errno
import json
import os
import random
import stat
import string
import sys

import memledger

try:  # the Bazel CLIs' --help, put in the wheel by api/make_wheel.py
    from memledger_help import HELP
except ImportError:
    HELP = {}

# The request keys by JSON type (api/memledger.h); the rest are strings.
INTEGERS = {"layers", "width", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
            "batch", "seq", "every", "tp", "dp", "pp", "virtual_stages", "micro_batches",
            "zero", "ep", "frontier_points", "cpu_threads", "gpus", "gpus_per_node", "global_batch",
            "max_virtual_stages", "threads", "top", "planned_layouts", "checked_layouts",
            "lora_rank", "longest_seq"}
NUMBERS = {"momentum", "budget_gib", "gpu_memory_gib", "mfu", "cuda_context_mib",
           "flops_per_second", "lora_alpha", "lora_dropout", "ddp_bucket_mb"}
BOOLEANS = {"master_weights", "use_dora", "sp", "explain", "expandable_segments", "fsdp",
            "gradient_as_bucket_view"}
STRINGS = {"model", "variants", "policy", "attention", "dtype", "amp", "optimizer",
           "optimizer_impl", "checkpoint_impl", "freeze", "lora_targets", "schedule", "format", "experts_impl",
           "routing", "gpu", "device", "sdpa_backend", "cublas_workspace_config", "sweep",
           "plan", "mp_param_dtype", "mp_reduce_dtype", "offload", "offload_activations",
           # true, false, a number of ranks or auto: the C ABI reads the string.
           "reshard_after_forward"}
# Files the command writes itself from the C ABI's answers, per command: the JSON
# (--json_out), predict's timeline chart ("format": "svg") and memory snapshot
# (memledger_snapshot), search's chart.
FILES = {
    "predict": {"json_out", "timeline_svg", "snapshot_out"},
    "plan": {"json_out", "plan_out", "timeline_svg", "frontier_svg"},
    "search": {"json_out", "chart_svg"},
}
# What a file flag asks the C ABI for: a "format" (or the snapshot call); --json_out and
# --plan_out write the JSON, or a sweep's rows as printed.
FILE_FORMATS = {"json_out": "json", "plan_out": "json", "timeline_svg": "svg",
                "chart_svg": "svg", "frontier_svg": "frontier_svg"}
# A flag of the Bazel CLI's --help that the command refuses as the Bazel CLI does.
REFUSED = {("search", "timeline_svg"): "draws one step: run predict with a layout's flags"}
# Each command's own keys beyond the run's (memledger_predict's, memledger_plan's and
# memledger_search's).
OWN = {
    "predict": {"explain", "sweep", "budget_gib", "cpu_threads"},
    "plan": {"budget_gib", "frontier_points", "cpu_threads", "flops_per_second"},
    "search": {"gpus", "gpus_per_node", "global_batch", "max_virtual_stages", "threads",
               "top", "gpu", "gpu_memory_gib", "mfu", "planned_layouts", "checked_layouts",
               "longest_seq"},
}
RUN_KEYS = (INTEGERS | NUMBERS | BOOLEANS | STRINGS) - set().union(*OWN.values())
GROUPS = [
    ("model", ["model", "layers", "width", "heads", "kv_heads", "head_dim", "intermediate",
               "vocab", "attention", "experts_impl"]),
    ("input", ["batch", "seq", "sweep (predict)", "routing", "global_batch (search)",
               "longest_seq (search)"]),
    ("precision", ["dtype", "amp", "master_weights"]),
    ("optimizer", ["optimizer", "optimizer_impl", "momentum"]),
    ("fine-tuning", ["freeze", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "use_dora"]),
    ("checkpointing", ["variants", "plan", "every", "policy", "checkpoint_impl", "budget_gib",
                       "frontier_points (plan)", "flops_per_second (plan)",
                       "planned_layouts (search)"]),
    ("parallelism", ["tp", "sp", "dp", "pp", "virtual_stages", "micro_batches", "zero",
                     "ep", "schedule", "ddp_bucket_mb", "gradient_as_bucket_view", "fsdp",
                     "reshard_after_forward", "mp_param_dtype", "mp_reduce_dtype",
                     "offload", "gpus (search)", "gpus_per_node (search)",
                     "max_virtual_stages (search)"]),
    ("device", ["device", "sdpa_backend", "expandable_segments", "cuda_context_mib",
                "cublas_workspace_config", "offload_activations",
                "cpu_threads", "gpu (search)", "gpu_memory_gib (search)",
                "mfu (search)", "threads (search)", "checked_layouts (search)"]),
    ("output", ["format (json or table; csv or jsonl with --sweep)", "json_out",
                "explain (predict)", "timeline_svg", "snapshot_out (predict)",
                "plan_out (plan)", "frontier_svg (plan)", "top (search)",
                "chart_svg (search)"]),
]
COMMANDS = ("predict", "plan", "search")
INVOCATIONS = {"predict": "./bazelw run //:predict -- ", "plan": "./bazelw run //planner -- ",
               "search": "./bazelw run //planner:search -- "}


def takes(command):
    """The flags `command` takes."""
    return RUN_KEYS | OWN[command] | FILES[command]


class UsageError(Exception):
    pass


def usage(command=None):
    """The overview, or `command`'s flags by group with their meanings and defaults: its
    Bazel CLI's --help, less the flags it refuses as the Bazel CLI does."""
    if command is None or command not in HELP:
        lines = [__doc__.strip(), "", "Flags:"]
        for group, names in GROUPS:
            lines.append(f"  {group}: " + ", ".join(f"--{n}" for n in names))
        lines.append("\n`memledger predict --help` (plan, search): each flag's meaning and "
                     "default.")
        return "\n".join(lines)
    out, keep = [], True
    for line in HELP[command].replace(INVOCATIONS[command], f"memledger {command} ").splitlines():
        if line.startswith("Flags (--helpfull"):
            line = "Flags:"
        if line.startswith("  --"):  # a flag's block: kept with its description or not
            keep = line[4:].split(" ")[0] in takes(command)
        elif not line.startswith("      "):
            keep = True
        if keep:
            out.append(line)
    return "\n".join(out).rstrip() + "\n"


def parse(command, args):
    """The request dict of `command`'s `args` (flags only)."""
    request = {}
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--"):
            raise UsageError(f"unexpected argument {arg!r} (flags look like --layers=6; see --help)")
        name, eq, value = arg[2:].partition("=")
        if not eq and name.startswith("no") and name[2:] in BOOLEANS:
            request[name[2:]] = False
            continue
        if (command, name) in REFUSED:
            raise UsageError(f"--{name} {REFUSED[(command, name)]}")
        if name in set().union(*FILES.values()) - FILES[command]:
            raise UsageError(f"--{name} is not memledger {command}'s (see --help)")
        if name not in INTEGERS | NUMBERS | BOOLEANS | STRINGS | FILES[command]:
            raise UsageError(f"unknown flag --{name} (see --help)")
        if not eq:
            if name in BOOLEANS:
                request[name] = True
                continue
            if i >= len(args):
                raise UsageError(f"--{name} needs a value")
            value = args[i]
            i += 1
        try:
            if name in INTEGERS:
                request[name] = int(value)
            elif name in NUMBERS:
                request[name] = float(value)
            elif name in BOOLEANS:
                if value not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                request[name] = value in ("true", "1")
            else:
                if name not in FILES[command]:
                    # The request goes to the library as JSON, which holds only UTF-8 (an
                    # undecodable byte of argv is a lone surrogate here).
                    try:
                        value.encode("utf-8")
                    except UnicodeEncodeError:
                        raise UsageError(f"--{name}={value}: not valid UTF-8 (the flags reach "
                                         "the library as JSON)")
                request[name] = value
        except ValueError:
            raise UsageError(f"--{name}: Illegal value '{value}' specified for flag '{name}'")
    return request


def escape_for_message(text):
    """`text` with its control characters written out, so that an error stays one line and
    no escape sequence reaches the terminal: \\n, \\r and \\t as such, other C0 controls
    and DEL as \\xNN, C1 controls as \\u00NN, and each byte that was not valid UTF-8 (a
    surrogate-escaped byte of a command-line argument) as \\xNN; the twin of the
    binaries' EscapeForMessage (estimator/cli/message_escape.h)."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in "\n\r\t":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[ch])
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\x{code:02x}")
        elif 0x80 <= code <= 0x9F:
            out.append(f"\\u{code:04x}")
        elif 0xDC80 <= code <= 0xDCFF:  # os.fsdecode's surrogateescape: an invalid byte
            out.append(f"\\x{code - 0xDC00:02x}")
        elif 0xD800 <= code <= 0xDFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


def print_error(message):
    """The one error line: "error: <message>", its control characters written out."""
    print(f"error: {escape_for_message(str(message))}", file=sys.stderr)


class OutputError(Exception):
    """An output file that cannot be written: one line naming the flag and the path."""


def file_identity(path):
    """Which file `path` names: ("inode", device, inode) where it exists (through links),
    else ("path", the real path of its directory joined with its name)."""
    try:
        st = os.stat(path)
        return ("inode", st.st_dev, st.st_ino)
    except (OSError, ValueError):
        directory, name = os.path.split(path)
        return ("path", os.path.join(os.path.realpath(directory or "."), name))


# The request keys that name a file the run reads (where one exists by that name).
INPUTS = ("model", "routing", "plan")


def check_outputs(request, files):
    """Refuses, before any work, an output that is the same file as another output or as
    a file the run reads (--model's config.json, --routing's or --plan's file), as the
    binaries' OutputFiles::Claim does: OutputError naming both flags."""
    inputs = [(f"--{key}", request[key]) for key in INPUTS
              if isinstance(request.get(key), str) and request[key] not in ("balanced", "worst")
              and os.path.isfile(request[key])]
    claimed = []
    for flag, path in files.items():
        identity = file_identity(path)
        for other, other_path in inputs:
            if file_identity(other_path) == identity:
                raise OutputError(f"--{flag}={path}: is the same file as {other}={other_path}, "
                                  "which the run reads")
        for other, other_path, other_identity in claimed:
            if other_identity == identity:
                raise OutputError(f"--{flag}={path}: is the same file as --{other}={other_path}")
        claimed.append((flag, path, identity))


TEMP_MARKER = ".tmp."
TEMP_RANDOM = 6


def temp_path(target):
    """A new name beside `target` for its temporary file: the target's name, cut at a
    character's start where ".tmp.XXXXXX" would not fit the file system's longest name
    otherwise, and 6 random characters."""
    directory, name = os.path.split(target)
    try:
        name_max = os.pathconf(directory or ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    raw = os.fsencode(name)
    keep = min(len(raw), name_max - len(TEMP_MARKER) - TEMP_RANDOM)
    while 0 < keep < len(raw) and raw[keep] & 0xC0 == 0x80:  # no half UTF-8 character
        keep -= 1
    suffix = "".join(random.choice(string.ascii_letters + string.digits)
                     for _ in range(TEMP_RANDOM))
    return os.path.join(directory, os.fsdecode(raw[:keep]) + TEMP_MARKER + suffix)


def stage(flag, path, data):
    """Writes `data` (str or bytes) whole to a temporary file beside the file `path`
    names and returns (temp, target), for commit(). The target is `path`, or what it names
    if it is a symbolic link (written through: the link stays); one that exists and is
    not a regular file (a device, a FIFO, a directory) is refused, as the binaries'
    OutputFiles (estimator/cli/output_files.h) refuse it. The file gets the target's
    permission bits where it exists, else 0666 less the umask, as a shell's `>`."""
    target = path
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:  # a name too long, a file where a directory should be
        raise OutputError(f"--{flag}={path}: cannot read what is there: {e.strerror or e}")
    if st is not None and stat.S_ISLNK(st.st_mode):
        target = os.path.realpath(path)
        try:
            st = os.stat(target)
        except OSError as e:
            raise OutputError(f"--{flag}={path}: a symbolic link whose target cannot be "
                              f"resolved: {e.strerror or e}")
    if st is not None and not stat.S_ISREG(st.st_mode):
        mode = st.st_mode
        kind = ("a directory" if stat.S_ISDIR(mode) else
                "a character device" if stat.S_ISCHR(mode) else
                "a block device" if stat.S_ISBLK(mode) else
                "a FIFO" if stat.S_ISFIFO(mode) else
                "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise OutputError(f"--{flag}={path}: is {kind}, not a regular file "
                          "(only a regular file is replaced)")
    if not os.path.basename(target):
        raise OutputError(f"--{flag}={path}: names a directory (it ends in '/'), not a file")
    data = data if isinstance(data, bytes) else data.encode()
    temp, fd = None, -1
    try:
        for _ in range(100):  # O_EXCL: a new file, 0666 less the umask
            temp = temp_path(target)
            try:
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
                break
            except FileExistsError:
                continue
        else:
            raise OSError(errno.EEXIST, os.strerror(errno.EEXIST))
    except OSError as e:
        raise OutputError(f"--{flag}={path}: cannot create a temporary file beside it: "
                          f"{e.strerror or e}")
    try:
        if st is not None:  # an existing target keeps its permission bits
            os.fchmod(fd, stat.S_IMODE(st.st_mode))
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.close(fd)
        fd = -1
    except OSError as e:
        if fd >= 0:
            os.close(fd)
        os.unlink(temp)
        raise OutputError(f"--{flag}={path}: cannot write it: {e.strerror or e}")
    return temp, target


def print_out(text):
    """Writes `text` to standard output and flushes it; OutputError where that fails (a
    full disk, a closed pipe), after which what is left in the buffer goes nowhere (so
    the interpreter's exit does not fail on it again)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as e:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise OutputError(f"cannot write to standard output: {e.strerror or e}")


def commit(staged):
    """Renames every staged file over its target, removing each from `staged` once it is
    in place (what is left is the caller's to remove)."""
    while staged:
        temp, target = staged[0]
        try:
            os.replace(temp, target)
        except OSError as e:
            raise OutputError(f"{target}: cannot rename a temporary file over it: "
                              f"{e.strerror or e}")
        staged.pop(0)


def files_of(command, request, files, printed):
    """What each file flag writes: (flag, path, (code, data)) from the C ABI; `printed`
    is the command's own output (a sweep's --json_out is its rows as printed)."""
    out = []
    for flag, path in files.items():
        if flag in ("json_out", "plan_out") and "sweep" in request:
            answer = (0, printed)
        elif flag in FILE_FORMATS:
            answer = memledger._call(command, json.dumps(dict(request,
                                                              format=FILE_FORMATS[flag])))
        else:  # snapshot_out: the one variant's step as a PyTorch memory snapshot
            fields = {k: v for k, v in request.items() if k not in ("format", "explain")}
            try:
                answer = (0, memledger.snapshot(**fields))
            except ValueError as e:
                answer = (2, str(e))
        out.append((flag, path, answer))
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        if not argv or argv[0] in ("-h", "--help", "help"):
            print_out(usage() + "\n")
            return 0
        if any(a in ("-h", "--help", "--helpfull") for a in argv[1:]):
            print_out(usage(argv[0]) + ("" if argv[0] in HELP else "\n"))
            return 0
    except OutputError as e:  # the help on a full disk or a closed pipe
        print_error(e)
        return 2
    command, args = argv[0], argv[1:]
    try:
        if command not in COMMANDS:
            raise UsageError(f"unknown command {command!r}: memledger predict, plan or search")
        request = parse(command, args)
        # In the command line's order, so that an error names the later flag.
        files = {flag: request.pop(flag) for flag in list(request) if flag in FILES[command]}
        check_outputs(request, files)
    except (UsageError, OutputError) as e:
        print_error(e)
        return 2
    code, text = memledger._call(command, json.dumps(request))
    if code == 0:
        # Every file's answer first: a file flag's bad input leaves none written.
        answers = files_of(command, request, files, text)
        for flag, _, (file_code, data) in answers:
            if file_code != 0:
                code, text = file_code, data
                break
        else:
            # Every file staged, the output printed, then every file renamed into place:
            # all of them are written, or none is.
            staged = []
            try:
                for flag, path, (_, data) in answers:
                    staged.append(stage(flag, path, data))
                print_out(text)
                commit(staged)
                return 0
            except OutputError as e:
                print_error(e)
                return 2
            finally:
                for temp, _ in staged:
                    os.unlink(temp)
    if code == 0:
        try:
            print_out(text)
        except OutputError as e:
            print_error(e)
            return 2
        return 0
    print_error(text)
    return {2: 2, 3: 3}.get(code, 1)


if __name__ == "__main__":
    sys.exit(main())
