"""A FAKE Hugging Face Hub on loopback, for tests of the hf:// store. Not the real Hub.

It answers, over real HTTP, just the endpoints huggingface_hub 2.4 calls for what the store does,
with the Hub's status codes and error headers (``X-Error-Code``, ``X-Error-Message``):

    GET  /api/whoami-v2                                     who the token belongs to
    POST /api/repos/create                                  create a model repo (first commit:
                                                            .gitattributes, like the Hub)
    GET  /api/models/NS/NAME[/revision/REV]                 repo info: sha, private, siblings
    POST /api/models/NS/NAME/preupload/REV                  upload mode: lfs or regular
    POST /NS/NAME.git/info/lfs/objects/batch                LFS batch, "basic" transfer only
    POST /NS/NAME.git/info/lfs/objects/verify               LFS verify
    POST /api/models/NS/NAME/commit/REV                     NDJSON commit; 412 on a stale
                                                            parentCommit
    POST /api/models/NS/NAME/paths-info/REV                 path info: git blob id, size, lfs
    GET  /api/models/NS/NAME/tree/REV[/PATH]                tree listing (one page)
    HEAD/GET /NS/NAME/resolve/REV/PATH                      download; LFS files redirect to
                                                            the storage server

A second server on another port plays the storage behind the Hub (S3 presigned upload URLs,
the CDN that serves LFS downloads): it takes no token, and huggingface_hub sends none there.
Files are kept in memory with real sha256s and git blob ids. Not implemented: Xet (tests set
``HF_HUB_DISABLE_XET``), multipart LFS, pagination, branches other than main, PRs, datasets and
spaces.

Faults: ``refuse_token``, ``fail_next`` (an HTTP status for the next matching requests),
``corrupt_next_commit`` (the next commit of a path stores other bytes, as a faulty Hub would),
``before_next_commit`` (run something, e.g. a competing ``write``, just before a commit),
``hold_uploads`` (the storage takes the first bytes of an LFS upload, then reads and answers
nothing: a Hub that stopped answering mid-upload; ``release_uploads`` closes those connections),
``slow_uploads`` (the storage reads each upload a piece at a time, pausing between: a slow link
that still moves).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import http.server
import json
import re
import secrets
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_THRESHOLD = 10 * 1024 * 1024  # the Hub keeps larger files (and binary ones) in LFS
HELD_TAKE = 64 * 1024  # what a held upload takes before the storage stops reading it
LFS_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".safetensors", ".pkl", ".npy", ".h5")
GITATTRIBUTES = (
    b"*.bin filter=lfs diff=lfs merge=lfs -text\n*.pt filter=lfs diff=lfs merge=lfs -text\n"
)
INVALID_TOKEN = "Invalid credentials in Authorization header"
STALE_PARENT = "A commit has happened since. Please refresh and try again."


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclasses.dataclass(frozen=True)
class FakeFile:
    """One file of a commit; LFS files are stored in git as a pointer."""

    content: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    @property
    def pointer(self) -> bytes:
        return (
            f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\n"
            f"size {len(self.content)}\n"
        ).encode()

    @property
    def blob_id(self) -> str:
        return git_blob_id(self.pointer if self.lfs else self.content)


@dataclasses.dataclass
class FakeRepo:
    owner: str
    name: str
    private: bool
    head: str = ""
    commits: Dict[str, Dict[str, FakeFile]] = dataclasses.field(default_factory=dict)
    lfs_objects: Dict[str, bytes] = dataclasses.field(default_factory=dict)  # sha256 -> bytes

    @property
    def repo_id(self) -> str:
        return f"{self.owner}/{self.name}"


@dataclasses.dataclass(frozen=True)
class Request:
    server: str  # "hub" or "storage"
    method: str
    path: str
    token: bool  # whether it carried an Authorization header
    status: int


class HttpError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: Optional[str] = None,
        body: Optional[Dict[str, Any]] = None,
        headers: Optional[Dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.body = {"error": message, **(body or {})}
        self.headers = dict(headers or {})
        if code:
            self.headers["X-Error-Code"] = code


@dataclasses.dataclass
class _Fault:
    method: str
    path_contains: str
    status: int
    times: int


class FakeHub:
    """The fake Hub's state, its two servers, and the faults to inject."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.tokens: Dict[str, Tuple[str, bool]] = {}  # token -> (user, may write)
        self.repos: Dict[str, FakeRepo] = {}
        self.requests: List[Request] = []  # every request answered, in order
        self.bugs: List[str] = []  # exceptions inside the fake itself: a test should fail
        self.create_payloads: List[Dict[str, Any]] = []
        self._faults: List[_Fault] = []
        self._corrupt: List[str] = []
        self._before_commit: List[Callable[[], object]] = []
        self._held: Optional[threading.Event] = None  # set: the held uploads are let go
        self._kept: List[threading.Event] = []  # of uploads held past ``recover_uploads``
        self._holding = 0  # uploads held now
        self.upload_held = threading.Event()  # set once an upload is held
        self._slow: Optional[Tuple[int, float]] = None  # (piece, pause) of slow uploads
        self.slow_pieces = 0  # pieces the slow uploads were read in
        self._tickets: Dict[str, Tuple[str, str, int]] = {}  # upload ticket -> (repo, oid, size)
        self._cdn: Dict[str, bytes] = {}  # download ticket -> bytes
        self._servers: List[http.server.ThreadingHTTPServer] = []
        self.url = ""
        self.storage_url = ""

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> FakeHub:
        for role in ("hub", "storage"):
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
            server.daemon_threads = True
            server.block_on_close = False
            server.hub = self  # type: ignore[attr-defined]
            server.role = role  # type: ignore[attr-defined]
            threading.Thread(
                target=server.serve_forever, args=(0.02,), daemon=True, name=f"fakehub-{role}"
            ).start()
            self._servers.append(server)
            url = f"http://127.0.0.1:{server.server_address[1]}"
            if role == "hub":
                self.url = url
            else:
                self.storage_url = url
        return self

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers.clear()

    # -- test controls ---------------------------------------------------------------------

    def add_token(self, token: str, user: str, write: bool = True) -> None:
        with self.lock:
            self.tokens[token] = (user, write)

    def refuse_token(self, token: str) -> None:
        """From now on ``token`` is answered 401 Invalid credentials, as a revoked one is."""
        with self.lock:
            self.tokens.pop(token, None)

    def fail_next(self, method: str, path_contains: str, status: int = 500, times: int = 1) -> None:
        """Answer the next ``times`` requests ``method`` to a path containing ``path_contains``
        with ``status`` (either server)."""
        with self.lock:
            self._faults.append(_Fault(method.upper(), path_contains, status, times))

    def corrupt_next_commit(self, path: str) -> None:
        """The next commit that writes ``path`` stores it with its first byte flipped."""
        with self.lock:
            self._corrupt.append(path)

    def before_next_commit(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` when the next commit request arrives, before it is looked at."""
        with self.lock:
            self._before_commit.append(fn)

    def hold_uploads(self) -> None:
        """From now on the storage reads the first HELD_TAKE bytes of each upload, then nothing
        more, and answers nothing, until ``release_uploads``; ``upload_held`` is set once one
        is held."""
        with self.lock:
            self._held = threading.Event()

    def release_uploads(self) -> None:
        """The held uploads' connections are closed unanswered; later uploads are taken."""
        with self.lock:
            held, self._held = self._held, None
            kept, self._kept = self._kept, []
        for h in kept + ([held] if held is not None else []):
            h.set()

    def recover_uploads(self) -> None:
        """Later uploads are taken, as by a Hub that answers again; those held stay held, their
        connections open and unread, as one the Hub lost track of, until ``release_uploads``."""
        with self.lock:
            if self._held is not None:
                self._kept.append(self._held)
            self._held = None

    def holding(self) -> int:
        """How many uploads are held now."""
        with self.lock:
            return self._holding

    def slow_uploads(self, piece: int, pause: float) -> None:
        """From now on the storage reads each upload ``piece`` bytes at a time, ``pause``
        seconds apart; ``slow_pieces`` counts the pieces."""
        with self.lock:
            self._slow = (piece, pause)

    def create_repo(self, repo_id: str, private: bool = True) -> FakeRepo:
        owner, name = repo_id.split("/")
        with self.lock:
            repo = FakeRepo(owner, name, private)
            self._commit(repo, {".gitattributes": FakeFile(GITATTRIBUTES, False)}, "initial commit")
            self.repos[repo_id] = repo
            return repo

    def write(self, repo_id: str, path: str, data: bytes, lfs: Optional[bool] = None) -> str:
        """Commit ``path`` = ``data`` from the server side (another writer); the commit id."""
        with self.lock:
            repo = self.repos[repo_id]
            tree = dict(repo.commits[repo.head])
            big = lfs if lfs is not None else _is_lfs(path, len(data), data[:512])
            tree[path] = FakeFile(data, big)
            if big:
                repo.lfs_objects[hashlib.sha256(data).hexdigest()] = data
            return self._commit(repo, tree, f"write {path}")

    def file(self, repo_id: str, path: str) -> Optional[FakeFile]:
        with self.lock:
            repo = self.repos.get(repo_id)
            return repo.commits[repo.head].get(path) if repo else None

    def paths(self, repo_id: str) -> List[str]:
        with self.lock:
            repo = self.repos[repo_id]
            return sorted(repo.commits[repo.head])

    # -- internals -------------------------------------------------------------------------

    def _commit(self, repo: FakeRepo, tree: Dict[str, FakeFile], message: str) -> str:
        h = hashlib.sha1(f"{repo.head}\n{message}\n{len(repo.commits)}\n".encode())
        for path in sorted(tree):
            h.update(f"{path} {tree[path].blob_id}\n".encode())
        sha = h.hexdigest()
        repo.commits[sha] = tree
        repo.head = sha
        return sha

    def _take_fault(self, method: str, path: str) -> Optional[int]:
        with self.lock:
            for f in self._faults:
                if f.method == method and f.path_contains in path and f.times > 0:
                    f.times -= 1
                    return f.status
        return None


def _is_lfs(path: str, size: int, sample: bytes) -> bool:
    return size >= LFS_THRESHOLD or b"\0" in sample or path.endswith(LFS_SUFFIXES)


def _tree_id(paths: List[str]) -> str:
    return hashlib.sha1("\n".join(paths).encode()).hexdigest()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as huggingface_hub's pooled client expects
    disable_nagle_algorithm = True  # headers and body go out as separate writes

    # -- plumbing --------------------------------------------------------------------------

    def log_message(self, format: str, *args: Any) -> None:
        pass

    @property
    def hub(self) -> FakeHub:
        hub: FakeHub = self.server.hub  # type: ignore[attr-defined]
        return hub

    def _held(self) -> bool:
        """An upload to the storage while uploads are held: its first bytes taken, then held
        until released, and its connection closed unanswered (True)."""
        role: str = self.server.role  # type: ignore[attr-defined]
        with self.hub.lock:
            held = self.hub._held
        if role != "storage" or self.command != "PUT" or held is None:
            return False
        self.rfile.read(min(HELD_TAKE, int(self.headers.get("Content-Length") or 0)))
        with self.hub.lock:
            self.hub._holding += 1
        self.hub.upload_held.set()
        held.wait()
        with self.hub.lock:
            self.hub._holding -= 1
        self.close_connection = True
        return True

    def _slow_body(self, piece: int, pause: float) -> bytes:
        # A small receive buffer of a fixed size (the kernel's would grow to megabytes): what
        # the client has sent and the storage not yet read stays small.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * 1024)
        out = bytearray()
        left = int(self.headers.get("Content-Length") or 0)
        while left > 0:
            b = self.rfile.read(min(piece, left))
            if not b:
                break
            out += b
            left -= len(b)
            self.hub.slow_pieces += 1
            time.sleep(pause)
        return bytes(out)

    def _body(self) -> bytes:
        slow = self.hub._slow
        if slow is not None and self.server.role == "storage":  # type: ignore[attr-defined]
            return self._slow_body(*slow)
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                n = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if n == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(n)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(
        self,
        status: int,
        body: bytes = b"",
        headers: Optional[Dict[str, str]] = None,
        content_type: str = "application/json",
    ) -> None:
        role: str = self.server.role  # type: ignore[attr-defined]
        path = urlsplit(self.path).path
        self.hub.requests.append(
            Request(role, self.command, path, "Authorization" in self.headers, status)
        )
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any, headers: Optional[Dict[str, str]] = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def do_GET(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        parts = urlsplit(self.path)
        role: str = self.server.role  # type: ignore[attr-defined]
        if self._held():
            return
        body = self._body() if self.command in ("POST", "PUT") else b""
        try:
            status = self.hub._take_fault(self.command, parts.path)
            if status is not None:
                raise HttpError(status, f"fake fault: HTTP {status}")
            routes = _STORAGE_ROUTES if role == "storage" else _HUB_ROUTES
            for method, pattern, fn in routes:
                m = pattern.fullmatch(parts.path)
                if m and method == self.command:
                    groups = [unquote(g) if g is not None else None for g in m.groups()]
                    fn(self, parse_qs(parts.query), body, *groups)
                    return
            raise HttpError(404, f"fake hub: no route for {self.command} {parts.path}")
        except HttpError as e:
            self._json(e.status, e.body, e.headers)
        except Exception as e:  # a bug of the fake: answer, and let the test fail on it
            self.hub.bugs.append(f"{self.command} {parts.path}: {e!r}")
            self._json(500, {"error": f"fake hub bug: {e!r}"})

    # -- auth ------------------------------------------------------------------------------

    def _user(self) -> Tuple[Optional[str], bool]:
        auth = self.headers.get("Authorization")
        if not auth:
            return None, False
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else auth
        with self.hub.lock:
            found = self.hub.tokens.get(token)
        if found is None:
            raise HttpError(401, INVALID_TOKEN, headers={"X-Error-Message": INVALID_TOKEN})
        return found

    def _repo(self, ns: str, name: str, write: bool = False) -> FakeRepo:
        user, may_write = self._user()
        repo = self.hub.repos.get(f"{ns}/{name}")
        if repo is None or (repo.private and user != repo.owner):
            status = 401 if user is None else 404
            raise HttpError(status, "Repository not found", "RepoNotFound")
        if write and user is None:
            raise HttpError(401, "You must be authenticated to write", "RepoNotFound")
        if write and (user != repo.owner or not may_write):
            raise HttpError(403, f"You don't have the rights to write to {repo.repo_id}")
        return repo

    @staticmethod
    def _rev(repo: FakeRepo, rev: str) -> str:
        if rev == "main":
            return repo.head
        hits = [sha for sha in repo.commits if len(rev) >= 7 and sha.startswith(rev)]
        if len(hits) != 1:
            raise HttpError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return hits[0]

    @staticmethod
    def _entry(path: str, f: FakeFile) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "type": "file",
            "oid": f.blob_id,
            "size": len(f.content),
            "path": path,
        }
        if f.lfs:
            out["lfs"] = {"oid": f.sha256, "size": len(f.content), "pointerSize": len(f.pointer)}
        return out

    # -- hub endpoints ---------------------------------------------------------------------

    def create_repo(self, query: Any, body: bytes) -> None:
        user, may_write = self._user()
        if user is None:
            raise HttpError(401, "You must be authenticated to create a repo")
        req = json.loads(body)
        self.hub.create_payloads.append(req)
        if req.get("type", "model") != "model":
            raise HttpError(400, "the fake hub has model repos only")
        ns, name = req.get("organization") or user, req["name"]
        if ns != user or not may_write:
            raise HttpError(403, f"You don't have the rights to create a model under {ns}")
        repo_id = f"{ns}/{name}"
        url = f"{self.hub.url}/{repo_id}"
        with self.hub.lock:
            if repo_id in self.hub.repos:
                raise HttpError(409, "You already created this model repo", body={"url": url})
            private = bool(req.get("private")) or req.get("visibility") == "private"
            self.hub.create_repo(repo_id, private)
        self._json(200, {"url": url, "name": repo_id, "id": repo_id})

    def whoami(self, query: Any, body: bytes) -> None:
        user, may_write = self._user()
        if user is None:
            raise HttpError(401, "Invalid username or password.")
        role = "write" if may_write else "read"
        self._json(200, {"type": "user", "name": user, "auth": {"accessToken": {"role": role}}})

    def model_info(self, query: Any, body: bytes, ns: str, name: str, rev: Optional[str]) -> None:
        repo = self._repo(ns, name)
        with self.hub.lock:
            sha = self._rev(repo, rev or "main")
            siblings = [{"rfilename": p} for p in sorted(repo.commits[sha])]
        self._json(
            200,
            {
                "_id": repo.repo_id,
                "id": repo.repo_id,
                "author": repo.owner,
                "private": repo.private,
                "sha": sha,
                "siblings": siblings,
            },
        )

    def preupload(self, query: Any, body: bytes, ns: str, name: str, rev: str) -> None:
        repo = self._repo(ns, name, write=True)
        files = []
        with self.hub.lock:
            tree = repo.commits[self._rev(repo, rev)]
            for f in json.loads(body)["files"]:
                sample = base64.b64decode(f["sample"])
                lfs = _is_lfs(f["path"], int(f["size"]), sample)
                old = tree.get(f["path"])
                oid = None if old is None else (old.sha256 if old.lfs else old.blob_id)
                files.append(
                    {
                        "path": f["path"],
                        "uploadMode": "lfs" if lfs else "regular",
                        "shouldIgnore": False,
                        "oid": oid,
                    }
                )
        self._json(200, {"files": files, "commitOid": repo.head})

    def lfs_batch(self, query: Any, body: bytes, ns: str, name: str) -> None:
        repo = self._repo(ns, name, write=True)
        req = json.loads(body)
        if req.get("operation") != "upload" or "basic" not in req.get("transfers", ["basic"]):
            raise HttpError(400, "the fake hub does basic LFS uploads only")
        objects = []
        with self.hub.lock:
            for o in req["objects"]:
                oid, size = o["oid"], int(o["size"])
                obj: Dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
                if oid not in repo.lfs_objects:
                    ticket = secrets.token_hex(8)
                    self.hub._tickets[ticket] = (repo.repo_id, oid, size)
                    obj["actions"] = {
                        "upload": {"href": f"{self.hub.storage_url}/upload/{ticket}"},
                        "verify": {
                            "href": f"{self.hub.url}/{repo.repo_id}.git/info/lfs/objects/verify"
                        },
                    }
                objects.append(obj)
        self._send(
            200,
            json.dumps({"transfer": "basic", "objects": objects}).encode(),
            content_type="application/vnd.git-lfs+json",
        )

    def lfs_verify(self, query: Any, body: bytes, ns: str, name: str) -> None:
        repo = self._repo(ns, name, write=True)
        req = json.loads(body)
        with self.hub.lock:
            data = repo.lfs_objects.get(req["oid"])
        if data is None or len(data) != int(req["size"]):
            raise HttpError(404, f"LFS object {req['oid']} not found")
        self._json(200, {})

    def commit(self, query: Any, body: bytes, ns: str, name: str, rev: str) -> None:
        with self.hub.lock:
            hooks, self.hub._before_commit = self.hub._before_commit, []
        for fn in hooks:
            fn()
        repo = self._repo(ns, name, write=True)
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header: Dict[str, Any] = next((x["value"] for x in lines if x["key"] == "header"), {})
        with self.hub.lock:
            base = self._rev(repo, rev)
            parent = header.get("parentCommit")
            if parent is not None and not base.startswith(parent):
                raise HttpError(412, STALE_PARENT)
            tree = dict(repo.commits[base])
            written = []
            for x in lines:
                key, v = x["key"], x["value"]
                if key == "file":
                    tree[v["path"]] = FakeFile(base64.b64decode(v["content"]), False)
                elif key == "lfsFile":
                    data = repo.lfs_objects.get(v["oid"])
                    if data is None:
                        raise HttpError(
                            422,
                            "Your push was rejected because an LFS pointer pointed to a file "
                            "that does not exist",
                        )
                    tree[v["path"]] = FakeFile(data, True)
                elif key == "deletedFile":
                    if v["path"] not in tree:
                        raise HttpError(404, "A file with this name doesn't exist", "EntryNotFound")
                    del tree[v["path"]]
                elif key == "deletedFolder":
                    folder = v["path"].rstrip("/") + "/"
                    tree = {p: f for p, f in tree.items() if not p.startswith(folder)}
                elif key != "header":
                    raise HttpError(400, f"the fake hub does not do {key!r} operations")
                if key in ("file", "lfsFile"):
                    written.append(v["path"])
            for path in written:
                if path in self.hub._corrupt:
                    self.hub._corrupt.remove(path)
                    f = tree[path]
                    bad = bytes([f.content[0] ^ 0xFF]) + f.content[1:] if f.content else b"x"
                    tree[path] = FakeFile(bad, f.lfs)
            sha = self.hub._commit(repo, tree, header.get("summary", ""))
        self._json(
            200,
            {
                "success": True,
                "commitOid": sha,
                "commitUrl": f"{self.hub.url}/{repo.repo_id}/commit/{sha}",
                "hookOutput": "",
            },
        )

    def paths_info(self, query: Any, body: bytes, ns: str, name: str, rev: str) -> None:
        repo = self._repo(ns, name)
        form = parse_qs(body.decode())
        out = []
        with self.hub.lock:
            tree = repo.commits[self._rev(repo, rev)]
            for path in form.get("paths", []):
                path = path.strip("/")
                if path in tree:
                    out.append(self._entry(path, tree[path]))
                else:
                    under = sorted(p for p in tree if p.startswith(path + "/"))
                    if under:
                        out.append(
                            {"type": "directory", "oid": _tree_id(under), "size": 0, "path": path}
                        )
        self._json(200, out)

    def tree(
        self, query: Any, body: bytes, ns: str, name: str, rev: str, path: Optional[str]
    ) -> None:
        repo = self._repo(ns, name)
        recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
        folder = (path or "").strip("/")
        with self.hub.lock:
            sha = self._rev(repo, rev)
            tree = repo.commits[sha]
            start = folder + "/" if folder else ""
            under = sorted(p for p in tree if p.startswith(start))
            if folder and not under:
                raise HttpError(
                    404,
                    f"{folder} does not exist on main",
                    "EntryNotFound",
                    headers={"X-Repo-Commit": sha},
                )
            out: List[Dict[str, Any]] = []
            dirs: Dict[str, List[str]] = {}
            for p in under:
                rest = p[len(start) :].split("/")
                for i in range(1, len(rest)):
                    if recursive or i == 1:
                        dirs.setdefault(start + "/".join(rest[:i]), []).append(p)
                if recursive or len(rest) == 1:
                    out.append(self._entry(p, tree[p]))
            for d, ps in dirs.items():
                out.append({"type": "directory", "oid": _tree_id(ps), "size": 0, "path": d})
        self._json(200, sorted(out, key=lambda e: str(e["path"])))

    def resolve(self, query: Any, body: bytes, ns: str, name: str, rev: str, path: str) -> None:
        repo = self._repo(ns, name)
        with self.hub.lock:
            sha = self._rev(repo, rev)
            f = repo.commits[sha].get(path)
            if f is None:
                raise HttpError(
                    404, "Entry not found", "EntryNotFound", headers={"X-Repo-Commit": sha}
                )
            headers = {"X-Repo-Commit": sha, "ETag": f'"{f.blob_id}"'}
            if f.lfs:
                ticket = secrets.token_hex(8)
                self.hub._cdn[ticket] = f.content
                headers.update(
                    {
                        "Location": f"{self.hub.storage_url}/cdn/{ticket}/{quote(path)}",
                        "X-Linked-Etag": f'"{f.sha256}"',
                        "X-Linked-Size": str(len(f.content)),
                    }
                )
        if f.lfs:
            self._send(302, b"", headers)
        else:
            self._send(200, f.content, headers, "application/octet-stream")

    # -- storage endpoints (no token) ------------------------------------------------------

    def upload(self, query: Any, body: bytes, ticket: str) -> None:
        with self.hub.lock:
            found = self.hub._tickets.get(ticket)
            if found is None:
                raise HttpError(403, "unknown or expired upload URL")
            repo_id, oid, size = found
            # content-addressed: the storage refuses bytes that are not the object announced
            if len(body) != size or hashlib.sha256(body).hexdigest() != oid:
                raise HttpError(400, "the uploaded bytes do not match the announced oid and size")
            self.hub.repos[repo_id].lfs_objects[oid] = body
        self._send(200, b"", {"ETag": f'"{hashlib.md5(body).hexdigest()}"'})

    def cdn(self, query: Any, body: bytes, ticket: str, name: str) -> None:
        with self.hub.lock:
            data = self.hub._cdn.get(ticket)
        if data is None:
            raise HttpError(403, "unknown or expired download URL")
        self._send(200, data, None, "application/octet-stream")


_R = r"/api/models/([^/]+)/([^/]+)"
_HUB_ROUTES: List[Tuple[str, re.Pattern[str], Callable[..., None]]] = [
    ("POST", re.compile(r"/api/repos/create"), _Handler.create_repo),
    ("GET", re.compile(r"/api/whoami-v2"), _Handler.whoami),
    ("GET", re.compile(_R + r"(?:/revision/([^/]+))?"), _Handler.model_info),
    ("POST", re.compile(_R + r"/preupload/([^/]+)"), _Handler.preupload),
    ("POST", re.compile(_R + r"/commit/([^/]+)"), _Handler.commit),
    ("POST", re.compile(_R + r"/paths-info/([^/]+)"), _Handler.paths_info),
    ("GET", re.compile(_R + r"/tree/([^/]+)(?:/(.+))?"), _Handler.tree),
    ("POST", re.compile(r"/([^/]+)/([^/]+)\.git/info/lfs/objects/batch"), _Handler.lfs_batch),
    ("POST", re.compile(r"/([^/]+)/([^/]+)\.git/info/lfs/objects/verify"), _Handler.lfs_verify),
    ("HEAD", re.compile(r"/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)"), _Handler.resolve),
    ("GET", re.compile(r"/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)"), _Handler.resolve),
]
_STORAGE_ROUTES: List[Tuple[str, re.Pattern[str], Callable[..., None]]] = [
    ("PUT", re.compile(r"/upload/([0-9a-f]+)"), _Handler.upload),
    ("GET", re.compile(r"/cdn/([0-9a-f]+)/(.+)"), _Handler.cdn),
    ("HEAD", re.compile(r"/cdn/([0-9a-f]+)/(.+)"), _Handler.cdn),
]
