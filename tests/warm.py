"""Start a test's ``python`` commands from an interpreter that has already imported torch and transformers.

Why: the suite runs ~200 commands in child processes (``onepass train``, prepare's faults, the ranks of a
sequence-parallel run, bench and gpu-check), and each used to spend 5-7 s of CPU importing torch,
transformers, accelerate, peft and trl before its first line of work: on the 2-core CI machine that was
a third of ``make test``. Here one server per pytest process imports them once (nothing else: no onepass,
no datasets, whose arrow allocator starts a thread, and no work that would start torch's thread pools), then
forks a child per command. The child is the command as ``python`` would run it: its own argv, environment,
working directory, stdin/stdout/stderr, session if asked, ``-m module``, ``-c code`` or a script, the
interpreter's exit (non-daemon threads joined, atexit, exit status, death by signal), less the teardown of the
preloaded modules (a second of CPU a command, and nothing a command registers for its exit).

What differs from a fresh interpreter, and why it does not matter to the tests that use it: the preloaded
libraries read their environment at import (HF_HUB_OFFLINE and the other offline switches are the suite's
own, set in tests/conftest.py before the server starts; a command that changes them, or the thread count,
is started cold); the hash seed is the server's; the command is the server's child, not the test's (a test
that looks for leftovers reads the command's own descendants, by its pid). ``ONEPASS_TESTS_COLD=1`` starts
every command as a fresh interpreter, as before: the same tests, the old way (tests/test_warm.py runs a
command both ways and compares).

    proc = warm.Popen([sys.executable, "-m", "onepass", "prepare", ...], env=env, stdout=PIPE, stderr=STDOUT, text=True)
    result = warm.run([sys.executable, script, ...], capture_output=True, text=True, timeout=300)

A command whose ``argv[0]`` is not this interpreter is started by :mod:`subprocess` unchanged.
"""

from __future__ import annotations

import atexit
import importlib
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL
COLD_ENV = "ONEPASS_TESTS_COLD"

# What the server imports: the libraries every command spends its start-up on. Not onepass (a command imports
# the working tree's), not datasets or transformers.trainer (pyarrow's allocator starts a thread, and a process
# with threads must not fork).
PRELOAD = ("torch", "numpy", "jinja2", "safetensors", "tokenizers", "psutil", "transformers", "accelerate",
           "peft", "trl", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "transformers.tokenization_utils_fast", "matplotlib",
           "matplotlib.pyplot")
MODELS = ("qwen3", "qwen3_moe", "qwen3_5", "gpt_oss", "deepseek_v3", "nemotron_h", "falcon_h1", "llama")
# The tokenizer folders the server loads before it forks (tests/tokenizer_cache.py: a command's load of one is a
# copy): tests/conftest.py names the built-in Qwen3 tokenizer's, which it builds first if need be.
TOKENIZERS: Callable[[], list[str]] = list
TOKENIZERS_ENV = "ONEPASS_TESTS_TOKENIZERS"

# Read by the preloaded libraries at import (or by the interpreter at start): a command whose value differs from
# the server's is started cold. The others a command reads when it runs (ranks, ONEPASS_*, accelerate's ACCELERATE_*
# and FSDP_*, ...).
_AT_IMPORT = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS_", "TORCH_", "PYTORCH", "OMP_", "MKL_", "CUDA",
              "TOKENIZERS_", "XDG_CACHE_HOME", "TRL_", "PEFT_", "LD_", "USE_", "MPL")
_APPLIED = {"PYTHONPATH", "PYTHONFAULTHANDLER", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE"}

CPU_SECONDS = [0.0]  # CPU (user + sys) of the warm commands waited for, with their descendants: tests/cpuprof.py


# --------------------------------------------------------------------------------------------------------------
# the client: Popen and run, as subprocess's


class Popen:
    """:class:`subprocess.Popen` for ``[sys.executable, ...]``: started warm where it can be, else cold."""

    def __new__(cls, args: Sequence[str], **kw):
        if _cold_reason(args, kw) is not None:
            return subprocess.Popen(args, **kw)
        return super().__new__(cls)

    def __init__(self, args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd=None, stdin=None,
                 stdout=None, stderr=None, text: bool = False, universal_newlines: bool | None = None,
                 encoding: str | None = None, errors: str | None = None, start_new_session: bool = False):
        self.args = list(args)
        self.returncode: int | None = None
        self.cpu: float | None = None
        text = bool(text or universal_newlines or encoding or errors)
        fds, mine, self._close = [], {}, []
        for name, spec, default in (("stdin", stdin, 0), ("stdout", stdout, 1), ("stderr", stderr, 2)):
            if spec is None:
                fds.append(default)
            elif spec == DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                fds.append(fd), self._close.append(fd)
            elif spec == PIPE:
                r, w = os.pipe()
                fds.append(w), self._close.append(w)
                mine[name] = r
            elif spec == STDOUT:
                fds.append(fds[1])
            else:
                fds.append(spec if isinstance(spec, int) else spec.fileno())
        status_r, status_w = os.pipe()
        self._close.append(status_w)
        request = {"argv": self.args[1:], "env": dict(os.environ if env is None else env),
                   "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(), "session": start_new_session}
        try:
            self.pid = _server().start(request, [*fds, status_w])  # type: ignore[union-attr]: _cold_reason checked
        finally:
            for fd in self._close:
                os.close(fd)
        self._status = status_r
        self.stdin = None
        self.stdout = _reader(mine["stdout"], text, encoding, errors) if "stdout" in mine else None
        self.stderr = _reader(mine["stderr"], text, encoding, errors) if "stderr" in mine else None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._status], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._status], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        return self.returncode

    def _read_status(self) -> None:
        raw = b""
        while chunk := os.read(self._status, 4096):
            raw += chunk
        os.close(self._status)
        if not raw:
            raise RuntimeError(f"the warm server died before {self.args[1:4]}... ended (pid {self.pid})")
        status = json.loads(raw)
        self.returncode, self.cpu = status["returncode"], status["cpu"]
        CPU_SECONDS[0] += self.cpu

    def communicate(self, input=None, timeout: float | None = None):
        if input:
            raise ValueError("warm commands take no input")
        streams = [s for s in (self.stdout, self.stderr) if s is not None]
        if not hasattr(self, "_readers"):
            self._out = {id(s): [] for s in streams}
            self._readers = [threading.Thread(target=lambda s=s: self._out[id(s)].append(s.read()), daemon=True)
                             for s in streams]
            for t in self._readers:
                t.start()
        end = None if timeout is None else time.monotonic() + timeout
        for t in self._readers:
            t.join(None if end is None else max(0.0, end - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if end is None else max(0.0, end - time.monotonic()))
        got = [self._out[id(s)][0] if s is not None else None for s in (self.stdout, self.stderr)]
        for s in streams:
            s.close()
        return tuple(got)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for s in (self.stdout, self.stderr):
            if s is not None:
                s.close()
        self.wait()


def run(args: Sequence[str], *, input=None, capture_output: bool = False, timeout: float | None = None,
        check: bool = False, **kw) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` for ``[sys.executable, ...]``, started warm where it can be."""
    if capture_output:
        kw["stdout"], kw["stderr"] = PIPE, PIPE
    if input is not None or _cold_reason(args, kw) is not None:
        return subprocess.run(args, input=input, timeout=timeout, check=check, **kw)
    with Popen(args, **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, args, out, err)
    return subprocess.CompletedProcess(list(args), proc.returncode, out, err)


_CALL = """import pickle, sys
function, args = pickle.load(open(sys.argv[1], "rb"))
try:
    result = (True, function(*args))
except Exception as e:
    result = (False, e)
pickle.dump(result, open(sys.argv[2], "wb"))
"""


def call(function, *args, timeout: float | None = None):
    """``function(*args)`` in a command of its own (a warm one), as ``multiprocessing``'s spawn would run it: the
    function and arguments pickled there, the result (or the exception, raised here) pickled back."""
    import pickle
    import tempfile

    with tempfile.TemporaryDirectory(prefix="warm-call-") as folder:
        given, taken = os.path.join(folder, "given"), os.path.join(folder, "taken")
        with open(given, "wb") as f:
            pickle.dump((function, args), f)
        tests = os.path.dirname(os.path.abspath(__file__))  # a function of a test module is found there too
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
        proc = run([sys.executable, "-c", _CALL, given, taken], env=env, capture_output=True, text=True,
                   timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(taken):
            raise RuntimeError(f"{getattr(function, '__qualname__', function)} ended with {proc.returncode}:\n"
                               f"{proc.stderr[-4000:]}")
        with open(taken, "rb") as f:
            ok, value = pickle.load(f)
    if not ok:
        raise value
    return value


def _reader(fd: int, text: bool, encoding: str | None, errors: str | None):
    raw = open(fd, "rb", buffering=0 if not text else -1)
    if not text:
        return raw
    return io.TextIOWrapper(raw, encoding=encoding or "utf-8", errors=errors or "strict")


def _cold_reason(args: Sequence[str], kw: Mapping) -> str | None:
    """Why this command must start as a fresh interpreter, or None."""
    if os.environ.get(COLD_ENV):
        return COLD_ENV
    if not args or os.fspath(args[0]) != sys.executable or len(args) < 2:
        return "not this interpreter"
    if args[1].startswith("-") and args[1] not in ("-m", "-c"):
        return f"interpreter option {args[1]}"
    known = {"env", "cwd", "stdin", "stdout", "stderr", "text", "universal_newlines", "encoding", "errors",
             "start_new_session"}
    if set(kw) - known:
        return f"options {sorted(set(kw) - known)}"
    if kw.get("stdin") not in (None, DEVNULL):
        return "stdin"
    server = _server()
    if isinstance(server, str):
        return server
    env = kw.get("env")
    env = os.environ if env is None else env  # inherited: this process's now (a test may have set a variable)
    for key in set(env) | set(server.env):
        if key.startswith(_AT_IMPORT) and key not in _APPLIED and env.get(key) != server.env.get(key):
            return f"{key} differs from the server's"
    return None


# --------------------------------------------------------------------------------------------------------------
# one server per test process


class _Server:
    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = dict(os.environ)
        preload = {TOKENIZERS_ENV: os.pathsep.join(TOKENIZERS())}
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], env={**self.env, **preload},
                                     stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        ready = self.sock.recv(4096)
        if ready != b"ready":
            self.close()
            raise RuntimeError(f"no warm server: {ready.decode() or 'it exited'}")

    def start(self, request: dict, fds: list[int]) -> int:
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            reply = self.sock.recv(4096)
        if not reply:
            raise RuntimeError("the warm server is gone")
        return json.loads(reply)["pid"]

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_SERVERS: dict[int, _Server | str] = {}


def _server() -> _Server | str:
    """This process's server, started on first use; or why there is none (then every command starts cold)."""
    server = _SERVERS.get(os.getpid())
    if server is None or not isinstance(server, str) and server.proc.poll() is not None:
        try:
            server = _Server()
            atexit.register(server.close)
        except RuntimeError as e:
            server = str(e)
        _SERVERS[os.getpid()] = server
    return server


# --------------------------------------------------------------------------------------------------------------
# the server's side (python tests/warm.py --serve FD)


def _serve(fd: int):
    sock = socket.socket(fileno=fd)
    for name in [*PRELOAD, *(f"transformers.models.{m}.modeling_{m}" for m in MODELS)]:
        try:
            importlib.import_module(name)
        except ImportError:  # a release without it (transformers 5.2 has no qwen3_5): the command imports its own
            pass
    import tokenizer_cache  # tests/: each tokenizer folder read once; the ones the commands load, read here

    tokenizer_cache.install()
    tokenizer_cache.preload(os.environ.get(TOKENIZERS_ENV, ""))
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:
        names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in threads if int(t) != os.getpid())
        sock.send(f"the preloaded libraries started threads ({', '.join(names)}): a process with threads must "
                  "not fork".encode())
        return 1
    import gc

    gc.freeze()  # the preloaded objects out of every collection: a command's collections do not touch their pages
    sock.send(b"ready")
    children: dict[int, int] = {}
    while True:
        readable = select.select([sock], [], [], 0.02 if children else None)[0]
        _reap(children)
        if not readable:
            continue
        message, fds, _, _ = socket.recv_fds(sock, 1 << 22, 8)
        if not message:  # the test process is gone
            return 0
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            sock.close()
            for status in children.values():
                os.close(status)
            return _command(request, fds)
        for each in fds[:-1]:
            os.close(each)
        children[pid] = fds[-1]
        sock.send(json.dumps({"pid": pid}).encode())


def _reap(children: dict[int, int]) -> None:
    while children:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in children:
            out = children.pop(pid)
            os.write(out, json.dumps({"returncode": os.waitstatus_to_exitcode(status),
                                      "cpu": usage.ru_utime + usage.ru_stime}).encode())
            os.close(out)


def _command(request: dict, fds: list[int]):
    """In the forked child: become ``python ARGV`` in the request's environment, directory and streams, run it,
    and end as that interpreter would (:func:`_leave`); never returns."""
    stdin, stdout, stderr, status = fds
    os.close(status)
    if request["session"]:
        os.setsid()
    for target, fd in ((0, stdin), (1, stdout), (2, stderr)):
        os.dup2(fd, target)
    for fd in {stdin, stdout, stderr} - {0, 1, 2}:
        os.close(fd)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    import tempfile

    tempfile.tempdir = None  # the server's libraries asked for it under the server's TMPDIR: ask again
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if env.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    # buffered as a fresh interpreter's would be on these streams (the server's were the test process's)
    sys.stdout.reconfigure(line_buffering=os.isatty(1), write_through=bool(env.get("PYTHONUNBUFFERED")))
    sys.stderr.reconfigure(line_buffering=True, write_through=bool(env.get("PYTHONUNBUFFERED")))
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    argv = request["argv"]
    import runpy

    def excepthook(kind, value, tb, hook=sys.excepthook):  # the command's frames only, as its interpreter prints
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__, "<frozen runpy>") \
                and argv[0] != "-m" or tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        hook(kind, value.with_traceback(tb) if isinstance(value, BaseException) else value, tb)

    sys.excepthook = excepthook

    main = type(sys)("__main__")  # the command's own __main__, not this server's module
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    interrupted = False
    try:
        if argv[0] == "-m":
            sys.path[0:1] = [os.getcwd(), *extra]
            sys.argv = ["-m", *argv[2:]]
            runpy._run_module_as_main(argv[1])  # what `python -m` calls (argv[0] becomes the module's file)
        elif argv[0] == "-c":
            sys.path[0:1] = ["", *extra]
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            script = os.path.abspath(argv[0])
            sys.path[0:1] = [os.path.dirname(script), *extra]
            sys.argv = list(argv)
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:  # as the interpreter reads it: None is 0, a number the status, else printed and 1
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException as e:  # noqa: BLE001: printed as the interpreter prints an uncaught exception
        sys.excepthook(type(e), e, e.__traceback__)
        code, interrupted = 1, isinstance(e, KeyboardInterrupt)
    _leave(code, interrupted)


def _leave(code: int, interrupted: bool) -> None:
    """End as the interpreter ends a run (non-daemon threads joined, atexit's functions, the command's own
    garbage collected, the streams flushed; killed by SIGINT after a KeyboardInterrupt), but without tearing
    down the preloaded libraries' modules: that teardown writes to every object the server made, a copy of
    most of its pages, about 1 s of CPU a command; what a run must do at exit is registered with atexit
    (logging, multiprocessing, weakref.finalize, torch). multiprocessing's forked children end the same way."""
    import atexit
    import gc
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    gc.collect()  # the command's garbage only: the server's objects are frozen (gc.freeze in _serve)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe, a closed stream: nothing more to say
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    sys.exit(_serve(int(sys.argv[2])))
