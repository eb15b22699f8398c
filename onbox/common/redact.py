"""The one redactor: every string rgt writes or uploads passes through it (invariant I8).

It knows the secret values of the box's runs (the JSON objects ``rgt-agent secrets NAME`` wrote
to ``$RGT_HOME/secrets/NAME``) and the values of credential-named variables in rgt's own
environment (``*_TOKEN``, ``*SECRET*``, ``*PASSWORD*``, ...: the store's credentials). Each value
is masked together with its common encodings: the value itself, base64 (standard and urlsafe,
padded or not, and at each of the 3 alignments it can have inside a longer base64 string),
URL-encoded (``quote``, ``quote_plus``) and JSON-escaped. Known token shapes are masked whatever
their value: Hugging Face ``hf_...`` tokens, AWS ``AKIA...``/``ASIA...`` key ids, presigned
``X-Amz-Signature=``/``X-Amz-Security-Token=``, ``scheme://user:PASSWORD@``, GitHub tokens and
``Authorization:`` headers.

Where it runs: the journal (state.json, events.jsonl, agent.log), status output, the store's
``state/`` mirror, the agent's own stdout/stderr, the CLI's error line, and the copy of a job's
log that is sealed to the store (the job's own ``output.log`` on the box stays unaltered).

Standard library only, imported by the shim: nothing is compiled or computed at import, and
the encodings (base64, urllib) are imported only once a value needs them.
"""

from __future__ import annotations

import json
import os
import re

TYPE_CHECKING = False
if TYPE_CHECKING:  # the shim imports this module: typing would cost it ~2 MiB
    from typing import Any, Callable, Dict, Iterable, List, Optional, Set, TextIO, Tuple

MARK = "[redacted]"
# A value shorter than this is not matched by value: a 3-character "secret" (a test's "abc", a
# PIN) occurs by chance in ordinary text and masking every occurrence would destroy messages
# (paths, numbers, words) without protecting much. Token shapes are matched regardless.
MIN_SECRET_LEN = 6
# Environment variables whose values rgt treats as secrets too: the store's credentials
# (AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, HF_TOKEN) and their usual relatives. Names that
# point at a file or directory hold a path, not a secret.
_SECRET_VAR = r"(?i)(TOKEN|SECRET|PASSW(OR)?D|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY)"
_PATH_VAR = r"(?i)_(FILE|PATH|DIR|HOME)$"

# (label, pattern, group): the group is what is masked, so ``X-Amz-Signature=`` stays readable.
_SHAPES = (
    ("an hf_ token", r"(?<![A-Za-z0-9_])hf_[A-Za-z0-9]{20,}", 0),
    ("an AWS key id", r"(?<![A-Z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Z0-9])", 0),
    ("an X-Amz-Signature", r"(?i)X-Amz-Signature=([0-9a-f]+)", 1),
    ("an X-Amz-Security-Token", r"(?i)X-Amz-Security-Token=([^&\s\"'<>]+)", 1),
    ("a password in a URL", r"(?i)\b[a-z][a-z0-9+.-]*://[^\s/:@\"'<>]*:([^\s/@\"'<>]+)@", 1),
    ("a GitHub token", r"(?<![A-Za-z0-9_])(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_\w{30,})", 0),
    ("an Authorization header", r"(?i)\bAuthorization:\s*(?:Bearer|Basic|token)\s+(\S+)", 1),
)
_compiled: List[Tuple[str, Any, int]] = []

# Streaming a file: text kept back at the end of each chunk, so that a value split across two
# reads is still seen whole (longer than any encoded secret or token shape in practice).
_CHUNK = 1 << 20
_KEEP = 1 << 16


def _shapes() -> List[Tuple[str, Any, int]]:
    if not _compiled:
        _compiled.extend((label, re.compile(rx), g) for label, rx, g in _SHAPES)
    return _compiled


def encodings(value: str) -> List[str]:
    """Every form of ``value`` the redactor masks (empty for a value too short to match)."""
    if len(value) < MIN_SECRET_LEN:
        return []
    import base64
    from urllib.parse import quote, quote_plus

    raw = value.encode("utf-8", "surrogateescape")
    full = base64.b64encode(raw).decode("ascii")
    b64 = {full, full.rstrip("=")}
    # Inside a longer base64 string the value starts at an offset k (mod 3) it does not choose:
    # encode it after k placeholder bytes and keep only the characters that depend on its own
    # bits alone (the first ones mix in the preceding bytes, the last one the following). Up
    # to 4 bits at each edge stay visible; the value cannot be read back from them.
    for k in (0, 1, 2):
        enc = base64.b64encode(b"\0" * k + raw).decode("ascii").rstrip("=")
        bits = 8 * (k + len(raw))
        b64.add(enc[-(-8 * k // 6) : bits // 6])
    forms = {value} | b64 | {f.replace("+", "-").replace("/", "_") for f in b64}
    for q in (quote(value, safe=""), quote(value), quote_plus(value)):
        forms.update((q, re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), q)))
    forms.add(json.dumps(value)[1:-1])
    forms.add(json.dumps(value, ensure_ascii=False)[1:-1])
    # Longest first, so that the report of which secret matched prefers the most specific.
    return sorted((f for f in forms if len(f) >= MIN_SECRET_LEN), key=lambda f: (-len(f), f))


class Redactor:
    """Masks the given secret values (with their encodings) and the known token shapes."""

    def __init__(self, secrets: Iterable[Tuple[str, str]] = ()) -> None:
        """``secrets``: (label, value) pairs; the label (a variable name) is what reports say,
        never the value."""
        self._forms: List[Tuple[str, str]] = []
        seen: Set[str] = set()
        for label, value in secrets:
            for form in encodings(value):
                if form not in seen:
                    seen.add(form)
                    self._forms.append((form, label))
        self.longest = max((len(f) for f, _ in self._forms), default=0)

    def matches(self, text: str) -> List[Tuple[int, int, str]]:
        """(start, end, label) of every occurrence, overlapping ones included."""
        out = []
        for form, label in self._forms:
            i = text.find(form)
            while i >= 0:
                out.append((i, i + len(form), label))
                i = text.find(form, i + 1)
        for label, rx, group in _shapes():
            for m in rx.finditer(text):
                if m.end(group) > m.start(group):
                    out.append((m.start(group), m.end(group), label))
        return out

    def found(self, text: str) -> List[str]:
        """Labels of what ``text`` holds (secret names, token shapes), sorted; never values."""
        return sorted({label for _, _, label in self.matches(text)})

    def redact(self, text: str) -> str:
        """``text`` with each run of overlapping matches replaced by one MARK."""
        return _replace(text, _merge(self.matches(text)))

    def redact_bytes(self, data: bytes) -> bytes:
        """``redact`` of bytes; bytes that are not UTF-8 pass through unchanged."""
        text = data.decode("utf-8", "surrogateescape")
        out = self.redact(text)
        return data if out == text else out.encode("utf-8", "surrogateescape")

    def redact_obj(self, obj: Any) -> Any:
        """A JSON-like document with every string in it (keys too) redacted."""
        if isinstance(obj, str):
            return self.redact(obj)
        if isinstance(obj, dict):
            return {self.redact_obj(k): self.redact_obj(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.redact_obj(v) for v in obj]
        return obj

    def scan_file(self, path: str) -> List[str]:
        """Labels of what the file holds, read in chunks; the file is not changed."""
        return sorted(self._stream(path, None))

    def redact_file(self, src: str, dst: str) -> List[str]:
        """Write a redacted copy of ``src`` to ``dst`` (0600, fsynced); returns the labels."""
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as out:
            labels = self._stream(src, lambda s: out.write(s.encode("utf-8", "surrogateescape")))
            out.flush()
            os.fsync(out.fileno())
        return sorted(labels)

    def _stream(self, path: str, write: Optional[Callable[[str], Any]]) -> Set[str]:
        import codecs

        decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
        keep = max(_KEEP, 2 * self.longest)
        labels: Set[str] = set()
        buf = ""
        with open(path, "rb") as f:
            while True:
                chunk = f.read(_CHUNK)
                buf += decoder.decode(chunk, final=not chunk)
                found = self.matches(buf)
                spans = _merge(found)
                cut = len(buf)
                if chunk:  # keep the end back; never cut through a match
                    cut = max(0, len(buf) - keep)
                    for s, e in spans:
                        if s < cut < e:
                            cut = s
                labels.update(label for _, e, label in found if e <= cut)
                if write is not None:
                    write(_replace(buf[:cut], [(s, e) for s, e in spans if e <= cut]))
                buf = buf[cut:]
                if not chunk:
                    return labels


def _merge(found: List[Tuple[int, int, str]]) -> List[Tuple[int, int]]:
    """Overlapping or touching spans as one: two secrets that overlap leave nothing between."""
    spans: List[Tuple[int, int]] = []
    for s, e, _ in sorted(found):
        if spans and s <= spans[-1][1]:
            if e > spans[-1][1]:
                spans[-1] = (spans[-1][0], e)
        else:
            spans.append((s, e))
    return spans


def _replace(text: str, spans: List[Tuple[int, int]]) -> str:
    if not spans:
        return text
    parts, at = [], 0
    for s, e in spans:
        parts += [text[at:s], MARK]
        at = e
    parts.append(text[at:])
    return "".join(parts)


# ---- the box's secrets
_cache: Dict[str, Tuple[Any, Redactor]] = {}


def _secrets_dir(home: str) -> str:
    # The same place as RunDir.secrets_file (onbox/common/rundir.py), for every run at once.
    return os.path.join(home, "secrets")


def _signature(home: str) -> Tuple[Tuple[str, int, int, int], ...]:
    d = _secrets_dir(home)
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return ()
    sig = []
    for n in names:
        try:
            st = os.stat(os.path.join(d, n))
        except OSError:
            continue
        sig.append((n, st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(sig)


def box_secrets(home: str, environ: Optional[Dict[str, str]] = None) -> List[Tuple[str, str]]:
    """(name, value) of every secret of every run under ``home``, and of rgt's own
    credential-named environment variables. Every run's, not one's: a value that is a secret
    of one run is masked wherever it shows up."""
    out: List[Tuple[str, str]] = []
    d = _secrets_dir(home)
    for name, *_ in _signature(home):
        try:
            with open(os.path.join(d, name), "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            out += [(k, v) for k, v in sorted(doc.items()) if isinstance(v, str)]
    env = os.environ if environ is None else environ
    secret_var, path_var = re.compile(_SECRET_VAR), re.compile(_PATH_VAR)
    for k, v in sorted(env.items()):
        if secret_var.search(k) and not path_var.search(k):
            out.append((k, v))
    return out


def for_home(home: Optional[str] = None) -> Redactor:
    """The redactor of the box's RGT_HOME (default: $RGT_HOME or ~/.rgt). Cached; built again
    when a secrets file changes (`rgt-agent secrets` while a run is live)."""
    if home is None:
        from onbox.common.rundir import rgt_home

        home = rgt_home()
    sig = _signature(home)
    hit = _cache.get(home)
    if hit is not None and hit[0] == sig:
        return hit[1]
    red = Redactor(box_secrets(home))
    _cache[home] = (sig, red)
    return red


def for_run_file(path: str) -> Redactor:
    """The redactor for a file of a run (``<home>/runs/<name>/<file>``): that home's."""
    run_dir = os.path.dirname(os.path.abspath(path))
    runs = os.path.dirname(run_dir)
    if os.path.basename(runs) == "runs":
        return for_home(os.path.dirname(runs))
    return for_home()


class RedactingStream:
    """A text stream that redacts whole lines before passing them on: for the agent's own
    stdout and stderr (tracebacks, warnings), which go to agent.log. Has what the interpreter
    and the standard library use of sys.stderr (cast it to TextIO to put it there)."""

    def __init__(self, inner: TextIO, redactor: Callable[[], Redactor]) -> None:
        import threading

        self.inner = inner
        self.redactor = redactor
        self.encoding = inner.encoding
        self.errors = inner.errors
        self._buf = ""
        self._lock = threading.Lock()  # the sealer thread prints too

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self.inner.isatty()

    def fileno(self) -> int:
        return self.inner.fileno()

    def write(self, s: str) -> int:
        with self._lock:
            self._buf += s
            if "\n" in self._buf:  # an interpreter prints a line in pieces: redact whole lines
                head, _, self._buf = self._buf.rpartition("\n")
                self.inner.write(self.redactor().redact(head + "\n"))
        return len(s)

    def flush(self) -> None:
        with self._lock:
            if self._buf:
                self.inner.write(self.redactor().redact(self._buf))
                self._buf = ""
        self.inner.flush()
