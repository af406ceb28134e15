"""What a content part may make mmferry read, and reading it: paths, `file:`, `data:`, http(s).

A `SourcePolicy` says what is allowed. A library call reads the paths its caller names and no
network; a service narrows paths to allowed folders, may allow hosts, caps sizes and counts, and
refuses in-memory objects. Everything that needs no I/O (the URL's syntax, its scheme, an allowed
host, a data: URL's media type and size) is checked when a part is parsed; files are opened
once, checked and read from that one descriptor. Every refusal carries an HTTP status and a kind
(`PartError`), so a service answers with them as they are.
"""

from __future__ import annotations

import binascii
import errno
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import SplitResult, unquote, urlsplit

from mmferry.chat.base64_text import decode_base64

Modality = Literal["image", "video"]
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # never valid in a URL (RFC 3986)


def shown(value: object, width: int = 60) -> str:
    """A client's value for an error message: short, and never a deep structure's repr."""
    # NOTE: a message must not echo a 30 MB string back, nor recurse into nested lists.
    if isinstance(value, (str, bytes)):
        text = repr(value[:width])
        return text + f"... ({len(value)} characters)" if len(value) > width else text
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)[:width]
    if isinstance(value, (list, tuple)):
        return "a JSON array"
    return "a JSON object" if isinstance(value, Mapping) else f"a {type(value).__name__}"


class PartError(ValueError):
    """A content part that cannot be used; `kind` and `status` say why, for a service's reply."""

    def __init__(
        self,
        message: str,
        *,
        kind: str = "bad_request",
        status: int = 422,
        message_index: int | None = None,
        part_index: int | None = None,
    ) -> None:
        super().__init__(message)
        self.kind, self.status = kind, status
        self.message_index, self.part_index = message_index, part_index


# (text, kind=, status=) -> a PartError naming the part.
Bad = Callable[..., PartError]


@dataclass(frozen=True)
class SourcePolicy:
    """What a part may make mmferry read.

    - `allow_paths`: None reads any local path the caller names (a library call); a tuple
      reads only files under those folders (after resolving links and '..').
    - `relative_paths`: False refuses a path that is not absolute (a service: its working
      folder is nobody's business).
    - `allow_hosts`: hosts (or host:port; "::1", "[::1]" or "[::1]:8000") whose http(s) URLs
      are fetched; none by default.
    - `max_bytes`: the largest source read, fetched or decoded from a data: URL (413).
    - `max_items`: the most images and videos one conversation (or content list) holds (422).
    - `allow_objects`: in-memory sources (PIL images, arrays, bytes) are taken as given.
    - `defer_reads`: parse and check now, read later: a part's source stays a `Reference`
      (see `read_part`), so a service reads files on its workers and fetches on its own loop.
    - `fetch`: `(url, max_bytes, timeout_s) -> bytes` for allowed hosts (default: urllib,
      no redirects).
    - `option_names`: how the caller's users set these limits, for messages
      (`{"max_bytes": "--limit-request-bytes", "allow_hosts": "--allow-host", ...}`).
    """

    allow_paths: tuple[str, ...] | None = None
    relative_paths: bool = True
    allow_hosts: tuple[str, ...] = ()
    max_bytes: int | None = None
    max_items: int | None = None
    fetch_timeout_s: float = 30.0
    allow_objects: bool = True
    defer_reads: bool = False
    fetch: Callable[[str, int | None, float], bytes] | None = field(default=None, compare=False)
    option_names: Mapping[str, str] = field(default_factory=dict, compare=False)

    def named(self, name: str) -> str:
        """How a message names the setting `name`: the caller's option, or the field."""
        return self.option_names.get(name, name)


LIBRARY_POLICY = SourcePolicy()


@dataclass(frozen=True)
class Reference:
    """A source named by a string, checked but not read yet (a policy with `defer_reads`)."""

    scheme: Literal["data", "path", "remote"]
    # The base64 payload (data), the file's path (path, file: URLs unquoted), or the URL.
    value: str
    media_type: str = ""  # a data: URL's, in lower case ("" for a bare base64 payload)


def over_bytes(what: str, size: int, policy: SourcePolicy, bad: Bad) -> PartError:
    """413 for a source over `policy.max_bytes`."""
    hint = f" ({policy.named('max_bytes')})" if "max_bytes" in policy.option_names else ""
    return bad(
        f"{what} is {size} bytes, over {policy.max_bytes} bytes{hint}",
        kind="too_large",
        status=413,
    )


def _split(url: str, bad: Bad) -> SplitResult:
    """`url` split into its parts; 400 for one that no client library would send."""
    control = _CONTROL.search(url)
    if control:
        raise bad(
            f"the URL has a control character {control.group()!r} at position {control.start()}",
            kind="bad_url",
            status=400,
        )
    if "\\" in url:
        # NOTE: RFC 3986 parsers (urllib, httpx) read "http://a\@b/" as host b, WHATWG ones
        # (browsers, some fetchers) as host a: a URL whose host depends on who reads it is
        # refused, whoever fetches it later.
        raise bad(
            f"the URL {shown(url)} holds a backslash, which is no URL character; send it "
            "percent-encoded (%5C)",
            kind="bad_url",
            status=400,
        )
    try:
        split = urlsplit(url)
        split.port  # noqa: B018 - parsed on access: raises for a port that is not a number
    except ValueError as e:
        raise bad(f"malformed URL {shown(url)} ({e})", kind="bad_url", status=400) from None
    return split


def _data_url(url: str, modality: Modality, policy: SourcePolicy, bad: Bad) -> Reference:
    head, sep, payload = url.partition(",")
    if not sep:
        raise bad("a data: URL needs a ',' before its payload", status=400)
    # NOTE: media types and their parameters are case-insensitive (RFC 2045, RFC 2397).
    mime, *params = (p.strip().lower() for p in head[len("data:") :].split(";"))
    if not mime.startswith(f"{modality}/"):
        raise bad(
            f"its data: URL carries content type {shown(mime or '(none)')}; expected {modality}/*",
            kind="content_type",
            status=415,
        )
    if "base64" not in params:
        raise bad("only base64 data: URLs are accepted", status=400)
    return _base64(payload, policy, bad, mime)


def _base64(payload: str, policy: SourcePolicy, bad: Bad, media_type: str = "") -> Reference:
    size = len(payload) * 3 // 4
    if policy.max_bytes is not None and size > policy.max_bytes:
        raise over_bytes("its base64 payload", size, policy, bad)
    return Reference("data", payload, media_type)


def _remote(url: str, policy: SourcePolicy, bad: Bad) -> Reference:
    split = _split(url, bad)
    host = split.hostname or ""
    if not host:
        raise bad(f"the URL {shown(url)} names no host", kind="bad_url", status=400)
    # IPv6 hosts are allowed as "::1", "[::1]" or "[::1]:8000"; host names in any case.
    named = (host, f"[{host}]") if ":" in host else (host,)
    if split.port is not None:
        named += tuple(f"{n}:{split.port}" for n in named[-1:])
    allowed = {h.lower() for h in policy.allow_hosts}
    if not any(n in allowed for n in named):
        raise bad(
            f"remote URLs are read only from allowed hosts ({policy.named('allow_hosts')}); "
            f"{shown(named[-1])} is not one",
            kind="forbidden_url",
            status=403,
        )
    return Reference("remote", url)


def _path(raw: str, policy: SourcePolicy, bad: Bad) -> Reference:
    if "\0" in raw:
        raise bad("a path cannot hold a NUL byte (or %00)", kind="bad_url", status=400)
    if not policy.relative_paths and not os.path.isabs(raw):
        raise bad(f"the path {shown(raw, 80)} is not absolute; send an absolute path or a URL")
    return Reference("path", raw)


def url_scheme(url: str) -> str:
    """The URL's scheme in lower case (schemes are case-insensitive); '' for a plain path."""
    found = _SCHEME.match(url)
    return found.group(1).lower() if found else ""


def reference(value: str, modality: Modality, policy: SourcePolicy, bad: Bad, key: str):
    """`value` checked as far as it can be without I/O -> a `Reference`."""
    if key == "base64":
        return _base64(value, policy, bad)
    scheme = url_scheme(value)
    if scheme == "data":
        return _data_url(value, modality, policy, bad)
    if scheme in ("http", "https"):
        return _remote(value, policy, bad)
    if scheme == "file":
        return _path(unquote(_split(value, bad).path), policy, bad)
    if len(scheme) > 1:  # one letter: a Windows drive, read as a path
        raise bad(f"unsupported URL {shown(value, 40)}; use a path, file:, data: or http(s)")
    return _path(value, policy, bad)


def _unreadable(e: OSError, raw: str, bad: Bad) -> PartError:
    """The refusal for a path the file system will not open."""
    name = shown(raw, 80)
    if e.errno == errno.ENAMETOOLONG:
        return bad(
            f"the path {name} is too long for a file name ({e.strerror})",
            kind="bad_url",
            status=400,
        )
    if e.errno == errno.EISDIR:
        return bad(f"{name} is a folder, not a regular file", kind="not_found", status=404)
    if e.errno in (errno.EACCES, errno.EPERM):
        return bad(f"{name} is not readable", kind="forbidden_path", status=403)
    return bad(f"no such file {name} ({e.strerror})", kind="not_found", status=404)


def _read_path(raw: str, policy: SourcePolicy, bad: Bad) -> bytes:
    try:
        path = Path(os.path.realpath(raw))
        if policy.allow_paths is not None:
            # NOTE: realpath first, so '..' and symlinks cannot step out of an allowed folder.
            roots = [Path(os.path.realpath(r)) for r in policy.allow_paths]
            if not any(path == r or r in path.parents for r in roots):
                where = ", ".join(str(r) for r in roots)
                where = where or f"none (allow folders with {policy.named('allow_paths')})"
                raise bad(
                    f"{shown(raw, 80)} is outside the allowed folders: {where}",
                    kind="forbidden_path",
                    status=403,
                )
        # NOTE: one open file is checked and read, so the size checked is the size read;
        # O_NONBLOCK keeps a FIFO placed in an allowed folder from blocking the open.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise bad(f"{shown(raw, 80)} is not a regular file", kind="not_found", status=404)
            limit = policy.max_bytes
            if limit is not None and st.st_size > limit:
                raise over_bytes(shown(raw, 80), st.st_size, policy, bad)
            data = f.read() if limit is None else f.read(limit + 1)
    except OSError as e:
        raise _unreadable(e, raw, bad) from None
    if limit is not None and len(data) > limit:  # it grew since the check
        raise over_bytes(shown(raw, 80), len(data), policy, bad)
    return data


def _urllib_fetch(url: str, max_bytes: int | None, timeout_s: float) -> bytes:
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        # A redirect could lead to a host that is not allowed.
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    opener = urllib.request.build_opener(NoRedirect)
    with opener.open(url, timeout=timeout_s) as r:
        if r.status != 200:
            raise OSError(f"{url} answered {r.status}")
        data = r.read() if max_bytes is None else r.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise OverflowError(len(data))
    return data


def _fetch(url: str, policy: SourcePolicy, bad: Bad) -> bytes:
    fetch = policy.fetch or _urllib_fetch
    try:
        return fetch(url, policy.max_bytes, policy.fetch_timeout_s)
    except OverflowError as e:
        size = e.args[0] if e.args and isinstance(e.args[0], int) else policy.max_bytes + 1
        raise over_bytes(shown(url), size, policy, bad) from None
    except PartError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the fetch is the origin's
        raise bad(
            f"fetching {shown(url)} failed ({shown(str(e), 200)})",
            kind="fetch_failed",
            status=502,
        ) from None


def read(ref: Reference, policy: SourcePolicy, bad: Bad) -> bytes:
    """The bytes `ref` names (a remote one fetched with `policy.fetch`)."""
    if ref.scheme == "data":
        try:
            return decode_base64(ref.value)
        except (binascii.Error, ValueError) as e:
            raise bad(f"invalid base64 ({e})", kind="bad_base64", status=400) from None
    if ref.scheme == "path":
        return _read_path(ref.value, policy, bad)
    return _fetch(ref.value, policy, bad)


def read_source(value: Any, modality: Modality, policy: SourcePolicy, bad: Bad, key: str) -> Any:
    """A part's value as something preprocessing takes: bytes for every reference (or the
    `Reference` itself when the policy defers reads), objects as they are (when it takes them)."""
    if isinstance(value, str):
        ref = reference(value, modality, policy, bad, key)
        return ref if policy.defer_reads else read(ref, policy, bad)
    if modality == "video" and isinstance(value, (list, tuple)):
        if not value:
            raise bad("its list of frames is empty")
        return [read_source(v, "image", policy, bad, "image") for v in value]
    if not policy.allow_objects:
        raise bad(f"{shown(value)} is not accepted here; send a URL or a path")
    return value
